"""attn.MultiheadAttention: torch.nn.MultiheadAttention's interface over
attn::MultiheadAttention.

Inputs follow PyTorch: (L, N, E) by default, (N, L, E) with batch_first, or
unbatched (L, E). The (L, N, E) layout reaches the library as a strided view
(the batch and sequence strides swapped), not a copy. Mask polarity is
converted here: PyTorch's boolean attn_mask is True where attention is NOT
allowed, the library's is True where it is; key_padding_mask means "True =
padding" in both.

Training: forward() saves what backward() needs (the library's cache, which
owns copies of the inputs, projections and masks) on the layer, as a torch
module's autograd graph would; backward(grad_output) turns it into input
gradients and adds the parameter gradients to grads(). Attention dropout, as
in torch.nn.MultiheadAttention, acts in training mode only (train()/eval(),
training); the cache keeps the call's dropout seed, so backward() drops the
same weights the forward did. Under torch.no_grad() or torch.inference_mode()
forward() saves nothing, as torch's layer keeps no graph there.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Dict, Optional, Tuple

import numpy as np

from . import _attn
from ._arrays import _is_bfloat16, float_array, is_torch_tensor, to_numpy, widen_half
from ._decode import KVCache, refuse_grad
from ._variants import variant_kwargs

_FN = "attn.MultiheadAttention"


def _torch() -> Any:
    import torch  # present: a torch tensor came in

    return torch


def _grad_enabled() -> bool:
    """False under torch.no_grad() or torch.inference_mode() (torch imported),
    else True."""
    torch = sys.modules.get("torch")
    return torch is None or bool(torch.is_grad_enabled())


def _canon_mask(x: Any, fn: str, name: str, dtype: np.dtype) -> Optional[np.ndarray]:
    if x is None:
        return None
    m = to_numpy(widen_half(x), fn, name)  # a bfloat16 or float16 bias exactly as float32
    if m.dtype == np.bool_:
        return m
    if m.dtype.kind == "f":
        return m if m.dtype == dtype else m.astype(dtype)
    raise ValueError(f"{fn}: '{name}' has dtype {m.dtype}, expected bool or a float dtype")


# The extension's classes for each dtype.
_CLASSES = {
    np.dtype(np.float32): (_attn.MultiheadAttentionF32, _attn.MhaSavedF32),
    np.dtype(np.float64): (_attn.MultiheadAttentionF64, _attn.MhaSavedF64),
}


def _layer_mask(attn_mask: Any, fn: str, dtype: np.dtype, B: int, H: int, L: int, S: int,
                batched: bool) -> Tuple[Optional[np.ndarray], Optional[np.ndarray]]:
    """The layer's attn_mask, (L, S) or (N·num_heads, L, S) (unbatched: (num_heads, L, S)), as
    (mask, bias) of rank 4: a bool mask flipped to attn's polarity (True = may attend), or a float bias.
    Only the leading axis is checked here (PyTorch's merged N·num_heads is split into (N, num_heads));
    the library checks the (L, S) axes and the values, naming the result 'attn_mask' (bool) or
    'attn_bias' (float)."""
    m = _canon_mask(attn_mask, fn, "attn_mask", dtype)
    if m is None:
        return None, None
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
        return ~m, None  # PyTorch: True = blocked; attn: True = may attend
    return None, m


def _is_bf16(dtype: np.dtype) -> bool:
    """Whether a layer dtype is bfloat16, the one NumPy does not have (by its
    kind: dtype.name is computed on every read)."""
    return dtype.kind == "V"


def _input(x: Any, fn: str, name: str, dtype: np.dtype) -> np.ndarray:
    """A float input of the layer's dtype (the error names the layer's); a
    bfloat16 layer's as float32 (exact)."""
    if _is_bf16(dtype):
        if not _is_bfloat16(x):
            got = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
            raise ValueError(f"{fn}: '{name}' has dtype {got}, expected bfloat16 (the layer's dtype; a torch "
                             "bfloat16 tensor or an ml_dtypes.bfloat16 array; or construct the layer with "
                             "dtype=float32)")
        bits = _bf16_bits(x, fn, name)
        if bits is not None:  # widened by the library, on its threads
            wide = np.empty(bits.shape, np.float32)
            _attn.to_float_bf16(bits, wide)
            return wide
        return float_array(widen_half(x), fn, name)
    a = float_array(x, fn, name)
    if a.dtype != dtype:
        raise ValueError(f"{fn}: '{name}' has dtype {a.dtype}, expected {dtype} (the layer's dtype; "
                         f"construct it with dtype={a.dtype} or convert the input)")
    return a


def _bf16_bits(x: Any, fn: str, name: str) -> Optional[np.ndarray]:
    """The uint16 bits of a C-contiguous torch.bfloat16 tensor or
    ml_dtypes.bfloat16 array (same memory); None for any other layout."""
    bits = to_numpy(x, fn, name, half=True)
    if bits.dtype != np.uint16:
        bits = bits.view(np.uint16)
    return bits if bits.flags.c_contiguous else None


def _as_dtype(a: Optional[np.ndarray], dtype: np.dtype, torch_out: bool) -> Any:
    """A float32 or float64 result in the layer's dtype (bfloat16: rounded to
    nearest even by the library, on its threads), as a torch tensor when
    `torch_out`."""
    if a is None:
        return None
    if _is_bf16(dtype):
        bits = np.empty(a.shape, np.uint16)
        _attn.from_float_bf16(np.ascontiguousarray(a, np.float32), bits)
        return _torch().from_numpy(bits.view(np.int16)).view(_torch().bfloat16) if torch_out else bits.view(dtype)
    if torch_out:
        return _torch().from_numpy(a)
    return a.astype(dtype) if a.dtype != dtype else a


class _Saved:
    """What backward() needs from one forward() call: the extension's cache
    (which owns copies of everything, masks included) and the call's layout."""

    __slots__ = ("cache", "version", "batched", "batch_first", "torch_out", "self_attention", "out_shape",
                 "in_shapes", "taken")

    def __init__(self, cache: Any, version: int, batched: bool, batch_first: bool, torch_out: bool,
                 self_attention: bool, out_shape: Tuple[int, ...],
                 in_shapes: Tuple[Tuple[int, ...], ...]) -> None:
        self.cache = cache
        self.version = version
        self.batched = batched
        self.batch_first = batch_first
        self.torch_out = torch_out
        self.self_attention = self_attention
        self.out_shape = tuple(out_shape)
        self.in_shapes = in_shapes
        self.taken = False  # a later forward reuses the cache's buffers


class MultiheadAttention:
    """Multi-head attention with the constructor, forward() and state_dict names
    of torch.nn.MultiheadAttention, computed by libattn.

    MultiheadAttention(embed_dim, num_heads, dropout=0.0, bias=True,
                       add_bias_kv=False, add_zero_attn=False, kdim=None, vdim=None,
                       batch_first=False, device=None, dtype=None, *, seed=None, sinks=False,
                       compute_dtype=None)

    Parameters (state_dict names, weights stored [out, in]): in_proj_weight
    [3E, E] and in_proj_bias [3E] when kdim = vdim = embed_dim, otherwise
    q_proj_weight, k_proj_weight, v_proj_weight; out_proj.weight [E, E],
    out_proj.bias [E]. They start as PyTorch initialises them (Xavier-uniform
    weights, zero biases), drawn from `seed`. dtype is float32 (default),
    float64 or bfloat16 (torch.bfloat16, ml_dtypes.bfloat16 or "bfloat16";
    needs the ml_dtypes package). add_bias_kv and add_zero_attn exist for
    PyTorch's argument order and must keep their defaults.

    A bfloat16 layer is what torch's layer after .to(torch.bfloat16) is: its
    parameters hold bfloat16 values (the initial and the loaded ones rounded
    to nearest even), it takes bfloat16 inputs (torch tensors or
    ml_dtypes.bfloat16 arrays; float masks and biases in any float dtype) and
    returns bfloat16 outputs, attention weights and input gradients, rounded
    from float32; it computes as compute_dtype="bfloat16" by default, with
    float32 activations between the products. Its parameter gradients
    accumulate in float32; grads() returns them rounded to bfloat16.

    compute_dtype="bfloat16" (float32 and bfloat16 layers) gives every product of the
    layer bfloat16 operands with float32 sums, forward and backward: the
    projections' GEMMs and the attention inside (as
    attn.scaled_dot_product_attention(compute_dtype="bfloat16") computes
    it), as PyTorch's autocast does; the parameters, their gradients and the
    outputs stay float32 (master weights, as in mixed-precision training).
    None or "float32": exact float32.

    dropout (0 <= dropout <= 1, as in PyTorch) drops attention weights in
    training mode: the layer starts in it (training is True, as a torch
    module), eval() leaves it and train() returns to it; eval mode, and
    decode(), drop nothing. Each training forward() drops with a fresh seed
    of attn's dropout (SdpaOptions::dropout_seed, docs/variants.md): its
    dropout_seed= argument when given, otherwise one draw
    generator.integers(0, 2**64, dtype=np.uint64) from the layer's
    `generator` (the keyword generator=, a numpy.random.Generator; default
    numpy.random.default_rng(seed)), so a layer built with the same seed
    repeats its masks call for call. The weights returned are the dropped
    ones (what multiplies the values), as PyTorch returns them.

    sinks=True gives the layer a learnable attention sink per head (gpt-oss):
    the parameter 'sinks' (num_heads,), starting at 0 (or at the values given,
    sinks=array of num_heads), one extra logit in every softmax denominator
    that contributes no value. Its gradient is in grads()['sinks'] after
    backward(), like the weights'. The other variants (window_size, softcap,
    chunk_size, alibi_slopes, position_offset) are keywords of forward().

    Load trained weights with load_state_dict(torch_mha.state_dict()) (tensors
    or arrays); read them with state_dict().

    Training: every forward() call remembers what the backward pass needs, so
    `out, _ = mha(x, x, x); grads = mha.backward(dout)` gives the input
    gradients and adds the parameter gradients to mha.grads() (by state_dict
    name; zero_grad() clears them). Update the parameters (load_state_dict)
    only after backward. Under torch.no_grad() or torch.inference_mode() a
    forward remembers nothing (inference).
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 add_bias_kv: bool = False, add_zero_attn: bool = False, kdim: Optional[int] = None,
                 vdim: Optional[int] = None, batch_first: bool = False, device: Any = None,
                 dtype: Any = None, *, seed: Optional[int] = None, sinks: Any = False,
                 generator: Optional[np.random.Generator] = None, compute_dtype: Any = None) -> None:
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float, np.floating, np.integer)) or not (
                0.0 <= float(dropout) <= 1.0):
            raise ValueError(f"{_FN}: 'dropout' is {dropout!r}, expected a probability 0 <= dropout <= 1")
        if generator is not None and not isinstance(generator, np.random.Generator):
            raise ValueError(f"{_FN}: 'generator' is a {type(generator).__name__}, expected a "
                             "numpy.random.Generator (or None)")
        if add_bias_kv or add_zero_attn:
            raise ValueError(f"{_FN}: add_bias_kv and add_zero_attn are not supported")
        if device is not None and str(device) != "cpu":
            raise ValueError(f"{_FN}: device is '{device}'; attn runs on the CPU only")
        self.dtype = self._dtype(dtype)
        # What the library computes in: a bfloat16 layer is a float32 one
        # whose parameters hold bfloat16 values.
        self._float = np.dtype(np.float32) if _is_bf16(self.dtype) else self.dtype
        self.compute_dtype = self._compute_dtype(compute_dtype, self.dtype)
        self.embed_dim = int(embed_dim)
        self.num_heads = int(num_heads)
        self.kdim = self.embed_dim if kdim is None else int(kdim)
        self.vdim = self.embed_dim if vdim is None else int(vdim)
        self.batch_first = bool(batch_first)
        self.bias = bool(bias)
        if seed is None:
            seed = int(np.random.default_rng().integers(0, 2**63))
        self.dropout = float(dropout)
        self.generator = np.random.default_rng(int(seed)) if generator is None else generator
        self.training = True
        cls, self._cache_cls = _CLASSES[self._float]
        initial_sinks = None
        if not isinstance(sinks, bool):
            initial_sinks = variant_kwargs(_FN, self._float, None, None, None, widen_half(sinks), None)["sinks"]
        self._layer = cls(self.embed_dim, self.num_heads, bias=self.bias, kdim=self.kdim, vdim=self.vdim,
                          seed=int(seed), sinks=initial_sinks is not None or bool(sinks))
        if initial_sinks is not None:
            self._layer.set_parameter("sinks", initial_sinks)
        if _is_bf16(self.dtype):  # the initial values rounded, as torch's .to(bfloat16) does
            for n in self._layer.parameter_names():
                self._layer.set_parameter(n, self._rounded(self._layer.get_parameter(n)))
        self.head_dim = self._layer.head_dim
        self._qkv_same_embed_dim = self._layer.packed_in_proj
        # The state of the most recent forward call (None: nothing to
        # differentiate), the parameters' version (bumped by load_state_dict,
        # so a backward never mixes old activations with new weights), and a
        # lock for the gradient buffers, which backward adds to.
        self._saved: Optional[_Saved] = None
        self._version = 0
        self._grad_lock = threading.Lock()

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
        if name == "bfloat16":
            try:
                import ml_dtypes
            except ImportError:
                raise ValueError(f"{_FN}: dtype bfloat16 needs the ml_dtypes package (NumPy's bfloat16 "
                                 "arrays; pip install ml_dtypes)") from None
            return np.dtype(ml_dtypes.bfloat16)
        raise ValueError(f"{_FN}: dtype is {dtype}, expected float32, float64 or bfloat16")

    @staticmethod
    def _compute_dtype(compute_dtype: Any, dtype: np.dtype) -> Optional[str]:
        if compute_dtype is None:
            return "bfloat16" if _is_bf16(dtype) else None  # PyTorch's products for bfloat16
        name = str(compute_dtype).replace("torch.", "")
        if name not in ("float32", "bfloat16"):
            raise ValueError(f"{_FN}: compute_dtype is {compute_dtype}, expected None, 'float32' or 'bfloat16'")
        if name == "bfloat16" and dtype == np.float64:
            raise ValueError(f"{_FN}: compute_dtype is bfloat16, which takes a float32 or bfloat16 layer; "
                             f"this one is {dtype}")
        return name

    def _rounded(self, a: np.ndarray) -> np.ndarray:
        """float32 values rounded to the layer's bfloat16 (nearest even), as float32."""
        return np.ascontiguousarray(a, dtype=np.float32).astype(self.dtype).astype(np.float32)

    # Training mode ------------------------------------------------------------

    def train(self, mode: bool = True) -> "MultiheadAttention":
        """Training mode (mode=True, the default state), in which forward() applies
        the attention dropout, or eval mode (mode=False). Returns the layer."""
        self.training = bool(mode)
        return self

    def eval(self) -> "MultiheadAttention":
        """Eval mode: forward() drops nothing (train(False)). Returns the layer."""
        return self.train(False)

    def _dropout(self, fn: str, dropout_seed: Any) -> Tuple[float, int]:
        """This call's (dropout_p, dropout_seed): (0, 0) in eval mode or without dropout."""
        if dropout_seed is not None and (isinstance(dropout_seed, bool) or not isinstance(
                dropout_seed, (int, np.integer)) or not 0 <= int(dropout_seed) < 2**64):
            raise ValueError(f"{fn}: 'dropout_seed' is {dropout_seed!r}, expected an integer 0 <= seed < 2**64")
        if not self.training or self.dropout == 0.0:
            return 0.0, 0
        if dropout_seed is None:
            dropout_seed = self.generator.integers(0, 2**64, dtype=np.uint64)
        return self.dropout, int(dropout_seed)

    # Parameters ---------------------------------------------------------------

    def parameter_names(self) -> list:
        """The state_dict keys of this layer, in PyTorch's naming."""
        return list(self._layer.parameter_names())

    def state_dict(self) -> Dict[str, np.ndarray]:
        """A dict of copies of the parameters, by PyTorch state_dict name."""
        return {n: _as_dtype(self._layer.get_parameter(n), self.dtype, False) for n in self._layer.parameter_names()}

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
        self._version += 1
        for n in names:
            if n in state_dict:
                a = to_numpy(widen_half(state_dict[n]), _FN + ".load_state_dict", n)
                self._layer.set_parameter(n, self._rounded(a) if _is_bf16(self.dtype)
                                          else np.ascontiguousarray(a, dtype=self._float))

    def grads(self) -> Dict[str, np.ndarray]:
        """Copies of the parameter gradients accumulated by backward(), by
        state_dict name (the keys and shapes of state_dict()). They start at
        zero, and each backward() adds to them until zero_grad()."""
        with self._grad_lock:
            return {n: _as_dtype(self._layer.get_grad(n), self.dtype, False) for n in self._layer.parameter_names()}

    def zero_grad(self) -> None:
        """Sets every parameter gradient to zero (call it between training steps)."""
        with self._grad_lock:
            self._layer.zero_grad()

    # Forward ------------------------------------------------------------------

    def forward(self, query: Any, key: Any, value: Any, key_padding_mask: Any = None,
                need_weights: bool = True, attn_mask: Any = None, average_attn_weights: bool = True,
                is_causal: bool = False, *, backend: str = "auto", window_size: Any = None, softcap: Any = None,
                chunk_size: int = 0, alibi_slopes: Any = None,
                position_offset: Any = None, dropout_seed: Any = None) -> Tuple[Any, Optional[Any]]:
        """torch.nn.MultiheadAttention.forward: returns (attn_output, attn_weights).

        query (L, N, E) (N, L, E with batch_first) or unbatched (L, E); key (S, N, kdim);
        value (S, N, vdim). key_padding_mask (N, S): True (or -inf) = ignore that key.
        attn_mask (L, S) or (N·num_heads, L, S): bool True = NOT allowed (PyTorch's
        polarity for this layer), or float, added to the scores. is_causal: query i
        sees keys j <= i (applied together with attn_mask when both are given).
        attn_weights: (N, L, S) averaged over heads, (N, num_heads, L, S) with
        average_attn_weights=False, or None when need_weights is False.

        Variants (docs/variants.md), with query i at key position i + offset
        (offset = position_offset, default 0): window_size=(left, right) keeps
        keys i - left <= j <= i + right (-1 = unbounded on that side); softcap=c
        turns the scaled scores s into c·tanh(s/c) (0 or None: off);
        chunk_size=C keeps keys of the query's own chunk, i // C == j // C
        (0: off); alibi_slopes (num_heads,) adds -slope_h·|i - j| to head h's
        scores. With the layer's sinks, the weights of a row sum to 1 minus its
        weight on the sink.

        In training mode with dropout > 0, attention weights are dropped with
        that probability (the kept ones scaled by 1/(1 - dropout)), chosen by
        dropout_seed (an integer 0 <= seed < 2**64; default: drawn from the
        layer's generator); backward() drops the same ones.

        The layer keeps what backward() needs from this call (copies of the
        inputs, projections and masks) until the next forward call or until
        backward() consumes it. Under torch.no_grad() or
        torch.inference_mode() it keeps nothing (as torch's layer builds no
        graph there), and the state of an earlier forward, if any, stays for
        backward().
        """
        var = dict(window_size=window_size, softcap=softcap, chunk_size=chunk_size, alibi_slopes=alibi_slopes,
                   position_offset=position_offset)
        if not _grad_enabled():  # no state to fill (the library reuses its buffers from call to call)
            return self._forward(query, key, value, key_padding_mask, need_weights, attn_mask,
                                 average_attn_weights, is_causal, backend, None, var, dropout_seed)
        # A failed call leaves nothing behind to differentiate. The previous
        # call's cache lends its buffers to this one (no new allocation in a
        # training loop), taken under the lock a backward holds while it
        # reads a cache.
        with self._grad_lock:
            previous, self._saved = self._saved, None
            if previous is not None:
                previous.taken = True
        cache = previous.cache if previous is not None else self._cache_cls()
        return self._forward(query, key, value, key_padding_mask, need_weights, attn_mask,
                             average_attn_weights, is_causal, backend, cache, var, dropout_seed)

    def _forward(self, query: Any, key: Any, value: Any, key_padding_mask: Any, need_weights: bool,
                 attn_mask: Any, average_attn_weights: bool, is_causal: bool,
                 backend: str, cache: Any, var: Dict[str, Any], dropout_seed: Any) -> Tuple[Any, Optional[Any]]:
        """forward()'s work, filling `cache` for backward() (None: nothing kept)."""
        fn = _FN + ".forward"
        variants = variant_kwargs(fn, self._float, var["window_size"], widen_half(var["alibi_slopes"]),
                                  var["softcap"], None, var["position_offset"], var["chunk_size"])
        del variants["sinks"]  # the layer's own parameter
        dropout_p, seed = self._dropout(fn, dropout_seed)
        torch_out = any(is_torch_tensor(x) for x in (query, key, value))
        if torch_out and _torch().is_grad_enabled() and any(
                is_torch_tensor(x) and x.requires_grad for x in (query, key, value)):
            raise ValueError(f"{fn}: the inputs require grad, but this layer does not take part in "
                             "torch autograd; call it under torch.no_grad() or on detached tensors and "
                             "get gradients from its backward() (or use "
                             "attn.torch.scaled_dot_product_attention, an autograd Function)")
        q = _input(query, fn, "query", self.dtype)  # (a bfloat16 layer's: widened copies, one per object)
        k = q if key is query else _input(key, fn, "key", self.dtype)
        v = k if value is key else q if value is query else _input(value, fn, "value", self.dtype)
        in_shapes = (q.shape, k.shape, v.shape)
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

        kpm = None
        mask, bias = _layer_mask(attn_mask, fn, self._float, B, H, L, S, batched)
        p = _canon_mask(key_padding_mask, fn, "key_padding_mask", self._float)
        if p is not None:
            if not batched and p.ndim == 1:
                p = p[None]
            # A bool padding mask goes to the library (which checks it, a
            # rank-2 array); a float one is added to the bias here, which
            # needs its exact shape.
            if p.ndim != 2 or (p.dtype != np.bool_ and p.shape != (B, S)):
                raise ValueError(f"{fn}: 'key_padding_mask' has shape {p.shape}, expected (N, S) = {(B, S)}")
            if p.dtype == np.bool_:
                kpm = p
            else:
                add = p[:, None, None, :]
                bias = add if bias is None else bias + add

        dtype = self._float
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
        version = self._version
        self._layer.forward(q, None if same else k, None if same else v, out, attn_mask=mask, attn_bias=bias,
                            key_padding_mask=kpm, head_weights=head_w, avg_weights=avg_w,
                            causal=bool(is_causal), backend=backend, cache=cache, dropout_p=dropout_p,
                            dropout_seed=seed, compute_dtype=self.compute_dtype, **variants)

        w = avg_w if avg_w is not None else head_w
        if not batched:
            out_buf = out_buf[0]
            w = None if w is None else w[0]
        if cache is not None:
            self._saved = _Saved(cache, version, batched, self.batch_first, torch_out, same, out_buf.shape,
                                 in_shapes)
        return _as_dtype(out_buf, self.dtype, torch_out), _as_dtype(w, self.dtype, torch_out)

    __call__ = forward

    # Decoding -----------------------------------------------------------------

    def decode(self, query: Any, cache: Any, *, is_causal: bool = False, attn_mask: Any = None,
               backend: str = "auto", num_threads: int = 0, window_size: Any = None, softcap: Any = None,
               chunk_size: int = 0, alibi_slopes: Any = None) -> Any:
        """Incremental self-attention over a KV cache (float32 layers).

        query holds the next L tokens of each of the cache's N sequences: (L, N, E),
        (N, L, E) with batch_first, or unbatched (L, E) for a cache of one
        sequence. The layer projects them, appends their keys and values to
        `cache` (an attn.KVCache with kv_heads = num_heads and head_dim =
        value_dim = embed_dim // num_heads, any dtype and layout) and returns
        their attention over everything the cache holds, projected.
        Token i of sequence b sits at position length(b) + i. With
        is_causal=True it sees keys up to its own position: the rows
        forward(x, x, x, is_causal=True) over the whole sequence gives for
        these tokens. One new token (L = 1) sees the same keys either way; a
        chunk of L > 1 tokens of a causal model (a prompt) needs is_causal=True,
        as in attn.decode_attention.

        attn_mask: as in forward() (bool True = NOT allowed, or float added),
        (L, C) or (N·num_heads, L, C) over the cache's key positions 0..C-1
        (C = cache.capacity), combined with is_causal and the window.
        window_size, softcap, chunk_size, alibi_slopes: as in forward(); the
        layer's sinks apply. Errors leave the cache as it was. No backward:
        decoding is inference, and nothing is dropped in either mode.
        """
        fn = _FN + ".decode"
        if not isinstance(cache, KVCache):
            raise TypeError(f"{fn}: 'cache' must be an attn.KVCache, got {type(cache).__name__}")
        variants = variant_kwargs(fn, self._float, window_size, widen_half(alibi_slopes), softcap, None, None,
                                  chunk_size)
        del variants["sinks"], variants["position_offset"]  # the layer's own; the cache's positions
        refuse_grad(fn, query=query)
        q = _input(query, fn, "query", self.dtype)
        if q.ndim not in (2, 3):
            raise ValueError(f"{fn}: 'query' has shape {q.shape}, expected (L, N, E), (N, L, E) with batch_first, "
                             "or unbatched (L, E)")
        batched = q.ndim == 3
        if not batched:
            q = q[None]
        elif not self.batch_first:
            q = np.swapaxes(q, 0, 1)
        B, L = q.shape[0], q.shape[1]
        mask, bias = _layer_mask(attn_mask, fn, self._float, B, self.num_heads, L, cache.capacity, batched)
        if batched and not self.batch_first:
            out_buf = np.empty((L, B, self.embed_dim), self._float)
            out = np.swapaxes(out_buf, 0, 1)
        else:
            out_buf = out = np.empty((B, L, self.embed_dim), self._float)
        self._layer.decode(q, cache._c, out, attn_mask=mask, attn_bias=bias, causal=bool(is_causal),
                           backend=str(backend), num_threads=int(num_threads), **variants)
        if not batched:
            out_buf = out_buf[0]
        return _as_dtype(out_buf, self.dtype, is_torch_tensor(query))

    # Backward -----------------------------------------------------------------

    def backward(self, grad_output: Any, *, retain_graph: bool = False) -> Dict[str, Optional[Any]]:
        """Backward pass of the most recent forward() call.

        grad_output: dL/d(attn_output), with the shape and dtype of the
        attn_output that call returned ((L, N, E), (N, L, E) with batch_first,
        or (L, E) unbatched). (The attention weights get no gradient.)

        Returns {'query': dL/dquery, 'key': dL/dkey, 'value': dL/dvalue}, each
        in the shape and layout of that input, as NumPy arrays (torch tensors
        when the forward call returned tensors). When forward was given one
        object as query, key and value (query is key is value, self-attention),
        'query' holds the whole gradient of that input, the sum over its three
        uses, and 'key' and 'value' are None; pass copies to get the three
        parts separately. The gradients of the parameters are ADDED to the
        buffers grads() returns (zero_grad() resets them).

        The saved state is released afterwards, so a second backward needs a
        new forward; retain_graph=True keeps it (the next backward then adds
        its parameter gradients again). Parameters must not change between
        forward and backward (load_state_dict in between is an error). With
        dropout, the gradients flow through the weights that forward kept.
        Switching train()/eval() in between changes nothing: the saved state
        holds the forward's own dropout.
        """
        fn = _FN + ".backward"
        saved = self._saved
        if saved is None:
            raise ValueError(f"{fn}: there is no forward call to differentiate; call forward() first "
                             "(each backward() uses up the state of the last forward unless "
                             "retain_graph=True; a forward that raised, or ran under torch.no_grad() or "
                             "torch.inference_mode(), saves none)")
        if saved.version != self._version:
            raise ValueError(f"{fn}: the parameters were changed by load_state_dict after the forward "
                             "call; gradients need the weights that forward used, so run forward again")
        g = _input(grad_output, fn, "grad_output", self.dtype)
        # Checked in the caller's layout: the library sees the (N, L, E) view
        # made of it, in which a wrong shape would read as another one.
        if g.shape != saved.out_shape:
            raise ValueError(f"{fn}: 'grad_output' has shape {g.shape}, expected {saved.out_shape} (the shape "
                             "of attn_output from the last forward call)")

        def to_bld(a: np.ndarray) -> np.ndarray:  # the user's layout -> a (B, N, width) view
            if not saved.batched:
                return a[None]
            return a if saved.batch_first else np.swapaxes(a, 0, 1)

        grads = {n: np.empty(shape, self._float) for n, shape in zip(("query", "key", "value"), saved.in_shapes)}
        if saved.self_attention:
            grads["key"] = grads["value"] = None
        dq, dk, dv = (None if a is None else to_bld(a) for a in grads.values())
        with self._grad_lock:
            if saved.taken:
                raise ValueError(f"{fn}: a forward call on another thread replaced the saved state while "
                                 "this backward started; train one layer from one thread at a time")
            self._layer.backward(saved.cache, to_bld(g), dquery=dq, dkey=dk, dvalue=dv)
        if not retain_graph and self._saved is saved:
            self._saved = None
        return {n: _as_dtype(a, self.dtype, saved.torch_out) for n, a in grads.items()}

    def __repr__(self) -> str:
        return (f"attn.MultiheadAttention(embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"dropout={self.dropout}, bias={self.bias}, kdim={self.kdim}, vdim={self.vdim}, "
                f"batch_first={self.batch_first}, dtype={self.dtype.name})")
