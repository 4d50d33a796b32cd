"""Decoding: the KV cache and attention of new tokens over it.

    cache = attn.KVCache(batch, kv_heads, capacity, head_dim, dtype="float16", page_size=256)
    cache.append(k, v)                    # (B, Hkv, n, E), (B, Hkv, n, Ev): n new tokens per sequence
    out = attn.decode_attention(q, cache) # q (B, H, 1, E): the newest token over everything so far
    out = attn.decode_attention(q, cache, is_causal=True)  # q (B, H, L, E): the last L tokens, causal

Keys and values are stored in float32, float16 or bfloat16 (rounded to
nearest even on append); attention is computed in float32 on the stored
values. Inputs are NumPy arrays or CPU torch tensors of float32; outputs are
NumPy arrays, or torch tensors when q is one.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import numpy as np

from . import _attn
from ._arrays import is_torch_tensor, to_numpy, widen_half
from ._variants import _integer, variant_kwargs

_F32 = np.dtype(np.float32)


def _f32(x: Any, fn: str, name: str, ndim: int) -> np.ndarray:
    """x as float32 of rank ndim: the extension's arrays have a fixed dtype and
    rank (the library checks the shape)."""
    a = to_numpy(x, fn, name, floats="torch.float32")
    if a.dtype != _F32:
        raise ValueError(f"{fn}: '{name}' has dtype {a.dtype}, expected float32")
    if a.ndim != ndim:
        raise ValueError(f"{fn}: '{name}' has {a.ndim} dimensions {a.shape}, expected {ndim}")
    return a


class KVCache:
    """Keys and values of B sequences, each with its own length.

    KVCache(batch, kv_heads, capacity, head_dim, value_dim=None, dtype="float32",
            page_size=0, num_pages=0)

    page_size = 0 stores one block of `capacity` tokens per sequence; a
    positive page_size stores a pool of pages (num_pages, default enough for
    every sequence at full capacity) and a block table per sequence, as vLLM
    and FlashAttention's `block_table` do; sequences may share full prefix
    pages through set_block_table.

    Sizes are checked before anything is allocated: a cache larger than the
    machine's memory raises ValueError naming its bytes. One cache may be
    shared by threads; each call is atomic (docs/decode.md, "Threads").
    """

    def __init__(self, batch: int, kv_heads: int, capacity: int, head_dim: int, value_dim: Optional[int] = None,
                 dtype: str = "float32", page_size: int = 0, num_pages: int = 0):
        fn = "attn.KVCache"
        args = dict(batch=batch, kv_heads=kv_heads, capacity=capacity, head_dim=head_dim, value_dim=value_dim or 0,
                    page_size=page_size, num_pages=num_pages)
        for name, x in args.items():  # int64 arguments of the library, which checks their values
            args[name] = _integer(x, fn, name, "an integer")
            if not -2**63 <= args[name] < 2**63:
                raise ValueError(f"{fn}: '{name}' is {x}, expected an integer that fits in int64")
        self._c = _attn.KVCache(args["batch"], args["kv_heads"], args["capacity"], args["head_dim"],
                                args["value_dim"], str(dtype), args["page_size"], args["num_pages"])

    batch = property(lambda self: self._c.batch)
    kv_heads = property(lambda self: self._c.kv_heads)
    capacity = property(lambda self: self._c.capacity)
    head_dim = property(lambda self: self._c.head_dim)
    value_dim = property(lambda self: self._c.value_dim)
    dtype = property(lambda self: self._c.dtype)
    page_size = property(lambda self: self._c.page_size)
    num_pages = property(lambda self: self._c.num_pages, doc="Pages in the pool (batch when contiguous).")
    free_pages = property(lambda self: self._c.free_pages, doc="Pages no sequence uses.")
    storage_bytes = property(lambda self: self._c.storage_bytes, doc="Bytes of K and V storage.")

    @property
    def lengths(self) -> Tuple[int, ...]:
        """Tokens held per sequence."""
        return tuple(self._c.length(b) for b in range(self._c.batch))

    def append(self, k: Any, v: Any, seq: Optional[int] = None) -> None:
        """Append n tokens: to every sequence, k (B, Hkv, n, E) and v (B, Hkv, n, Ev);
        or, with seq=b, to sequence b only, k (Hkv, n, E) and v (Hkv, n, Ev)."""
        fn = "attn.KVCache.append"
        nd = 4 if seq is None else 3
        ka, va = _f32(k, fn, "k", nd), _f32(v, fn, "v", nd)
        if seq is None:
            self._c.append_all(ka, va)
        else:
            self._c.append(int(seq), ka, va)

    def reset(self, seq: Optional[int] = None) -> None:
        """Empty sequence `seq` (its pages return to the pool), or every sequence."""
        if seq is None:
            self._c.clear()
        else:
            self._c.reset(int(seq))

    def truncate(self, seq: int, length: int) -> None:
        """Drop the tokens of sequence `seq` from position `length` on (e.g. rejected
        draft tokens); the next append writes at `length`. Paged: pages past the kept
        tokens return to the pool, and a shared page kept in part is copied first."""
        self._c.truncate(int(seq), int(length))

    def block_table(self, seq: int) -> list:
        """Paged caches: the pages of sequence `seq` in token order."""
        return list(self._c.block_table(int(seq)))

    def set_block_table(self, seq: int, pages: Sequence[int], length: int) -> None:
        """Paged caches: give sequence `seq` these pages holding `length` tokens
        (e.g. another sequence's full prefix pages; see docs/decode.md for the rules)."""
        self._c.set_block_table(int(seq), [int(p) for p in pages], int(length))

    def read(self, seq: int) -> Tuple[np.ndarray, np.ndarray]:
        """The stored keys (Hkv, length, E) and values (Hkv, length, Ev) of `seq`, as float32."""
        n = self._c.length(int(seq))
        k = np.empty((self.kv_heads, n, self.head_dim), np.float32)
        v = np.empty((self.kv_heads, n, self.value_dim), np.float32)
        self._c.read(int(seq), k, v)
        return k, v

    def __repr__(self) -> str:
        layout = f"paged({self.page_size})" if self._c.paged else "contiguous"
        return (f"attn.KVCache(batch={self.batch}, kv_heads={self.kv_heads}, capacity={self.capacity}, "
                f"head_dim={self.head_dim}, value_dim={self.value_dim}, dtype={self.dtype!r}, {layout}, "
                f"lengths={self.lengths})")


def refuse_grad(fn: str, **named: Any) -> None:
    """Decoding is inference: a torch tensor that requires grad (in grad mode)
    would silently lose its graph, so it is refused, the argument named."""
    for name, x in named.items():
        if is_torch_tensor(x) and x.requires_grad:
            import torch

            if torch.is_grad_enabled():
                raise ValueError(f"{fn}: '{name}' requires grad; decoding is inference, call it under "
                                 "torch.no_grad()")


def decode_attention(q: Any, cache: KVCache, *, scale: Optional[float] = None, is_causal: bool = False,
                     return_lse: bool = False, backend: str = "auto", num_threads: int = 0, window_size=None,
                     softcap=None, chunk_size: int = 0, alibi_slopes=None, sinks=None, attn_mask=None, k=None,
                     v=None):
    """Attention of L new queries per sequence, q (B, H, L, E), over the cache.

    k (B, Hkv, n, E) and v (B, Hkv, n, Ev), when given, are first appended to
    every sequence (one call for a decoding step, as flash_attn_with_kvcache's
    k and v); a call that is refused leaves the cache as it was.

    The queries are the last L tokens of each sequence: query i sits at
    position p = length - L + i. Every query sees the keys the cache holds;
    with is_causal=True query i sees only keys j <= p. One new token (L = 1)
    sees the same keys either way; a chunk of L > 1 new tokens of a causal
    model needs is_causal=True.
    H must be a multiple of the cache's kv_heads (grouped-query attention).
    Returns out (B, H, L, Ev), and lse (B, H, L) with return_lse. A sequence
    of length 0 gives 0 and lse -inf.

    The score rules of attn.scaled_dot_product_attention, at those positions:
      window_size  (left, right): keys p-left <= j <= p+right (-1: unbounded);
              a sliding window reads only its keys from the cache
      softcap  c > 0: scores become c * tanh(s / c) (Gemma 2); 0 or None: off
      chunk_size  C > 0: keys of the query's own chunk, p // C == j // C
              (Llama 4's local layers); 0: off
      alibi_slopes  H values: -slope_h * |p - j| added to the scores
      sinks  H values: one extra logit per head in every row's softmax, with no
              value (gpt-oss); a row that sees no key then has lse = sink
      attn_mask  bool (True = the query may attend to the key) or float (added
              to the scores; -inf masks), (B|1, H|1, L|1, capacity|1) over the
              cache's key positions 0..capacity-1 (a speculative-decoding
              tree, say); combined with is_causal and the window
    """
    fn = "attn.decode_attention"
    if not isinstance(cache, KVCache):
        raise TypeError(f"{fn}: 'cache' must be an attn.KVCache, got {type(cache).__name__}")
    refuse_grad(fn, q=q, alibi_slopes=alibi_slopes, sinks=sinks, attn_mask=attn_mask, k=k, v=v)
    qa = _f32(q, fn, "q", 4)
    ka = None if k is None else _f32(k, fn, "k", 4)
    va = None if v is None else _f32(v, fn, "v", 4)
    out = np.empty(qa.shape[:3] + (cache.value_dim,), np.float32)
    lse = np.empty(qa.shape[:3], np.float32) if return_lse else None
    var = variant_kwargs(fn, np.dtype(np.float32), window_size, alibi_slopes, softcap, sinks, None, chunk_size)
    del var["position_offset"]  # the cache fixes the positions
    if attn_mask is not None:
        var.update(mask_operand(attn_mask, fn, qa.shape, cache.capacity))
    _attn.decode_attention(qa, cache._c, out, lse, scale=None if scale is None else float(scale),
                           causal=bool(is_causal), backend=str(backend),
                           num_threads=int(num_threads), k=ka, v=va, **var)
    if is_torch_tensor(q):
        import torch

        out = torch.from_numpy(out)
        lse = torch.from_numpy(lse) if lse is not None else None
    return (out, lse) if return_lse else out


def mask_operand(attn_mask: Any, fn: str, q_shape: Tuple[int, ...], capacity: int) -> dict:
    """attn_mask as the extension's keyword: {"mask": bool} or {"bias": float32},
    rank 4 over the cache's key positions (the library checks its axes)."""
    m = to_numpy(widen_half(attn_mask), fn, "attn_mask")
    if m.ndim != 4:
        raise ValueError(f"{fn}: 'attn_mask' has shape {m.shape}, expected 4 dimensions "
                         f"(B|1, H|1, L|1, capacity|1) = ({q_shape[0]}, {q_shape[1]}, {q_shape[2]}, {capacity})")
    if m.dtype == np.bool_:
        return {"mask": np.ascontiguousarray(m)}
    if m.dtype.kind == "f":
        return {"bias": np.ascontiguousarray(m, dtype=np.float32)}
    raise ValueError(f"{fn}: 'attn_mask' has dtype {m.dtype}, expected bool (True = attend) or float "
                     "(added to the scores)")

