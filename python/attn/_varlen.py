"""varlen_attention and its backward: attention over a packed batch of
sequences of different lengths, in FlashAttention's varlen layout and
argument order (docs/variants.md). Sequence b owns query tokens
[cu_seqlens_q[b], cu_seqlens_q[b+1]) and key tokens [cu_seqlens_k[b],
cu_seqlens_k[b+1]) and attends only within itself; the library checks the
offsets and the maxima."""

from __future__ import annotations

from typing import Any, Tuple

import numpy as np

from . import _attn
from ._arrays import float_array, int64_array, is_torch_tensor
from ._sdpa import _refuse_autograd, _wrap
from ._variants import variant_kwargs

_FWD = "attn.varlen_attention"
_BWD = "attn.varlen_attention_backward"


def _offsets(x: Any, fn: str, name: str) -> np.ndarray:
    """Offsets as the extension's 1-D int64 array (the library checks their values)."""
    return int64_array(x, fn, name, "a 1-D integer array of B + 1 offsets")


def _rank3(x: Any, fn: str, name: str, want: str, dtype: Any = None) -> np.ndarray:
    """A float array of rank 3: the extension's packed arrays have a fixed rank
    (the library checks the shape)."""
    a = float_array(x, fn, name, dtype)
    if a.ndim != 3:
        raise ValueError(f"{fn}: '{name}' has shape {a.shape}, expected {want}")
    return a


def _operands(fn: str, q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any) -> Tuple[np.ndarray, ...]:
    qa = _rank3(q, fn, "q", "(total_q, H, E)")
    ka = _rank3(k, fn, "k", "(total_k, Hkv, E)", qa.dtype)
    va = _rank3(v, fn, "v", "(total_k, Hkv, Ev)", qa.dtype)
    return qa, ka, va, _offsets(cu_q, fn, "cu_seqlens_q"), _offsets(cu_k, fn, "cu_seqlens_k")


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, scale=None,
                     is_causal=False, window_size=None, alibi_slopes=None, softcap=None, chunk_size=0, sinks=None,
                     position_offset=None, return_lse=False, backend="auto"):
    """Attention over B sequences packed along the token axis (FlashAttention's
    flash_attn_varlen_func): q (total_q, H, E), k (total_k, Hkv, E), v (total_k, Hkv, Ev),
    cu_seqlens_q/k integer (B + 1) offsets, max_seqlen_q/k the longest sequences. Every
    option applies per sequence (is_causal, window_size and chunk_size aligned at each
    sequence's start, or by position_offset); the variant keywords are
    scaled_dot_product_attention's.

    Returns out (total_q, H, Ev), or (out, lse) with lse (H, total_q) when return_lse.
    """
    _refuse_autograd(_FWD, q, k, v, sinks)
    qa, ka, va, cq, ck = _operands(_FWD, q, k, v, cu_seqlens_q, cu_seqlens_k)
    var = variant_kwargs(_FWD, qa.dtype, window_size, alibi_slopes, softcap, sinks, position_offset, chunk_size)
    out = np.empty(qa.shape[:2] + (va.shape[2],), qa.dtype)
    lse = np.empty((qa.shape[1], qa.shape[0]), qa.dtype) if return_lse else None
    _attn.varlen_forward(qa, ka, va, cq, ck, int(max_seqlen_q), int(max_seqlen_k), out, lse=lse,
                         scale=scale, causal=bool(is_causal), backend=str(backend), **var)
    results = _wrap([out] if lse is None else [out, lse], any(is_torch_tensor(x) for x in (q, k, v)))
    return results[0] if len(results) == 1 else tuple(results)


def varlen_attention_backward(grad_output, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                              scale=None, is_causal=False, window_size=None, alibi_slopes=None, softcap=None,
                              chunk_size=0, sinks=None, position_offset=None, backend="auto", output=None,
                              lse=None):
    """Gradients of varlen_attention from grad_output (total_q, H, Ev): returns
    (grad_q, grad_k, grad_v), plus grad_sinks (H) when sinks are given. output and lse
    (H, total_q), the forward's, spare the fused backend recomputing them."""
    qa, ka, va, cq, ck = _operands(_BWD, q, k, v, cu_seqlens_q, cu_seqlens_k)
    H = qa.shape[1]
    var = variant_kwargs(_BWD, qa.dtype, window_size, alibi_slopes, softcap, sinks, position_offset, chunk_size)
    g = _rank3(grad_output, _BWD, "grad_output", "(total_q, H, Ev)", qa.dtype)
    saved_out = None if output is None else _rank3(output, _BWD, "output", "(total_q, H, Ev)", qa.dtype)
    saved_lse = None
    if lse is not None:
        saved_lse = float_array(lse, _BWD, "lse", qa.dtype)
        if saved_lse.ndim != 2:  # the extension's lse is rank 2
            raise ValueError(f"{_BWD}: 'lse' has shape {saved_lse.shape}, expected (H, total_q)")
    dq, dk, dv = np.empty(qa.shape, qa.dtype), np.empty(ka.shape, qa.dtype), np.empty(va.shape, qa.dtype)
    dsinks = np.empty(H, qa.dtype) if var["sinks"] is not None else None
    _attn.varlen_backward(qa, ka, va, cq, ck, int(max_seqlen_q), int(max_seqlen_k), g, dq, dk, dv,
                          dsinks=dsinks, out=saved_out, lse=saved_lse, scale=scale,
                          causal=bool(is_causal), backend=str(backend), **var)
    grads = [dq, dk, dv] + ([dsinks] if dsinks is not None else [])
    torch_out = any(is_torch_tensor(x) for x in (q, k, v, grad_output))
    return tuple(_wrap(grads, torch_out))
