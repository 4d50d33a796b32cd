"""Type stubs for attn (see the docstrings in the package for the details)."""

from typing import Any, Dict, List, Literal, Optional, Tuple, Union

import numpy as np
import numpy.typing as npt

__version__: str

# NumPy arrays, CPU torch tensors, or anything exporting DLPack.
ArrayLike = Union[npt.NDArray[np.floating[Any]], Any]
Backend = Literal["auto", "reference", "fused"]

def scaled_dot_product_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    attn_mask: Optional[ArrayLike] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    backend: Backend = "auto",
    return_lse: bool = False,
    return_weights: bool = False,
    window_size: Optional[Tuple[int, int]] = None,
    alibi_slopes: Optional[ArrayLike] = None,
    softcap: Optional[float] = None,
    chunk_size: int = 0,
    sinks: Optional[ArrayLike] = None,
    position_offset: Optional[int] = None,
    check_finite: bool = False,
    dropout_seed: Optional[int] = None,
    dropout_offset: int = 0,
    compute_dtype: Optional[Any] = None,
) -> Any:
    """Attention with torch.nn.functional.scaled_dot_product_attention's arguments.

    query/key/value: float32, float64, float16 or bfloat16 (NumPy float16,
    ml_dtypes.bfloat16, torch half tensors). Returns out (..., L, Ev), or
    (out[, lse][, weights]) when return_lse / return_weights are set, in the
    inputs' dtype (float32 for half inputs); NumPy arrays, or torch tensors
    for tensor inputs. compute_dtype: "float32" (exact) or "bfloat16"
    (bfloat16 products); None: bfloat16 for bfloat16 inputs, else float32."""

def scaled_dot_product_attention_backward(
    grad_output: ArrayLike,
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    attn_mask: Optional[ArrayLike] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    backend: Backend = "auto",
    output: Optional[ArrayLike] = None,
    lse: Optional[ArrayLike] = None,
    window_size: Optional[Tuple[int, int]] = None,
    alibi_slopes: Optional[ArrayLike] = None,
    softcap: Optional[float] = None,
    chunk_size: int = 0,
    sinks: Optional[ArrayLike] = None,
    position_offset: Optional[int] = None,
    check_finite: bool = False,
    dropout_seed: Optional[int] = None,
    dropout_offset: int = 0,
    compute_dtype: Optional[Any] = None,
) -> Tuple[Any, ...]:
    """(grad_query, grad_key, grad_value[, grad_attn_mask for a float mask][, grad_sinks]);
    float32 for float32 and half inputs, float64 for float64."""

def resolve_backend(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    attn_mask: Optional[ArrayLike] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    backend: Backend = "auto",
    window_size: Optional[Tuple[int, int]] = None,
    alibi_slopes: Optional[ArrayLike] = None,
    softcap: Optional[float] = None,
    chunk_size: int = 0,
    sinks: Optional[ArrayLike] = None,
    position_offset: Optional[int] = None,
) -> str:
    """The backend ("reference" or "fused") a call with these arguments runs."""

def varlen_attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    cu_seqlens_q: ArrayLike,
    cu_seqlens_k: ArrayLike,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    scale: Optional[float] = None,
    is_causal: bool = False,
    window_size: Optional[Tuple[int, int]] = None,
    alibi_slopes: Optional[ArrayLike] = None,
    softcap: Optional[float] = None,
    chunk_size: int = 0,
    sinks: Optional[ArrayLike] = None,
    position_offset: Optional[int] = None,
    return_lse: bool = False,
    backend: Backend = "auto",
    dropout_p: float = 0.0,
    dropout_seed: Optional[int] = None,
    dropout_offset: int = 0,
) -> Any:
    """Packed variable-length attention: q (total_q, H, E) -> out (total_q, H, Ev)[, lse (H, total_q)]."""

def varlen_attention_backward(
    grad_output: ArrayLike,
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    cu_seqlens_q: ArrayLike,
    cu_seqlens_k: ArrayLike,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    scale: Optional[float] = None,
    is_causal: bool = False,
    window_size: Optional[Tuple[int, int]] = None,
    alibi_slopes: Optional[ArrayLike] = None,
    softcap: Optional[float] = None,
    chunk_size: int = 0,
    sinks: Optional[ArrayLike] = None,
    position_offset: Optional[int] = None,
    backend: Backend = "auto",
    output: Optional[ArrayLike] = None,
    lse: Optional[ArrayLike] = None,
    dropout_p: float = 0.0,
    dropout_seed: Optional[int] = None,
    dropout_offset: int = 0,
) -> Tuple[Any, ...]:
    """(grad_q, grad_k, grad_v[, grad_sinks])."""

class MultiheadAttention:
    """torch.nn.MultiheadAttention's interface, computed by libattn, with a
    backward pass: forward() saves its state (none under torch.no_grad() or
    torch.inference_mode()), backward(grad_output) returns the input
    gradients and accumulates the parameter gradients (grads())."""

    embed_dim: int
    num_heads: int
    head_dim: int
    kdim: int
    vdim: int
    batch_first: bool
    bias: bool
    dtype: np.dtype[Any]
    compute_dtype: Optional[str]
    dropout: float
    training: bool
    generator: np.random.Generator

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: Optional[int] = None,
        vdim: Optional[int] = None,
        batch_first: bool = False,
        device: Any = None,
        dtype: Any = None,
        *,
        seed: Optional[int] = None,
        sinks: Union[bool, ArrayLike] = False,
        generator: Optional[np.random.Generator] = None,
        compute_dtype: Any = None,
    ) -> None: ...
    def train(self, mode: bool = True) -> "MultiheadAttention":
        """Training mode (the default): forward() applies the attention dropout."""
    def eval(self) -> "MultiheadAttention":
        """Eval mode: forward() drops nothing."""
    def parameter_names(self) -> List[str]: ...
    def state_dict(self) -> Dict[str, npt.NDArray[Any]]: ...  # the layer's dtype (bfloat16: ml_dtypes)
    def load_state_dict(self, state_dict: Dict[str, ArrayLike], strict: bool = True) -> None: ...
    def grads(self) -> Dict[str, npt.NDArray[Any]]:
        """Copies of the accumulated parameter gradients, by state_dict name."""
    def zero_grad(self) -> None:
        """Resets every parameter gradient to zero."""
    def backward(self, grad_output: ArrayLike, *, retain_graph: bool = False) -> Dict[str, Optional[Any]]:
        """Backward pass of the most recent forward() call, from grad_output
        (the shape and dtype of that call's attn_output).

        Returns {'query', 'key', 'value'} gradients in the inputs' shapes and
        layout (torch tensors if forward returned tensors). After a call with
        query is key is value, 'query' is the total gradient of that input
        and 'key' / 'value' are None. Parameter gradients are added to
        grads(). The saved state is released unless retain_graph=True."""
    def forward(
        self,
        query: ArrayLike,
        key: ArrayLike,
        value: ArrayLike,
        key_padding_mask: Optional[ArrayLike] = None,
        need_weights: bool = True,
        attn_mask: Optional[ArrayLike] = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
        *,
        backend: Backend = "auto",
        window_size: Optional[Tuple[int, int]] = None,
        softcap: Optional[float] = None,
        chunk_size: int = 0,
        alibi_slopes: Optional[ArrayLike] = None,
        position_offset: Optional[int] = None,
        dropout_seed: Optional[int] = None,
    ) -> Tuple[Any, Optional[Any]]:
        """(attn_output, attn_weights); also saves what backward() needs."""
    def decode(
        self,
        query: ArrayLike,
        cache: "KVCache",
        *,
        is_causal: bool = False,
        attn_mask: Optional[ArrayLike] = None,
        backend: Backend = "auto",
        num_threads: int = 0,
        window_size: Optional[Tuple[int, int]] = None,
        softcap: Optional[float] = None,
        chunk_size: int = 0,
        alibi_slopes: Optional[ArrayLike] = None,
    ) -> Any:
        """Incremental self-attention of the next tokens query ((L, N, E), (N, L, E)
        with batch_first, or (L, E)) over a KV cache, whose keys and values it
        extends; the output has query's shape (float32 layers)."""
    def __call__(
        self,
        query: ArrayLike,
        key: ArrayLike,
        value: ArrayLike,
        key_padding_mask: Optional[ArrayLike] = None,
        need_weights: bool = True,
        attn_mask: Optional[ArrayLike] = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
        *,
        backend: Backend = "auto",
        window_size: Optional[Tuple[int, int]] = None,
        softcap: Optional[float] = None,
        chunk_size: int = 0,
        alibi_slopes: Optional[ArrayLike] = None,
        position_offset: Optional[int] = None,
        dropout_seed: Optional[int] = None,
    ) -> Tuple[Any, Optional[Any]]: ...

Dtype = Literal["float32", "float16", "bfloat16", "f32", "f16", "bf16"]

class KVCache:
    """Keys and values of B sequences (own lengths); float32/float16/bfloat16
    storage; contiguous (page_size=0) or paged with block tables."""

    def __init__(
        self,
        batch: int,
        kv_heads: int,
        capacity: int,
        head_dim: int,
        value_dim: Optional[int] = None,
        dtype: Dtype = "float32",
        page_size: int = 0,
        num_pages: int = 0,
    ) -> None: ...
    batch: int
    kv_heads: int
    capacity: int
    head_dim: int
    value_dim: int
    dtype: str
    page_size: int
    num_pages: int
    free_pages: int
    storage_bytes: int
    @property
    def lengths(self) -> Tuple[int, ...]: ...
    def append(self, k: ArrayLike, v: ArrayLike, seq: Optional[int] = None) -> None: ...
    def reset(self, seq: Optional[int] = None) -> None: ...
    def truncate(self, seq: int, length: int) -> None: ...
    def block_table(self, seq: int) -> List[int]: ...
    def set_block_table(self, seq: int, pages: List[int], length: int) -> None: ...
    def read(self, seq: int) -> Tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]: ...

def decode_attention(
    q: ArrayLike,
    cache: KVCache,
    *,
    scale: Optional[float] = None,
    is_causal: bool = False,
    return_lse: bool = False,
    backend: Backend = "auto",
    num_threads: int = 0,
    window_size: Optional[Tuple[int, int]] = None,
    softcap: Optional[float] = None,
    chunk_size: int = 0,
    alibi_slopes: Optional[ArrayLike] = None,
    sinks: Optional[ArrayLike] = None,
    attn_mask: Optional[ArrayLike] = None,
    k: Optional[ArrayLike] = None,
    v: Optional[ArrayLike] = None,
) -> Any:
    """Attention of q (B, H, L, E), the last L tokens of each sequence, over
    the cache; out (B, H, L, Ev) (and lse (B, H, L) with return_lse). With k
    (B, Hkv, n, E) and v (B, Hkv, n, Ev), those new tokens are appended first."""
