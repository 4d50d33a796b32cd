"""PyTorch integration: attn as a differentiable torch operation.

Importable only when PyTorch is installed. ScaledDotProductAttention is a
torch.autograd.Function: its forward runs attn's forward on the tensors'
memory (through DLPack, no copy) and saves the output and log-sum-exp; its
backward runs attn's backward. Gradients flow to query, key, value, a
float attn_mask and the sinks (a torch Parameter, say). VarlenAttention does
the same for the packed layout. CPU tensors, float32 or float64; the dense
call also takes float16 and bfloat16 query/key/value (bfloat16 with bfloat16
products unless compute_dtype="float32"; float16 in float32), and
returns its output (and the gradients) in the inputs' dtype, as PyTorch does.

    import attn.torch
    y = attn.torch.scaled_dot_product_attention(q, k, v, is_causal=True)
    y.sum().backward()
"""

try:
    import torch as _torch
except ImportError as e:  # pragma: no cover - exercised only without torch
    raise ImportError("attn.torch needs PyTorch (pip install torch); the NumPy API in attn "
                      "works without it") from e

from . import _sdpa, _varlen

__all__ = ["ScaledDotProductAttention", "scaled_dot_product_attention", "VarlenAttention", "varlen_attention"]


def _needs_graph(fn, alibi_slopes, *xs):
    """True when the call must go through the autograd Function. ALiBi slopes get no
    gradient, so slopes that require one are refused rather than silently left at zero."""
    if _torch.is_grad_enabled() and isinstance(alibi_slopes, _torch.Tensor) and alibi_slopes.requires_grad:
        raise ValueError(f"{fn}: 'alibi_slopes' requires grad, but attn computes no gradient for the "
                         "ALiBi slopes; pass them detached (a buffer, not a Parameter)")
    return _torch.is_grad_enabled() and any(isinstance(x, _torch.Tensor) and x.requires_grad for x in xs)


_HALF = (_torch.float16, _torch.bfloat16)


def _as_input_dtype(x, like):
    """A float32 result of a half-precision call in the dtype of `like`, the
    input it belongs to (what PyTorch's SDPA returns, and what autograd wants
    of a gradient); other results as they are."""
    if isinstance(like, _torch.Tensor) and like.dtype in _HALF and x is not None and x.dtype != like.dtype:
        return x.to(like.dtype)
    return x


def _sinks_grad(ctx, index, grads, sinks):
    """The sinks' gradient (the last of grads) in the sinks' own dtype, when asked for."""
    if sinks is None or not ctx.needs_input_grad[index]:
        return None
    return grads[-1].to(sinks.dtype)


def _dropout_seed(dropout_p):
    """A seed for attn's dropout from torch's default generator, or None without dropout."""
    if not isinstance(dropout_p, (int, float)) or dropout_p == 0:
        return None
    return int(_torch.randint(0, 2**62, (1,), dtype=_torch.int64).item())


class ScaledDotProductAttention(_torch.autograd.Function):
    """attn's scaled dot-product attention as a torch.autograd.Function.

    apply(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
          scale=None, enable_gqa=False, backend="auto", window_size=None, alibi_slopes=None,
          softcap=None, chunk_size=0, sinks=None, position_offset=None, dropout_seed=None,
          compute_dtype=None) -> output
    (Function.apply takes positional arguments only.) With dropout_p > 0 the
    backward drops the forward's entries (same dropout_seed).
    """

    @staticmethod
    def forward(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False, backend="auto", window_size=None, alibi_slopes=None, softcap=None, chunk_size=0,
                sinks=None, position_offset=None, dropout_seed=None, compute_dtype=None):
        variants = dict(window_size=window_size, alibi_slopes=alibi_slopes, softcap=softcap, chunk_size=chunk_size,
                        position_offset=position_offset, dropout_seed=dropout_seed, compute_dtype=compute_dtype)
        out, lse = _sdpa.scaled_dot_product_attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
            backend=backend, return_lse=True, sinks=sinks, **variants)
        # save_for_backward takes tensors only; a NumPy mask or sinks are kept as they are.
        mask_tensor = attn_mask if isinstance(attn_mask, _torch.Tensor) else None
        sinks_tensor = sinks if isinstance(sinks, _torch.Tensor) else None
        ctx.save_for_backward(query, key, value, mask_tensor, sinks_tensor, out, lse)
        ctx.other_mask = None if mask_tensor is not None else attn_mask
        ctx.other_sinks = None if sinks_tensor is not None else sinks
        ctx.options = (dropout_p, is_causal, scale, enable_gqa, backend)
        ctx.variants = variants
        return _as_input_dtype(out, query)

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, attn_mask, sinks, out, lse = ctx.saved_tensors
        if attn_mask is None:
            attn_mask = ctx.other_mask
        if sinks is None:
            sinks = ctx.other_sinks
        dropout_p, is_causal, scale, enable_gqa, backend = ctx.options
        grads = _sdpa.scaled_dot_product_attention_backward(
            grad_output, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
            backend=backend, output=out, lse=lse, sinks=sinks, **ctx.variants)
        float_mask = len(grads) > (4 if sinks is not None else 3)
        dmask = grads[3] if float_mask and ctx.needs_input_grad[3] else None
        dsinks = _sinks_grad(ctx, 13, grads, sinks)
        return (_as_input_dtype(grads[0], query), _as_input_dtype(grads[1], key), _as_input_dtype(grads[2], value),
                _as_input_dtype(dmask, attn_mask), None, None, None, None, None, None, None, None, None, dsinks,
                None, None, None)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False, *, backend="auto", window_size=None,
                                 alibi_slopes=None, softcap=None, chunk_size=0, sinks=None, position_offset=None,
                                 compute_dtype=None):
    """Drop-in for torch.nn.functional.scaled_dot_product_attention, computed by
    attn (see attn.scaled_dot_product_attention for the arguments, the variant
    keywords and compute_dtype included). Returns a torch tensor, in the query's dtype
    for float16 and bfloat16 inputs (bfloat16 inputs compute with bfloat16 products
    unless compute_dtype="float32", as PyTorch's; float16 ones in float32); when an input (or the sinks)
    requires grad (and grad mode is on) the call goes through
    ScaledDotProductAttention, so it is differentiable. Inputs with a
    zero-size dimension (batch, heads, lengths) give what PyTorch gives: an
    empty output, or zeros when there are no keys. With dropout_p > 0 each call
    draws a seed for attn's dropout from torch's default generator (so
    torch.manual_seed makes it reproducible); the backward drops the same
    entries."""
    if any(isinstance(x, _torch.Tensor) and x.numel() == 0 for x in (query, key, value)):
        # A zero-size dimension: PyTorch's answer (an empty output, or zeros
        # where there are no keys), computed and differentiated by PyTorch.
        return _torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p,
                                                                  is_causal, scale=scale, enable_gqa=enable_gqa)
    seed = _dropout_seed(dropout_p)
    if _needs_graph("attn.torch.scaled_dot_product_attention", alibi_slopes, query, key, value, attn_mask,
                    sinks):
        return ScaledDotProductAttention.apply(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                               enable_gqa, backend, window_size, alibi_slopes, softcap,
                                               chunk_size, sinks, position_offset, seed, compute_dtype)
    out = _sdpa.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                             enable_gqa, backend=backend, window_size=window_size,
                                             alibi_slopes=alibi_slopes, softcap=softcap, chunk_size=chunk_size,
                                             sinks=sinks, position_offset=position_offset, dropout_seed=seed,
                                             compute_dtype=compute_dtype)
    return _as_input_dtype(out, query)


class VarlenAttention(_torch.autograd.Function):
    """attn.varlen_attention as a torch.autograd.Function; gradients reach q, k, v and the sinks.

    apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=None,
          is_causal=False, window_size=None, alibi_slopes=None, softcap=None, chunk_size=0,
          sinks=None, position_offset=None, backend="auto", dropout_p=0.0, dropout_seed=None) -> output
    """

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=None,
                is_causal=False, window_size=None, alibi_slopes=None, softcap=None, chunk_size=0, sinks=None,
                position_offset=None, backend="auto", dropout_p=0.0, dropout_seed=None):
        ctx.options = dict(scale=scale, is_causal=is_causal, window_size=window_size, alibi_slopes=alibi_slopes,
                           softcap=softcap, chunk_size=chunk_size, position_offset=position_offset,
                           backend=backend, dropout_p=dropout_p, dropout_seed=dropout_seed)
        out, lse = _varlen.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            sinks=sinks, return_lse=True, **ctx.options)
        sinks_tensor = sinks if isinstance(sinks, _torch.Tensor) else None
        ctx.save_for_backward(q, k, v, sinks_tensor, out, lse)
        ctx.other_sinks = None if sinks_tensor is not None else sinks
        ctx.seqlens = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        q, k, v, sinks, out, lse = ctx.saved_tensors
        if sinks is None:
            sinks = ctx.other_sinks
        grads = _varlen.varlen_attention_backward(grad_output, q, k, v, *ctx.seqlens, sinks=sinks, output=out,
                                                  lse=lse, **ctx.options)
        dsinks = _sinks_grad(ctx, 13, grads, sinks)
        return (grads[0], grads[1], grads[2], None, None, None, None, None, None, None, None, None, None, dsinks,
                None, None, None, None)


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, scale=None,
                     is_causal=False, window_size=None, alibi_slopes=None, softcap=None, chunk_size=0, sinks=None,
                     position_offset=None, backend="auto", dropout_p=0.0):
    """attn.varlen_attention on torch tensors, differentiable (through VarlenAttention)
    when q, k, v or the sinks require grad; dropout_p as in scaled_dot_product_attention
    (a seed from torch's generator per call)."""
    seed = _dropout_seed(dropout_p)
    if _needs_graph("attn.torch.varlen_attention", alibi_slopes, q, k, v, sinks):
        return VarlenAttention.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                                     is_causal, window_size, alibi_slopes, softcap, chunk_size, sinks,
                                     position_offset, backend, dropout_p, seed)
    return _varlen.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=scale,
                                    is_causal=is_causal, window_size=window_size, alibi_slopes=alibi_slopes,
                                    softcap=softcap, chunk_size=chunk_size, sinks=sinks,
                                    position_offset=position_offset, backend=backend, dropout_p=dropout_p,
                                    dropout_seed=seed)
