"""scaled_dot_product_attention and its backward with PyTorch's conventions,
on NumPy arrays and CPU torch tensors (the autograd Function is attn.torch's).

The arguments are shaped like PyTorch's: (..., L, E) queries, (..., S, E)
keys, (..., S, Ev) values, where the leading axes broadcast against each
other and against the mask's. The last leading axis is the head axis (the
one enable_gqa groups); all the others are merged into one batch axis, so
the extension always sees rank-4 (B, H, N, d) views of the caller's memory.

Half precision: query, key and value may be float16 or bfloat16 (NumPy
float16, ml_dtypes.bfloat16, torch.float16/bfloat16); everything else of the
call (masks, sinks, slopes, grad_output, the saved state) and every result is
float32 (attn.torch casts back to the inputs' dtype, as PyTorch does). float16
computes in float32 on the exact values; bfloat16 with bfloat16 products
(compute_dtype, below) unless compute_dtype="float32".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import numpy as np

from . import _attn
from ._arrays import (
    broadcast_shapes,
    expand_operand,
    float_array,
    is_torch_tensor,
    storage_array,
    sum_to_shape,
    to_numpy,
    view_bh,
    widen_half,
)
from ._variants import _integer, variant_kwargs

_FWD = "attn.scaled_dot_product_attention"
_BWD = "attn.scaled_dot_product_attention_backward"


@dataclass
class _Plan:
    """One call's arguments, validated and viewed as rank-4 arrays."""

    dtype: np.dtype  # of the results and the float32/64 arguments
    storage: str  # dtype name of q, k, v: float32, float64, float16 or bfloat16 (uint16 bits)
    lead: Tuple[int, ...]  # broadcast leading shape of the result
    L: int
    S: int
    E: int
    Ev: int
    q: np.ndarray  # (B, H, L, E)
    k: np.ndarray  # (B, Hkv, S, E)
    v: np.ndarray  # (B, Hkv, S, Ev)
    k_expanded: Tuple[int, ...]  # shape k was broadcast to before merging
    v_expanded: Tuple[int, ...]
    q_expanded: Tuple[int, ...]
    mask: Optional[np.ndarray]  # bool (Bm, Hm, Lm, Sm), True = attend
    bias: Optional[np.ndarray]  # float, same broadcasting
    bias_expanded: Tuple[int, ...]
    bias_shape: Tuple[int, ...]  # the caller's float mask shape
    shapes: Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]  # q, k, v as given
    scale: Optional[float]
    causal: bool
    backend: str
    torch_out: bool


def _plan(fn: str, query: Any, key: Any, value: Any, attn_mask: Any, dropout_p: float,
          is_causal: bool, scale: Optional[float], enable_gqa: bool, backend: str) -> _Plan:
    """Converts the arguments to the extension's rank-4 views. The library
    checks the shapes it receives, the scale and the backend; what is refused
    here is what PyTorch's conventions refuse (a mask together with
    is_causal) and what cannot be viewed at all (dtypes, fewer than two
    dimensions, leading dimensions that do not broadcast)."""
    torch_out = any(is_torch_tensor(x) for x in (query, key, value))
    q, storage = storage_array(query, fn, "query")
    k, _ = storage_array(key, fn, "key", storage)
    v, _ = storage_array(value, fn, "value", storage)
    dtype = q.dtype if storage in ("float32", "float64") else np.dtype(np.float32)
    attn_mask = widen_half(attn_mask)
    # The last two axes are (tokens, features); the leading ones are
    # broadcast and merged here, so they must exist to be told apart.
    for name, a, want in (("query", q, "(..., L, E)"), ("key", k, "(..., S, E)"),
                          ("value", v, "(..., S, Ev)")):
        if a.ndim < 2:
            raise ValueError(f"{fn}: '{name}' has shape {a.shape}, expected {want} with at least 2 dimensions")
    L, E = q.shape[-2:]
    S = k.shape[-2]
    Ev = v.shape[-1]

    mask = bias = None
    m = None
    if attn_mask is not None:
        if is_causal:
            raise ValueError(f"{fn}: attn_mask must be None when is_causal=True (as in PyTorch); "
                             "fold the causal rule into the mask instead")
        m = to_numpy(attn_mask, fn, "attn_mask")
        if m.dtype == np.bool_:
            pass
        elif m.dtype.kind == "f":
            if m.dtype != dtype:
                m = m.astype(dtype)
        else:
            raise ValueError(f"{fn}: 'attn_mask' has dtype {m.dtype}, expected bool (True = attend) "
                             f"or a float dtype (added to the scores)")
        if m.ndim < 2:
            m = m.reshape((1,) * (2 - m.ndim) + m.shape)

    q_lead, k_lead, v_lead = q.shape[:-2], k.shape[:-2], v.shape[:-2]
    named = [("query", q_lead), ("key", k_lead), ("value", v_lead)]
    if m is not None:
        named.append(("attn_mask", m.shape[:-2]))
    gqa = enable_gqa and len(q_lead) >= 1 and len(k_lead) >= 1 and len(v_lead) >= 1
    if gqa:
        # The head axes (-3) keep their own sizes (the library checks that
        # the key/value heads divide the query heads); the others broadcast.
        H = q_lead[-1]
        outer = broadcast_shapes(fn, [(n, s[:-1]) for n, s in named])
        # The mask is broadcast over the query heads here, so its head axis
        # must be one that broadcasts.
        if m is not None and len(m.shape) >= 3 and m.shape[-3] not in (1, H):
            raise ValueError(f"{fn}: 'attn_mask' has shape {m.shape}; its dimension -3 must be 1 or "
                             f"the number of query heads {H}")
        lead = outer + (H,)
        k_lead_to, v_lead_to = outer + (k_lead[-1],), outer + (v_lead[-1],)
    else:
        lead = broadcast_shapes(fn, named)
        k_lead_to = v_lead_to = lead

    qx = expand_operand(q, lead, 2, keep_ones=False)
    kx = expand_operand(k, k_lead_to, 2, keep_ones=False)
    vx = expand_operand(v, v_lead_to, 2, keep_ones=False)
    n = len(lead)
    bias_expanded: Tuple[int, ...] = ()
    bias_shape: Tuple[int, ...] = ()
    if m is not None:
        mx = expand_operand(m, lead, 2, keep_ones=True)
        if m.dtype == np.bool_:
            mask = view_bh(mx, n)
        else:
            bias = view_bh(mx, n)
            bias_expanded = mx.shape
            bias_shape = to_numpy(attn_mask, fn, "attn_mask").shape

    return _Plan(
        dtype=dtype, storage=storage, lead=lead, L=L, S=S, E=E, Ev=Ev,
        q=view_bh(qx, n), k=view_bh(kx, n), v=view_bh(vx, n),
        q_expanded=qx.shape, k_expanded=kx.shape, v_expanded=vx.shape,
        mask=mask, bias=bias, bias_expanded=bias_expanded, bias_shape=bias_shape,
        shapes=(q.shape, k.shape, v.shape),
        scale=None if scale is None else float(scale), causal=bool(is_causal), backend=str(backend),
        torch_out=torch_out,
    )


def _bh(p: _Plan) -> Tuple[int, int]:
    return p.q.shape[0], p.q.shape[1]


def _ext(p: _Plan, name: str):
    """The extension function for the plan's q, k, v dtype (bfloat16 has its own)."""
    return getattr(_attn, name + "_bf16" if p.storage == "bfloat16" else name)


def _wrap(arrays: List[np.ndarray], torch_out: bool) -> List[Any]:
    if not torch_out:
        return arrays
    import torch  # present: a torch tensor came in

    return [torch.from_numpy(a) for a in arrays]


def _refuse_autograd(fn: str, *xs: Any) -> None:
    """Tensors that require grad need the autograd Function of attn.torch;
    here they would silently lose their graph."""
    if any(is_torch_tensor(x) and x.requires_grad for x in xs):
        import torch

        if torch.is_grad_enabled():
            raise ValueError(f"{fn}: the inputs require grad; use attn.torch.scaled_dot_product_attention "
                             "(a torch.autograd.Function), or call this under torch.no_grad() or on "
                             "detached tensors")


def _like_output(x: Any, fn: str, name: str, p: _Plan, tail: Tuple[int, ...]) -> Optional[np.ndarray]:
    """grad_output or a saved-state argument (output, lse) as a (B, H, ...) view.
    Its leading dimensions are merged into (B, H) here, so they must be the
    forward output's; the library checks the rest (`tail`: L, Ev or L)."""
    if x is None:
        return None
    a = float_array(widen_half(x), fn, name, p.dtype)
    n = len(p.lead)
    if a.ndim != n + len(tail) or a.shape[:n] != p.lead:
        raise ValueError(f"{fn}: '{name}' has shape {a.shape}, expected {p.lead + tail} (the shape of the "
                         "forward's result)")
    return view_bh(a, n)


def _variants(fn: str, p: _Plan, window_size, alibi_slopes, softcap, sinks, position_offset, chunk_size):
    return variant_kwargs(fn, p.dtype, window_size, alibi_slopes, softcap, sinks, position_offset, chunk_size)


def dropout_kwargs(fn: str, dropout_p, dropout_seed, dropout_offset) -> dict:
    """The extension's dropout keywords; the library checks dropout_p's range."""
    try:
        p = float(dropout_p)
    except (TypeError, ValueError):
        raise ValueError(f"{fn}: 'dropout_p' is {dropout_p!r}, expected a number in [0, 1]") from None
    if p == 0.0:
        return {}
    if dropout_seed is None:
        raise ValueError(f"{fn}: 'dropout_seed' is required with dropout_p = {p}: the backward regenerates the "
                         "dropped entries from the seed and offset, so pass the same ones to both "
                         "(attn.torch draws a seed from torch's generator)")
    out = dict(dropout_p=p)
    for name, x in (("dropout_seed", dropout_seed), ("dropout_offset", dropout_offset)):
        out[name] = _integer(x, fn, name, "an integer in 0 .. 2^64 - 1")
        if not 0 <= out[name] < 2**64:
            raise ValueError(f"{fn}: '{name}' is {x}, expected an integer in 0 .. 2^64 - 1")
    return out


def compute_dtype_name(fn: str, compute_dtype) -> Optional[str]:
    """compute_dtype as the extension takes it: None, or a dtype name ("float32", "bfloat16",
    also "f32", "bf16"), a NumPy dtype or a torch dtype (torch.float32, torch.bfloat16)."""
    if compute_dtype is None:
        return None
    if isinstance(compute_dtype, str):
        name = compute_dtype
    else:
        try:
            name = np.dtype(compute_dtype).name
        except TypeError:
            name = str(compute_dtype)
    name = {"f32": "float32", "bf16": "bfloat16", "torch.float32": "float32", "torch.bfloat16": "bfloat16",
            "torch.float16": "float16"}.get(name, name)
    if name not in ("float32", "float16", "bfloat16"):  # float16: the library says why not
        raise ValueError(f"{fn}: 'compute_dtype' is {compute_dtype!r}, expected None, 'float32' (exact) or "
                         "'bfloat16' (bfloat16 products), or the NumPy/torch dtype")
    return name


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False, *, backend="auto", return_lse=False,
                                 return_weights=False, window_size=None, alibi_slopes=None, softcap=None,
                                 chunk_size=0, sinks=None, position_offset=None, check_finite=False,
                                 dropout_seed=None, dropout_offset=0, compute_dtype=None):
    """Scaled dot-product attention, with torch.nn.functional.scaled_dot_product_attention's
    arguments and meaning.

        out = softmax(query @ key^T * scale + mask) @ value

    Arguments
      query  (..., L, E)   key (..., S, E)   value (..., S, Ev): NumPy arrays or CPU
             torch tensors, float32, float64, float16 or bfloat16 (all three the same; NumPy
             float16, ml_dtypes.bfloat16, torch.float16/bfloat16), any strides; used in
             place (torch tensors through DLPack). float16 inputs compute in float32,
             bfloat16 ones with bfloat16 products (compute_dtype); both return float32
             results; masks, sinks and slopes are then float32 too. A copy is made only for negative or
             misaligned strides, non-native byte order, or broadcast leading axes that no
             single stride describes. Leading dimensions broadcast against each other;
             dimension -3 is the head axis.
      attn_mask  None, bool (True = the query may attend to the key) or float (added to
             the scores; -inf masks), broadcastable to (..., L, S).
      dropout_p  attention dropout: each weight is dropped with probability dropout_p and
             the kept ones scaled by 1/(1 - dropout_p) (PyTorch's rule; lse is unchanged,
             the returned weights are the dropped ones). Needs dropout_seed (an integer);
             the dropped entries are a function of (dropout_seed, dropout_offset, batch,
             head, row, key) only, so the backward, given the same seed and offset,
             drops the same ones (attn.torch draws the seed from torch's generator).
      is_causal  query i sees keys j <= i (top-left aligned, like PyTorch); attn_mask must
             then be None.
      scale  default 1/sqrt(E).
      enable_gqa  key/value may have fewer heads (dimension -3) than query, dividing it;
             query head h uses key/value head h // (H / Hkv).
      backend  "auto" (fastest that supports the call), "reference" or "fused".
      return_lse, return_weights  also return the log-sum-exp of each score row
             (..., L) and the attention weights (..., L, S).
      Variants (docs/variants.md), all combinable:
      window_size  (left, right): query at position p sees keys p-left <= j <= p+right; -1 =
             unbounded on that side (FlashAttention's name and meaning).
      alibi_slopes  H values (H = dimension -3 of query): adds -slope_h * |p - j|.
      softcap  c > 0: scores become c * tanh(s / c) after scaling (Gemma 2); 0 or None: off.
      chunk_size  C > 0: query at position p sees only keys of its own chunk,
             p // C == j // C (chunked attention, Llama 4's local layers); 0: off.
      sinks  H values: one extra logit per head in every row's softmax, with no value.
      position_offset  query row i sits at key position p = i + offset (default 0).
      check_finite  refuse NaN or Inf in query, key, value with a ValueError (one extra pass)
             instead of letting it reach the outputs it touches (the default).
      compute_dtype  the arithmetic of the products q·kᵀ and p·v: "float32" (exact; half
             inputs widened) or "bfloat16" (query, key, value and the probabilities rounded
             to bfloat16, sums, softmax and lse in float32: PyTorch's bfloat16 arithmetic,
             faster on CPUs with bfloat16 dot products); torch/NumPy dtypes also accepted.
             None (default): bfloat16 for bfloat16 inputs, float32 otherwise.

    Returns out (..., L, Ev), or the tuple (out[, lse][, weights]), in the inputs' dtype
    (float32 for float16/bfloat16 inputs). NumPy arrays for NumPy
    input, torch tensors if any of query/key/value is a tensor. Tensors that require grad
    are refused (outside torch.no_grad()): attn.torch.scaled_dot_product_attention is the
    differentiable version.

    Differences from PyTorch: a query row that can see no key returns zeros (PyTorch
    gives NaN); dropout draws its own random numbers (dropout_seed), not torch's. Bad arguments raise ValueError naming the
    function and the argument (the library's checks, which see the (B, H, N, d) views).
    """
    _refuse_autograd(_FWD, query, key, value, attn_mask, sinks)
    p = _plan(_FWD, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend)
    var = _variants(_FWD, p, window_size, alibi_slopes, softcap, sinks, position_offset, chunk_size)
    var.update(dropout_kwargs(_FWD, dropout_p, dropout_seed, dropout_offset))
    B, H = _bh(p)
    out = np.empty((B, H, p.L, p.Ev), p.dtype)
    lse = np.empty((B, H, p.L), p.dtype) if return_lse else None
    weights = np.empty((B, H, p.L, p.S), p.dtype) if return_weights else None
    _ext(p, "sdpa_forward")(p.q, p.k, p.v, out, mask=p.mask, bias=p.bias, weights=weights, lse=lse, scale=p.scale,
                       causal=p.causal, backend=p.backend, check_finite=bool(check_finite),
                       compute_dtype=compute_dtype_name(_FWD, compute_dtype), **var)
    results = [out.reshape(p.lead + (p.L, p.Ev))]
    if lse is not None:
        results.append(lse.reshape(p.lead + (p.L,)))
    if weights is not None:
        results.append(weights.reshape(p.lead + (p.L, p.S)))
    results = _wrap(results, p.torch_out)
    return results[0] if len(results) == 1 else tuple(results)


def scaled_dot_product_attention_backward(grad_output, query, key, value, attn_mask=None, dropout_p=0.0,
                                          is_causal=False, scale=None, enable_gqa=False, *,
                                          backend="auto", output=None, lse=None, window_size=None,
                                          alibi_slopes=None, softcap=None, chunk_size=0, sinks=None,
                                          position_offset=None, check_finite=False, dropout_seed=None,
                                          dropout_offset=0, compute_dtype=None):
    """Gradients of scaled_dot_product_attention.

    Takes grad_output = dLoss/dout (..., L, Ev) and the forward's arguments; returns
    (grad_query, grad_key, grad_value), plus grad_attn_mask when attn_mask is a float mask.
    Gradients are float64 for float64 inputs, float32 otherwise (half inputs included;
    attn.torch casts them to the inputs' dtype). Each gradient has the shape of its input (summed over the axes the input was
    broadcast along; with enable_gqa, over the query heads sharing a key/value head).
    With sinks, grad_sinks (H values) comes last. The variant keywords are the forward's.
    output and lse, the forward's result and log-sum-exp, may be passed to save the
    fused backend recomputing them. check_finite also refuses NaN/Inf in grad_output.
    With dropout_p > 0, dropout_seed and dropout_offset must be the forward's; so must
    compute_dtype (with bfloat16 products the backward's products take bfloat16 operands
    too, grad_output, the probabilities and their gradients rounded, sums in float32;
    output and lse are that forward's, recomputed by it when not passed).
    """
    p = _plan(_BWD, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, backend)
    var = _variants(_BWD, p, window_size, alibi_slopes, softcap, sinks, position_offset, chunk_size)
    var.update(dropout_kwargs(_BWD, dropout_p, dropout_seed, dropout_offset))
    B, H = _bh(p)
    dout = _like_output(grad_output, _BWD, "grad_output", p, (p.L, p.Ev))
    saved_out = _like_output(output, _BWD, "output", p, (p.L, p.Ev))
    saved_lse = _like_output(lse, _BWD, "lse", p, (p.L,))
    dq = np.empty((B, H, p.L, p.E), p.dtype)
    dk = np.empty(p.k.shape, p.dtype)
    dv = np.empty(p.v.shape, p.dtype)
    dbias = np.empty(p.bias.shape, p.dtype) if p.bias is not None else None
    dsinks = np.empty(H, p.dtype) if var["sinks"] is not None else None
    _ext(p, "sdpa_backward")(p.q, p.k, p.v, dout, dq, dk, dv, mask=p.mask, bias=p.bias, dbias=dbias, out=saved_out,
                        lse=saved_lse, scale=p.scale, causal=p.causal, backend=p.backend, dsinks=dsinks,
                        check_finite=bool(check_finite), compute_dtype=compute_dtype_name(_BWD, compute_dtype),
                        **var)
    # Gradients of broadcast operands are summed back to the caller's shapes.
    grads = [
        sum_to_shape(dq.reshape(p.q_expanded), p.shapes[0]),
        sum_to_shape(dk.reshape(p.k_expanded), p.shapes[1]),
        sum_to_shape(dv.reshape(p.v_expanded), p.shapes[2]),
    ]
    if dbias is not None:
        grads.append(sum_to_shape(dbias.reshape(p.bias_expanded), p.bias_shape))
    if dsinks is not None:
        grads.append(dsinks)
    torch_out = p.torch_out or is_torch_tensor(grad_output)
    return tuple(_wrap(grads, torch_out))


def resolve_backend(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                    enable_gqa=False, *, backend="auto", window_size=None,
                    alibi_slopes=None, softcap=None, chunk_size=0, sinks=None, position_offset=None):
    """Name of the backend ("reference" or "fused") that scaled_dot_product_attention
    would run for these arguments with the given `backend` request."""
    p = _plan("attn.resolve_backend", query, key, value, attn_mask, dropout_p, is_causal, scale,
              enable_gqa, backend)
    var = _variants("attn.resolve_backend", p, window_size, alibi_slopes, softcap, sinks, position_offset,
                    chunk_size)
    return _ext(p, "resolve_backend")(p.q, p.k, p.v, mask=p.mask, bias=p.bias, scale=p.scale, causal=p.causal,
                                 backend=p.backend, **var)
