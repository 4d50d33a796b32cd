"""PyTorch integration: attn as a differentiable torch operation.

Importable only when PyTorch is installed. ScaledDotProductAttention is a
torch.autograd.Function: its forward runs attn's forward on the tensors'
memory (through DLPack, no copy) and saves the output and log-sum-exp; its
backward runs attn's backward. Gradients flow to query, key, value and a
float attn_mask. CPU tensors, float32 or float64.

    import attn.torch
    y = attn.torch.scaled_dot_product_attention(q, k, v, is_causal=True)
    y.sum().backward()
"""

try:
    import torch as _torch
except ImportError as e:  # pragma: no cover - exercised only without torch
    raise ImportError("attn.torch needs PyTorch (pip install torch); the NumPy API in attn "
                      "works without it") from e

from . import _sdpa

__all__ = ["ScaledDotProductAttention", "scaled_dot_product_attention"]


class ScaledDotProductAttention(_torch.autograd.Function):
    """attn's scaled dot-product attention as a torch.autograd.Function.

    apply(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
          scale=None, enable_gqa=False, backend="auto") -> output
    (Function.apply takes positional arguments only.)
    """

    @staticmethod
    def forward(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False, backend="auto"):
        out, lse = _sdpa.scaled_dot_product_attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
            backend=backend, return_lse=True)
        # save_for_backward takes tensors only; a NumPy mask is kept as is.
        mask_tensor = attn_mask if isinstance(attn_mask, _torch.Tensor) else None
        ctx.save_for_backward(query, key, value, mask_tensor, out, lse)
        ctx.other_mask = None if mask_tensor is not None else attn_mask
        ctx.options = (is_causal, scale, enable_gqa, backend)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, attn_mask, out, lse = ctx.saved_tensors
        if attn_mask is None:
            attn_mask = ctx.other_mask
        is_causal, scale, enable_gqa, backend = ctx.options
        grads = _sdpa.scaled_dot_product_attention_backward(
            grad_output, query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa,
            backend=backend, output=out, lse=lse)
        dmask = grads[3] if len(grads) > 3 and ctx.needs_input_grad[3] else None
        return grads[0], grads[1], grads[2], dmask, None, None, None, None, None


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False, *, backend="auto"):
    """Drop-in for torch.nn.functional.scaled_dot_product_attention, computed by
    attn (see attn.scaled_dot_product_attention for the arguments). Returns a
    torch tensor; when an input requires grad (and grad mode is on) the call
    goes through ScaledDotProductAttention, so it is differentiable."""
    if _torch.is_grad_enabled() and any(
            isinstance(x, _torch.Tensor) and x.requires_grad for x in (query, key, value, attn_mask)):
        return ScaledDotProductAttention.apply(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                               enable_gqa, backend)
    return _sdpa.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                              enable_gqa, backend=backend)
