"""Type stubs for attn.torch (requires PyTorch)."""

from typing import Any, Literal, Optional, Tuple

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
        window_size: Optional[Tuple[int, int]] = None,
        alibi_slopes: Optional[torch.Tensor] = None,
        softcap: Optional[float] = None,
        chunk_size: int = 0,
        sinks: Optional[torch.Tensor] = None,
        position_offset: Optional[int] = None,
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
    window_size: Optional[Tuple[int, int]] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    softcap: Optional[float] = None,
    chunk_size: int = 0,
    sinks: Optional[torch.Tensor] = None,
    position_offset: Optional[int] = None,
    compute_dtype: Optional[Any] = None,
) -> torch.Tensor: ...

class VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, *args: Any) -> torch.Tensor: ...  # type: ignore[override]
    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any: ...  # type: ignore[override]

def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    scale: Optional[float] = None,
    is_causal: bool = False,
    window_size: Optional[Tuple[int, int]] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    softcap: Optional[float] = None,
    chunk_size: int = 0,
    sinks: Optional[torch.Tensor] = None,
    position_offset: Optional[int] = None,
    backend: Literal["auto", "reference", "fused"] = "auto",
    dropout_p: float = 0.0,
) -> torch.Tensor: ...
