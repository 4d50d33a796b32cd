"""attn — exact, fast, trainable attention on the CPU, from NumPy and PyTorch.

Functions follow PyTorch's names and argument conventions:

    attn.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0,
                                      is_causal=False, scale=None, enable_gqa=False,
                                      *, backend="auto", return_lse=False,
                                      return_weights=False)
    attn.scaled_dot_product_attention_backward(grad_output, q, k, v, ...)
    attn.MultiheadAttention(embed_dim, num_heads, ...)   # like torch.nn.MultiheadAttention,
                                                         # plus backward(), grads(), zero_grad()
    attn.KVCache(batch, kv_heads, capacity, head_dim, dtype=..., page_size=...)
    attn.decode_attention(q, cache, *, scale=None, is_causal=False, return_lse=False, k=None, v=None)
    attn.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)
    attn.varlen_attention_backward(grad_output, q, k, v, cu_seqlens_q, ...)

The variants (docs/variants.md) are keywords of the attention functions,
with FlashAttention's names: window_size=(left, right), softcap= (0 = off),
chunk_size= (0 = off), alibi_slopes=, sinks=, position_offset=.

Inputs are NumPy arrays or CPU torch tensors (float32 or float64, any
strides), used in place. `attn.torch` (importable when PyTorch is installed)
has the autograd Function that makes attn differentiable inside torch models.
Arguments are checked once, by the library: its errors arrive as ValueError
with a message naming the function and the argument.
"""

from ._decode import KVCache, decode_attention
from ._multihead import MultiheadAttention
from ._sdpa import (
    resolve_backend,
    scaled_dot_product_attention,
    scaled_dot_product_attention_backward,
)
from ._varlen import varlen_attention, varlen_attention_backward

__version__ = "0.1.0"

__all__ = [
    "MultiheadAttention",
    "KVCache",
    "decode_attention",
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_backward",
    "resolve_backend",
    "varlen_attention",
    "varlen_attention_backward",
    "__version__",
]
