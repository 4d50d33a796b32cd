"""attn.MultiheadAttention: torch.nn.MultiheadAttention's interface over
attn::MultiheadAttention.

Inputs follow PyTorch: (L, N, E) by default, (N, L, E) with batch_first, or
unbatched (L, E). The (L, N, E) layout reaches the library as a strided view
(the batch and sequence strides swapped), not a copy. Mask polarity is
converted here: PyTorch's boolean attn_mask is True where attention is NOT
allowed, the library's is True where it is; key_padding_mask means "True =
padding" in both.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Optional, Tuple

import numpy as np

from . import _attn
from ._arrays import float_array, is_torch_tensor, to_numpy

_FN = "attn.MultiheadAttention"


def _canon_mask(x: Any, name: str, dtype: np.dtype) -> Optional[np.ndarray]:
    if x is None:
        return None
    m = to_numpy(x, _FN + ".forward", name)
    if m.dtype == np.bool_:
        return m
    if m.dtype.kind == "f":
        return m if m.dtype == dtype else m.astype(dtype)
    raise ValueError(f"{_FN}.forward: '{name}' has dtype {m.dtype}, expected bool or a float dtype")


class MultiheadAttention:
    """Multi-head attention with the constructor, forward() and state_dict names
    of torch.nn.MultiheadAttention, computed by libattn.

    MultiheadAttention(embed_dim, num_heads, dropout=0.0, bias=True,
                       add_bias_kv=False, add_zero_attn=False, kdim=None, vdim=None,
                       batch_first=False, device=None, dtype=None, *, seed=None)

    Parameters (state_dict names, weights stored [out, in]): in_proj_weight
    [3E, E] and in_proj_bias [3E] when kdim = vdim = embed_dim, otherwise
    q_proj_weight, k_proj_weight, v_proj_weight; out_proj.weight [E, E],
    out_proj.bias [E]. They start as PyTorch initialises them (Xavier-uniform
    weights, zero biases), drawn from `seed`. dtype is float32 (default) or
    float64. dropout, add_bias_kv and add_zero_attn exist for PyTorch's
    argument order and must keep their defaults.

    Load trained weights with load_state_dict(torch_mha.state_dict()) (tensors
    or arrays); read them with state_dict().
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: Optional[int] = None,
                 vdim: Optional[int] = None, batch_first: bool = False, device: Any = None,
                 dtype: Any = None, *, seed: Optional[int] = None) -> None:
        if dropout != 0.0:
            raise ValueError(f"{_FN}: dropout is {dropout}; attn is exact, only dropout=0.0 is supported")
        if add_bias_kv or add_zero_attn:
            raise ValueError(f"{_FN}: add_bias_kv and add_zero_attn are not supported")
        if device is not None and str(device) != "cpu":
            raise ValueError(f"{_FN}: device is '{device}'; attn runs on the CPU only")
        self.dtype = self._dtype(dtype)
        self.embed_dim = int(embed_dim)
        self.num_heads = int(num_heads)
        self.kdim = self.embed_dim if kdim is None else int(kdim)
        self.vdim = self.embed_dim if vdim is None else int(vdim)
        self.batch_first = bool(batch_first)
        self.bias = bool(bias)
        if seed is None:
            seed = int(np.random.default_rng().integers(0, 2**63))
        cls = _attn.MultiheadAttentionF32 if self.dtype == np.float32 else _attn.MultiheadAttentionF64
        self._layer = cls(self.embed_dim, self.num_heads, self.bias, self.kdim, self.vdim, int(seed))
        self.head_dim = self._layer.head_dim
        self._qkv_same_embed_dim = self._layer.packed_in_proj

    @staticmethod
    def _dtype(dtype: Any) -> np.dtype:
        if dtype is None:
            return np.dtype(np.float32)
        if isinstance(dtype, type) and issubclass(dtype, np.generic):
            dtype = np.dtype(dtype)
        name = str(dtype).replace("torch.", "")
        if name in ("float32", "float"):
            return np.dtype(np.float32)
        if name in ("float64", "double"):
            return np.dtype(np.float64)
        raise ValueError(f"{_FN}: dtype is {dtype}, expected float32 or float64")

    # Parameters ---------------------------------------------------------------

    def parameter_names(self) -> list:
        """The state_dict keys of this layer, in PyTorch's naming."""
        return list(self._layer.parameter_names())

    def state_dict(self) -> Dict[str, np.ndarray]:
        """A dict of copies of the parameters, by PyTorch state_dict name."""
        return {n: self._layer.get_parameter(n) for n in self._layer.parameter_names()}

    def load_state_dict(self, state_dict: Dict[str, Any], strict: bool = True) -> None:
        """Copies parameters in from a dict of arrays or tensors (e.g. a
        torch.nn.MultiheadAttention state_dict); shapes must match exactly.
        With strict, missing and unexpected keys are errors."""
        names = self.parameter_names()
        if strict:
            missing = [n for n in names if n not in state_dict]
            unexpected = [k for k in state_dict if k not in names]
            if missing or unexpected:
                raise ValueError(f"{_FN}.load_state_dict: missing keys {missing}, unexpected keys "
                                 f"{unexpected}; this layer has {names}")
        for n in names:
            if n in state_dict:
                a = to_numpy(state_dict[n], _FN + ".load_state_dict", n)
                self._layer.set_parameter(n, np.ascontiguousarray(a, dtype=self.dtype))

    # Forward ------------------------------------------------------------------

    def forward(self, query: Any, key: Any, value: Any, key_padding_mask: Any = None,
                need_weights: bool = True, attn_mask: Any = None, average_attn_weights: bool = True,
                is_causal: bool = False, *, backend: str = "auto") -> Tuple[Any, Optional[Any]]:
        """torch.nn.MultiheadAttention.forward: returns (attn_output, attn_weights).

        query (L, N, E) (N, L, E with batch_first) or unbatched (L, E); key (S, N, kdim);
        value (S, N, vdim). key_padding_mask (N, S): True (or -inf) = ignore that key.
        attn_mask (L, S) or (N·num_heads, L, S): bool True = NOT allowed (PyTorch's
        polarity for this layer), or float, added to the scores. is_causal: query i
        sees keys j <= i (applied together with attn_mask when both are given).
        attn_weights: (N, L, S) averaged over heads, (N, num_heads, L, S) with
        average_attn_weights=False, or None when need_weights is False.
        """
        fn = _FN + ".forward"
        torch_out = any(is_torch_tensor(x) for x in (query, key, value))
        if torch_out and sys.modules["torch"].is_grad_enabled() and any(
                is_torch_tensor(x) and x.requires_grad for x in (query, key, value)):
            raise ValueError(f"{fn}: the inputs require grad, but this layer does not take part in "
                             "torch autograd; call it under torch.no_grad() or on detached tensors "
                             "(attn.torch.scaled_dot_product_attention is differentiable)")
        q = float_array(query, fn, "query", self.dtype)
        k = float_array(key, fn, "key", self.dtype)
        v = float_array(value, fn, "value", self.dtype)
        same = query is key and key is value and self._qkv_same_embed_dim
        if q.ndim not in (2, 3):
            raise ValueError(f"{fn}: 'query' has shape {q.shape}, expected (L, N, E), (N, L, E) with "
                             "batch_first, or unbatched (L, E)")
        batched = q.ndim == 3
        for name, a in (("key", k), ("value", v)):
            if a.ndim != q.ndim:
                raise ValueError(f"{fn}: '{name}' has {a.ndim} dimensions but 'query' has {q.ndim} "
                                 "(batched and unbatched inputs cannot be mixed)")
        if batched:
            if not self.batch_first:  # (L, N, E) -> a (N, L, E) view
                q, k, v = (np.swapaxes(a, 0, 1) for a in (q, k, v))
        else:
            q, k, v = (a[None] for a in (q, k, v))
        B, L, S = q.shape[0], q.shape[1], k.shape[1]
        H = self.num_heads

        mask = bias = kpm = None
        m = _canon_mask(attn_mask, "attn_mask", self.dtype)
        if m is not None:
            if m.ndim == 2:
                m = m[None, None]
            elif m.ndim == 3 and m.shape[0] == B * H:
                m = m.reshape(B, H, *m.shape[1:])
            elif m.ndim == 3 and not batched and m.shape[0] == H:
                m = m[None]
            else:
                raise ValueError(f"{fn}: 'attn_mask' has shape {m.shape}, expected (L, S) = {(L, S)} or "
                                 f"(N·num_heads, L, S) = {(B * H, L, S)}")
            if m.dtype == np.bool_:
                mask = ~m  # PyTorch: True = blocked; attn: True = may attend
            else:
                bias = m
        p = _canon_mask(key_padding_mask, "key_padding_mask", self.dtype)
        if p is not None:
            if not batched and p.ndim == 1:
                p = p[None]
            if p.shape != (B, S):
                raise ValueError(f"{fn}: 'key_padding_mask' has shape {p.shape}, expected (N, S) = {(B, S)}")
            if p.dtype == np.bool_:
                kpm = p
            else:  # a float padding mask is added to the scores, like a bias
                add = p[:, None, None, :]
                bias = add if bias is None else bias + add

        dtype = self.dtype
        if batched and not self.batch_first:
            out_buf = np.empty((L, B, self.embed_dim), dtype)
            out = np.swapaxes(out_buf, 0, 1)
        else:
            out_buf = out = np.empty((B, L, self.embed_dim), dtype)
        head_w = avg_w = None
        if need_weights:
            if average_attn_weights:
                avg_w = np.empty((B, L, S), dtype)
            else:
                head_w = np.empty((B, H, L, S), dtype)
        self._layer.forward(q, k, v, out, mask, bias, kpm, bool(is_causal), backend, head_w, avg_w, same)

        w = avg_w if avg_w is not None else head_w
        if not batched:
            out_buf = out_buf[0]
            w = None if w is None else w[0]
        if torch_out:
            torch = sys.modules["torch"]
            out_buf = torch.from_numpy(out_buf)
            w = None if w is None else torch.from_numpy(w)
        return out_buf, w

    __call__ = forward

    def __repr__(self) -> str:
        return (f"attn.MultiheadAttention(embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"bias={self.bias}, kdim={self.kdim}, vdim={self.vdim}, batch_first={self.batch_first}, "
                f"dtype={self.dtype.name})")
