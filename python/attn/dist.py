"""Context-parallel attention over MPI with mpi4py (attn::dist, docs/distributed.md).

Each process of an MPI communicator holds a shard of the sequence: its rows
of the queries and of the keys/values, rank-4 float32 arrays (B, H, N_r, E)
cut by :func:`shard`. The functions here take the local shards and an mpi4py
communicator, and return the local rows of the output (and the gradients of
the local shards), equal to the single-process
:func:`attn.scaled_dot_product_attention` up to float32 rounding:

* ``ring_attention`` / ``ring_attention_backward``: the K/V shards travel
  around the ring of ranks; any P.
* ``ulysses_attention`` / ``ulysses_attention_backward``: all-to-all to a
  head split; H and Hkv must divide by P.

Optional: this module imports without mpi4py and without MPI; the functions
then raise ImportError saying what is missing (:func:`available` tells
beforehand). key_lengths, alibi_slopes and sinks are global values, the same
on every rank; position_offset is a global position (query row i of the
whole sequence sits at key position i + offset).
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from ._arrays import int64_array
from ._variants import variant_kwargs

__all__ = [
    "available",
    "chunk_layout",
    "shard",
    "unshard",
    "ring_attention",
    "ring_attention_backward",
    "ulysses_attention",
    "ulysses_attention_backward",
]


def _load() -> Tuple[Any, Optional[str]]:
    try:
        from . import _attn_dist  # built only when CMake found an MPI
    except ImportError as e:
        return None, ("attn was built without MPI (attn._attn_dist is missing: install libopenmpi-dev "
                      f"and reinstall attn; {e})")
    try:
        from mpi4py import MPI  # noqa: F401  (initialises MPI)
    except ImportError as e:
        return None, f"mpi4py is not installed (pip install mpi4py; {e})"
    return _attn_dist, None


def available() -> Tuple[bool, str]:
    """(True, "") when attn.dist can run here, else (False, the reason)."""
    ext, why = _load()
    return ext is not None, why or ""


def _ext(fn: str) -> Any:
    ext, why = _load()
    if ext is None:
        raise ImportError(f"{fn}: {why}")
    return ext


def _comm(fn: str, comm: Any) -> Tuple[int, int, int]:
    """(address of the MPI_Comm handle, size, rank) of an mpi4py communicator."""
    from mpi4py import MPI
    if not isinstance(comm, MPI.Comm):
        raise ValueError(f"{fn}: 'comm' is {type(comm).__name__}, expected an mpi4py communicator (MPI.Comm)")
    if comm == MPI.COMM_NULL:
        raise ValueError(f"{fn}: 'comm' is MPI.COMM_NULL")
    return MPI._addressof(comm), comm.Get_size(), comm.Get_rank()


def chunk_layout(n: int, size: int, rank: int, layout: str = "zigzag") -> List[Tuple[int, int]]:
    """The chunks (begin, length) of a length-n sequence that `rank` of `size` holds, in order."""
    return _ext("attn.dist.chunk_layout").chunk_layout(n, size, rank, layout)


def shard(full: Any, size: int, rank: int, layout: str = "zigzag", axis: int = -2) -> np.ndarray:
    """This rank's rows of `full` along `axis` (the sequence axis), its chunks one after the other."""
    a = np.asarray(full)
    chunks = chunk_layout(a.shape[axis], size, rank, layout)
    return np.concatenate([np.take(a, np.arange(b, b + n), axis=axis) for b, n in chunks], axis=axis)


def unshard(shards: Sequence[Any], layout: str = "zigzag", axis: int = -2) -> np.ndarray:
    """The full sequence from every rank's shard (in rank order, e.g. from comm.gather)."""
    parts = [np.asarray(s) for s in shards]
    size = len(parts)
    n = sum(p.shape[axis] for p in parts)
    shape = list(parts[0].shape)
    shape[axis] = n
    full = np.empty(shape, dtype=parts[0].dtype)
    for r, p in enumerate(parts):
        i = 0
        for b, m in chunk_layout(n, size, r, layout):
            idx = [slice(None)] * full.ndim
            src = [slice(None)] * full.ndim
            idx[axis], src[axis] = slice(b, b + m), slice(i, i + m)
            full[tuple(idx)] = p[tuple(src)]
            i += m
    return full


def _f32(fn: str, name: str, x: Any) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype != np.float32:
        raise ValueError(f"{fn}: '{name}' has dtype {a.dtype}, expected float32 (context-parallel attention "
                         "runs the fused float32 kernel)")
    if a.ndim != 4:
        raise ValueError(f"{fn}: '{name}' has shape {a.shape}, expected this rank's shard (B, H, N_local, d)")
    return np.ascontiguousarray(a)


def _kwargs(fn: str, q: np.ndarray, is_causal: bool, scale: Optional[float], layout: str, window_size: Any,
            softcap: Any, alibi_slopes: Any, sinks: Any, position_offset: Any, chunk_size: Any, key_lengths: Any,
            num_threads: int) -> dict:
    kw = variant_kwargs(fn, np.dtype(np.float32), window_size, alibi_slopes, softcap, sinks, position_offset,
                        chunk_size)
    if key_lengths is not None:
        # The extension takes a 1-D int64 array; the library checks its length (B) and values.
        kw["key_lengths"] = int64_array(key_lengths, fn, "key_lengths",
                                        f"({q.shape[0]},) integers (B, the global key lengths)")
    kw.update(scale=None if scale is None else float(scale), causal=bool(is_causal), layout=layout,
              num_threads=int(num_threads))
    return kw


def _timeout(fn: str, timeout: Any) -> Optional[float]:
    if timeout is None:
        return None
    t = float(timeout)
    if not t > 0:
        raise ValueError(f"{fn}: 'timeout' is {timeout!r}, expected seconds > 0 (math.inf: no bound)")
    return t


def _agreed(ext: Any, fn: str, address: int, timeout: Any, checks: Any) -> Any:
    """This rank's own checks (dtypes, ranks, keywords), then the verdict shared
    with the other ranks within the bounded wait, before any message of the
    call: a rank whose checks failed raises its error, every other rank a
    ValueError naming it, and none is left waiting."""
    try:
        result, err, bound = checks(), None, _timeout(fn, timeout)
    except (ValueError, TypeError) as e:
        result, err, bound = None, e, None
    bad = ext.first_failed_rank(address, err is not None, timeout=bound, caller=fn)
    if err is not None:
        raise err
    if bad >= 0:
        raise ValueError(f"{fn}: rank {bad} rejected its arguments (its message names the problem)")
    return result


def _forward(strategy: str, fn: str, query: Any, key: Any, value: Any, comm: Any, is_causal: bool,
             scale: Optional[float], layout: str, window_size: Any, softcap: Any, alibi_slopes: Any, sinks: Any,
             position_offset: Any, chunk_size: Any, key_lengths: Any, num_threads: int, timeout: Any,
             return_lse: bool) -> Any:
    ext = _ext(fn)
    address, _, _ = _comm(fn, comm)

    def checks() -> Tuple[Any, ...]:
        q, k, v = _f32(fn, "query", query), _f32(fn, "key", key), _f32(fn, "value", value)
        kw = _kwargs(fn, q, is_causal, scale, layout, window_size, softcap, alibi_slopes, sinks, position_offset,
                     chunk_size, key_lengths, num_threads)
        return q, v, ext.prepare(strategy, address, q, k, v, timeout=_timeout(fn, timeout), **kw)

    q, v, call = _agreed(ext, fn, address, timeout, checks)
    out = np.empty(q.shape[:3] + v.shape[3:], dtype=np.float32)
    lse = np.empty(q.shape[:3], dtype=np.float32)
    ext.forward(call, out, lse=lse)
    return (out, lse) if return_lse else out


def _backward(strategy: str, fn: str, grad_output: Any, query: Any, key: Any, value: Any, comm: Any,
              output: Any, lse: Any, is_causal: bool, scale: Optional[float], layout: str, window_size: Any,
              softcap: Any, alibi_slopes: Any, sinks: Any, position_offset: Any, chunk_size: Any, key_lengths: Any,
              num_threads: int, timeout: Any) -> Tuple[np.ndarray, ...]:
    ext = _ext(fn)
    address, _, _ = _comm(fn, comm)

    def checks() -> Tuple[Any, ...]:
        q, k, v = _f32(fn, "query", query), _f32(fn, "key", key), _f32(fn, "value", value)
        dout = _f32(fn, "grad_output", grad_output)
        if (output is None) != (lse is None):
            raise ValueError(f"{fn}: give both 'output' and 'lse' (the forward's) or neither")
        saved = {}
        if output is not None:
            saved = dict(out=_f32(fn, "output", output), lse=np.ascontiguousarray(np.asarray(lse, dtype=np.float32)))
        kw = _kwargs(fn, q, is_causal, scale, layout, window_size, softcap, alibi_slopes, sinks, position_offset,
                     chunk_size, key_lengths, num_threads)
        call = ext.prepare(strategy, address, q, k, v, timeout=_timeout(fn, timeout), **kw)
        return q, k, v, dout, saved, kw["sinks"] is not None, call

    q, k, v, dout, saved, with_sinks, call = _agreed(ext, fn, address, timeout, checks)
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    dsinks = np.empty(q.shape[1], dtype=np.float32) if with_sinks else None
    ext.backward(call, dout, dq, dk, dv, dsinks=dsinks, **saved)
    return (dq, dk, dv) if dsinks is None else (dq, dk, dv, dsinks)


_DOC_ARGS = """
    query (B, H, L_r, E), key (B, Hkv, S_r, E), value (B, Hkv, S_r, Ev): this rank's float32 shards
    (see shard()); comm: an mpi4py communicator (every rank calls with the same shapes and options).
    is_causal, scale, window_size=(left, right), softcap, chunk_size, alibi_slopes (H), sinks (H), position_offset and
    key_lengths (B) as in attn.scaled_dot_product_attention, with global positions and lengths;
    layout: 'zigzag' (balanced under causal) or 'contiguous'; num_threads per rank;
    timeout: the bounded wait in seconds (default: ATTN_DIST_TIMEOUT, else 600): a rank that waits
    longer for another (dead, or stuck elsewhere) prints a message and aborts the job.
    Every rank must make the same call with the same shapes, outputs and options; a rank whose
    arguments are bad, or ranks that disagree, make every rank raise ValueError naming the problem."""


def ring_attention(query: Any, key: Any, value: Any, comm: Any, *, is_causal: bool = False,
                   scale: Optional[float] = None, layout: str = "zigzag", window_size: Any = None,
                   softcap: Any = None, alibi_slopes: Any = None, sinks: Any = None, position_offset: Any = None,
                   chunk_size: int = 0, key_lengths: Any = None, num_threads: int = 0, timeout: Any = None,
                   return_lse: bool = False) -> Any:
    """Ring attention: this rank's output rows (B, H, L_r, Ev), and lse (B, H, L_r) with return_lse."""
    return _forward("ring", "attn.dist.ring_attention", query, key, value, comm, is_causal, scale, layout,
                    window_size, softcap, alibi_slopes, sinks, position_offset, chunk_size, key_lengths, num_threads,
                    timeout, return_lse)


def ulysses_attention(query: Any, key: Any, value: Any, comm: Any, *, is_causal: bool = False,
                      scale: Optional[float] = None, layout: str = "zigzag", window_size: Any = None,
                      softcap: Any = None, alibi_slopes: Any = None, sinks: Any = None,
                      position_offset: Any = None, chunk_size: int = 0, key_lengths: Any = None, num_threads: int = 0,
                      timeout: Any = None, return_lse: bool = False) -> Any:
    """All-to-all (Ulysses) attention; H and Hkv must divide by the number of ranks."""
    return _forward("ulysses", "attn.dist.ulysses_attention", query, key, value, comm, is_causal, scale, layout,
                    window_size, softcap, alibi_slopes, sinks, position_offset, chunk_size, key_lengths, num_threads,
                    timeout, return_lse)


def ring_attention_backward(grad_output: Any, query: Any, key: Any, value: Any, comm: Any, *, output: Any = None,
                            lse: Any = None, is_causal: bool = False, scale: Optional[float] = None,
                            layout: str = "zigzag", window_size: Any = None, softcap: Any = None,
                            alibi_slopes: Any = None, sinks: Any = None, position_offset: Any = None,
                            chunk_size: int = 0, key_lengths: Any = None, num_threads: int = 0,
                            timeout: Any = None) -> Tuple[np.ndarray, ...]:
    """Gradients of this rank's shards: (dq, dk, dv), and dsinks (H, the whole gradient) when sinks
    are given. output and lse are the forward's (return_lse=True); recomputed when not given."""
    return _backward("ring", "attn.dist.ring_attention_backward", grad_output, query, key, value, comm, output, lse,
                     is_causal, scale, layout, window_size, softcap, alibi_slopes, sinks, position_offset,
                     chunk_size, key_lengths, num_threads, timeout)


def ulysses_attention_backward(grad_output: Any, query: Any, key: Any, value: Any, comm: Any, *, output: Any = None,
                               lse: Any = None, is_causal: bool = False, scale: Optional[float] = None,
                               layout: str = "zigzag", window_size: Any = None, softcap: Any = None,
                               alibi_slopes: Any = None, sinks: Any = None, position_offset: Any = None,
                               chunk_size: int = 0, key_lengths: Any = None, num_threads: int = 0,
                               timeout: Any = None) -> Tuple[np.ndarray, ...]:
    """The backward of ulysses_attention, as ring_attention_backward."""
    return _backward("ulysses", "attn.dist.ulysses_attention_backward", grad_output, query, key, value, comm, output,
                     lse, is_causal, scale, layout, window_size, softcap, alibi_slopes, sinks, position_offset,
                     chunk_size, key_lengths, num_threads, timeout)


for _f in (ring_attention, ulysses_attention, ring_attention_backward, ulysses_attention_backward):
    _f.__doc__ = (_f.__doc__ or "") + "\n" + _DOC_ARGS
del _f
