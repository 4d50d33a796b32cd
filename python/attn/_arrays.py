"""Array plumbing shared by the attn functions: NumPy / PyTorch inputs,
broadcasting of leading dimensions, and zero-copy rank-4 views.

Every array that reaches the extension is a NumPy array whose memory is the
caller's own whenever possible: PyTorch CPU tensors arrive through DLPack,
and leading dimensions are broadcast and merged with stride arithmetic
(``as_strided``), not copies. A copy is made only where no strided view can
describe the data: negative or misaligned strides, non-native byte order, or
merging broadcast leading dimensions that do not fit one stride.

Half precision (the dense call's q, k, v only): NumPy float16 arrays and
torch.float16 tensors are float16 arrays here; bfloat16, which NumPy lacks
(torch.bfloat16, ml_dtypes.bfloat16), travels as its uint16 bit patterns, a
view of the same memory, tagged "bfloat16" by storage_array.
"""

from __future__ import annotations

import sys
from typing import Any, Optional, Sequence, Tuple

import numpy as np
from numpy.lib.stride_tricks import as_strided

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
# The dense call's stored dtypes other than bfloat16, by name.
_STORAGE_NAMES = {np.dtype(np.float32): "float32", np.dtype(np.float64): "float64", np.dtype(np.float16): "float16"}
# The storage dtypes of the dense call's q, k, v, by name.
STORAGE_DTYPES = ("float32", "float64", "float16", "bfloat16")


def is_torch_tensor(x: Any) -> bool:
    """True for a torch.Tensor, without importing torch."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _torch_to_numpy(x: Any, fn: str, name: str, half: bool = False,
                    floats: str = "torch.float32 or torch.float64") -> np.ndarray:
    """A CPU torch tensor as NumPy through DLPack. DLPack describes memory,
    not torch's lazy views: a tensor with the negative bit (torch.neg views,
    ``c.conj().imag``) or the conjugate bit holds the un-negated values, so
    those bits are resolved first (a copy); dtypes and layouts NumPy cannot
    take are refused with the argument named. With `half`, float16 comes as
    float16 and bfloat16 as its uint16 bits (same memory); without, both are
    refused, the message naming `floats`, the dtypes the caller takes."""
    torch = sys.modules["torch"]
    if x.device.type != "cpu":
        raise ValueError(f"{fn}: '{name}' is on device '{x.device}', expected a CPU tensor")
    if x.dtype in (torch.float16, torch.bfloat16) and not half:
        raise ValueError(f"{fn}: '{name}' has dtype {x.dtype}, expected {floats} "
                         "(half precision is taken by scaled_dot_product_attention's query, key and value; "
                         "convert with .float())")
    if x.layout != torch.strided:
        raise ValueError(f"{fn}: '{name}' has layout {x.layout}, expected a dense (strided) tensor")
    t = x.detach()
    if t.is_neg():
        t = t.resolve_neg()
    if t.is_conj():
        t = t.resolve_conj()
    if t.dtype == torch.bfloat16:
        return np.from_dlpack(t.view(torch.int16)).view(np.uint16)
    try:
        return np.from_dlpack(t)
    except (RuntimeError, BufferError, TypeError) as e:
        raise ValueError(f"{fn}: '{name}' (dtype {x.dtype}) cannot be read as a NumPy array: {e}") from None


def to_numpy(x: Any, fn: str, name: str, half: bool = False,
             floats: str = "torch.float32 or torch.float64") -> np.ndarray:
    """A NumPy view of x (an ndarray, a CPU torch tensor, or anything
    array-like), with non-negative strides that are multiples of the element
    size. Tensors share memory with the result (DLPack) unless a lazy
    negation or conjugation had to be applied first. `half`: torch half
    tensors are taken (see _torch_to_numpy); `floats` names the float dtypes
    the caller takes, for the message that refuses a half tensor."""
    if isinstance(x, np.ndarray):
        a = x
    elif is_torch_tensor(x):
        a = _torch_to_numpy(x, fn, name, half, floats)
    elif hasattr(x, "__dlpack__"):
        try:
            a = np.from_dlpack(x)
        except (RuntimeError, BufferError, TypeError) as e:
            raise ValueError(f"{fn}: '{name}' cannot be read through DLPack: {e}") from None
    else:
        a = np.asarray(x)
    if not a.dtype.isnative:
        a = a.astype(a.dtype.newbyteorder("="))
    if any(s < 0 or s % a.itemsize for s in a.strides):
        a = np.ascontiguousarray(a)
    return a


def float_array(x: Any, fn: str, name: str, dtype: Optional[np.dtype] = None) -> np.ndarray:
    """to_numpy, then require float32/float64 (and `dtype` when given)."""
    a = to_numpy(x, fn, name)
    if a.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{fn}: '{name}' has dtype {a.dtype}, expected float32 or float64")
    if dtype is not None and a.dtype != dtype:
        raise ValueError(f"{fn}: '{name}' has dtype {a.dtype}, expected {dtype} (the dtype of 'query')")
    return a


def int64_array(x: Any, fn: str, name: str, want: str) -> np.ndarray:
    """A 1-D integer array as the extension's contiguous int64 (the library
    checks the values); `want` describes it for the message. Unsigned values
    beyond int64 are refused with their value, not wrapped to negatives."""
    a = to_numpy(x, fn, name)
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise ValueError(f"{fn}: '{name}' has dtype {a.dtype} and shape {a.shape}, expected {want}")
    if a.dtype.kind == "u" and a.size and int(a.max()) > np.iinfo(np.int64).max:
        i = int(np.argmax(a))
        raise ValueError(f"{fn}: '{name}' has value {int(a[i])} at index {i}, expected at most 2^63 - 1")
    return np.ascontiguousarray(a, dtype=np.int64)


def _is_bfloat16(x: Any) -> bool:
    """torch.bfloat16 tensors and ml_dtypes.bfloat16 arrays."""
    if is_torch_tensor(x):
        return x.dtype == sys.modules["torch"].bfloat16
    # (dtype.name is computed on every access: the kind, a field, rules out the others first)
    return isinstance(x, np.ndarray) and x.dtype.kind == "V" and x.dtype.name == "bfloat16"


def storage_array(x: Any, fn: str, name: str, want: Optional[str] = None) -> Tuple[np.ndarray, str]:
    """The dense call's q, k, v: (array, dtype name), the name one of
    STORAGE_DTYPES; a bfloat16 array comes back as its uint16 bits (same
    memory). `want`: the dtype name of 'query', which key and value must share."""
    bf16 = _is_bfloat16(x)
    a = to_numpy(x, fn, name, half=True)
    if bf16:
        a = a.view(np.uint16) if a.dtype != np.uint16 else a
        kind = "bfloat16"
    elif a.dtype in _STORAGE_NAMES:
        kind = _STORAGE_NAMES[a.dtype]
    else:
        raise ValueError(f"{fn}: '{name}' has dtype {a.dtype}, expected float32, float64, float16 or bfloat16")
    if want is not None and kind != want:
        raise ValueError(f"{fn}: '{name}' has dtype {kind}, expected {want} (the dtype of 'query')")
    return a, kind


def widen_half(x: Any) -> Any:
    """A torch half tensor, ml_dtypes.bfloat16 or float16 array as float32
    (exact); anything else as it is. For the arguments of a call that are
    float32 when q, k, v are half (masks, sinks, grad_output, ...)."""
    if is_torch_tensor(x):
        torch = sys.modules["torch"]
        return x.detach().float() if x.dtype in (torch.float16, torch.bfloat16) else x
    if isinstance(x, np.ndarray) and (x.dtype == np.float16 or x.dtype.name == "bfloat16"):
        return x.astype(np.float32)
    return x


def broadcast_shapes(fn: str, named: Sequence[Tuple[str, Tuple[int, ...]]]) -> Tuple[int, ...]:
    """np.broadcast_shapes with an error message naming the arguments."""
    try:
        return tuple(np.broadcast_shapes(*(s for _, s in named)))
    except ValueError:
        desc = ", ".join(f"{n} {tuple(s)}" for n, s in named)
        raise ValueError(f"{fn}: the leading (batch) dimensions do not broadcast: {desc}") from None


def _merge(a: np.ndarray, first: int, last: int) -> Optional[Tuple[int, int]]:
    """(size, stride in bytes) of axes [first, last) merged into one axis, or
    None when no single stride describes them."""
    size = 1
    for d in a.shape[first:last]:
        size *= d
    dims = [(d, s) for d, s in zip(a.shape[first:last], a.strides[first:last]) if d != 1]
    if not dims:
        return size, 0
    for (_, s0), (d1, s1) in zip(dims, dims[1:]):
        if s0 != s1 * d1:
            return None
    return size, dims[-1][1]


def view_bh(a: np.ndarray, nlead: int) -> np.ndarray:
    """Views a (lead..., *tail) array with `nlead` leading axes as
    (B, H, *tail): H is the last leading axis, B all the others merged.
    Copies only when the merge has no strided form."""
    if nlead == 2:  # (B, H, ...) already
        return a
    tail_shape, tail_strides = a.shape[nlead:], a.strides[nlead:]
    if nlead == 0:
        return as_strided(a, (1, 1) + tail_shape, (0, 0) + tail_strides, writeable=False)
    merged = _merge(a, 0, nlead - 1)
    if merged is None:
        a = np.ascontiguousarray(a)
        tail_strides = a.strides[nlead:]
        merged = _merge(a, 0, nlead - 1)
        assert merged is not None
    b, bs = merged
    h, hs = a.shape[nlead - 1], a.strides[nlead - 1]
    return as_strided(a, (b, h) + tail_shape, (bs, hs) + tail_strides, writeable=False)


def expand_operand(a: np.ndarray, lead: Tuple[int, ...], tail: int, keep_ones: bool) -> np.ndarray:
    """Broadcasts the leading axes of `a` (all but its last `tail` axes) to
    `lead`. With keep_ones, size-1 axes the extension can broadcast itself
    stay size 1: the last leading axis (heads) and the tail, and the other
    leading axes when all of them are 1; the result keeps the shape the
    gradient of a broadcast operand must be summed back to."""
    n = len(lead)
    pad = n - (a.ndim - tail)
    if pad == 0 and a.shape[:n] == lead:  # nothing to broadcast (the common case)
        return a
    a = a.reshape((1,) * pad + a.shape)
    if not keep_ones:
        return np.broadcast_to(a, lead + a.shape[n:])
    if n == 0:
        return a
    outer = a.shape[: n - 1]
    if all(d == 1 for d in outer):
        target = outer + a.shape[n - 1 :]
    else:
        target = lead[: n - 1] + a.shape[n - 1 :]
    return np.broadcast_to(a, target)


def sum_to_shape(g: np.ndarray, shape: Tuple[int, ...]) -> np.ndarray:
    """Sums a broadcast gradient back to the operand's own shape."""
    extra = g.ndim - len(shape)
    if extra > 0:
        g = g.sum(axis=tuple(range(extra)))
    axes = tuple(i for i, d in enumerate(shape) if d == 1 and g.shape[i] != 1)
    if axes:
        g = g.sum(axis=axes, keepdims=True)
    return np.ascontiguousarray(g.reshape(shape))
