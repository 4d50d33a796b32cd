"""Type stubs for attn.torch (requires PyTorch)."""

from typing import Any, Literal, Optional

import torch

class ScaledDotProductAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: Optional[torch.Tensor] = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: Optional[float] = None,
        enable_gqa: bool = False,
        backend: str = "auto",
    ) -> torch.Tensor: ...
    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any: ...  # type: ignore[override]

def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    backend: Literal["auto", "reference", "fused"] = "auto",
) -> torch.Tensor: ...
