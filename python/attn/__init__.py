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
    attn.decode_attention(q, cache, *, scale=None, causal=True, return_lse=False)

Inputs are NumPy arrays or CPU torch tensors (float32 or float64, any
strides), used in place. `attn.torch` (importable when PyTorch is installed)
has the autograd Function that makes attn differentiable inside torch models.
Errors from the library arrive as ValueError with its message.
"""

from ._decode import KVCache, decode_attention
from ._multihead import MultiheadAttention
from ._sdpa import (
    resolve_backend,
    scaled_dot_product_attention,
    scaled_dot_product_attention_backward,
)

__version__ = "0.1.0"

__all__ = [
    "MultiheadAttention",
    "KVCache",
    "decode_attention",
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_backward",
    "resolve_backend",
    "__version__",
]
