"""A plain NumPy oracle for the Python tests: attention forward and backward
in float64 with PyTorch's conventions, written independently of attn.

    S  = scale · Q·Kᵀ (+ float mask) ; bool mask / causal -> -inf
    P  = softmax_row(S)                (fully masked rows -> 0)
    Y  = P·V
Backward, step by step in reverse:
    dV = Pᵀ·dY,  dP = dY·Vᵀ,  dS = P ∘ (dP − rowsum(dP ∘ P)),
    dQ = scale·dS·K,  dK = scale·dSᵀ·Q,  dmask = dS
"""

import numpy as np


def tol(dtype, n, magnitude=1.0, factor=20.0):
    """factor · eps · sqrt(n) · max(magnitude, 1): rounding error of a
    length-n reduction over terms of about this magnitude."""
    eps = np.finfo(dtype).eps
    return factor * eps * np.sqrt(max(n, 1)) * max(magnitude, 1.0)


def _expand_kv(x, H, gqa):
    if not gqa or x.ndim < 3 or x.shape[-3] == H:
        return x
    return np.repeat(x, H // x.shape[-3], axis=-3)


def scores(q, k, mask, causal, scale, gqa):
    q = q.astype(np.float64)
    k = _expand_kv(k.astype(np.float64), q.shape[-3] if q.ndim >= 3 else 1, gqa)
    E = q.shape[-1]
    scale = 1.0 / np.sqrt(E) if scale is None else scale
    s = q @ np.swapaxes(k, -1, -2) * scale
    L, S = s.shape[-2:]
    if causal:
        s = np.where(np.tril(np.ones((L, S), bool)), s, -np.inf)
    if mask is not None:
        if mask.dtype == np.bool_:
            s = np.where(mask, s, -np.inf)
        else:
            s = s + mask.astype(np.float64)
    return s, scale


def band_mask(L, S, causal=False, window=None, offset=0):
    """The window and causal rule as a boolean mask (L, S), True where query i
    (at position i + offset) sees key j: window = (left, right) as
    FlashAttention's window_size, -1 unbounded on that side."""
    pos = np.arange(L)[:, None] + offset
    j = np.arange(S)[None, :]
    see = np.ones((L, S), bool)
    if causal:
        see &= j <= pos
    if window is not None:
        left, right = window
        if left >= 0:
            see &= j >= pos - left
        if right >= 0:
            see &= j <= pos + right
    return see


def _softmax(s):
    m = s.max(axis=-1, keepdims=True)
    dead = ~np.isfinite(m)  # rows that see no key
    m = np.where(dead, 0.0, m)
    e = np.exp(s - m)
    z = e.sum(axis=-1, keepdims=True)
    p = np.where(dead, 0.0, e / np.where(dead, 1.0, z))
    with np.errstate(divide="ignore"):
        lse = np.where(dead, -np.inf, m + np.log(np.where(dead, 1.0, z)))[..., 0]
    return p, lse


def sdpa(q, k, v, mask=None, causal=False, scale=None, gqa=False):
    """Returns (out, lse, weights) in float64."""
    s, _ = scores(q, k, mask, causal, scale, gqa)
    p, lse = _softmax(s)
    v = _expand_kv(v.astype(np.float64), q.shape[-3] if q.ndim >= 3 else 1, gqa)
    return p @ v, lse, p


def _sum_to(g, shape):
    extra = g.ndim - len(shape)
    if extra:
        g = g.sum(axis=tuple(range(extra)))
    axes = tuple(i for i, d in enumerate(shape) if d == 1 and g.shape[i] != 1)
    return g.sum(axis=axes, keepdims=True).reshape(shape) if axes else g.reshape(shape)


def _sum_groups(g, shape, gqa):
    """Sums the gradient of an expanded K/V back over query-head groups."""
    if gqa and len(shape) >= 3 and g.shape[-3] != shape[-3]:
        r = g.shape[-3] // shape[-3]
        g = g.reshape(g.shape[:-3] + (shape[-3], r) + g.shape[-2:]).sum(axis=-3)
    return _sum_to(g, shape)


def sdpa_backward(dout, q, k, v, mask=None, causal=False, scale=None, gqa=False):
    """Returns (dq, dk, dv, dmask or None) in float64, shaped like the inputs."""
    s, sc = scores(q, k, mask, causal, scale, gqa)
    p, _ = _softmax(s)
    H = q.shape[-3] if q.ndim >= 3 else 1
    k64 = _expand_kv(k.astype(np.float64), H, gqa)
    v64 = _expand_kv(v.astype(np.float64), H, gqa)
    dout = dout.astype(np.float64)
    dv = np.swapaxes(p, -1, -2) @ dout
    dp = dout @ np.swapaxes(v64, -1, -2)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
    dq = sc * ds @ k64
    dk = sc * np.swapaxes(ds, -1, -2) @ q.astype(np.float64)
    dmask = None
    if mask is not None and mask.dtype != np.bool_:
        dmask = _sum_to(ds, mask.shape)
    return (_sum_to(dq, q.shape), _sum_groups(dk, k.shape, gqa), _sum_groups(dv, v.shape, gqa), dmask)


SIZES = [1, 2, 3, 5, 7, 13, 17]
FEATS = [1, 3, 4, 8, 9, 16]
KINDS = ["none", "bool", "float", "causal"]


def random_case(rng, dtype, kind, gqa, dead_rows=True, nlead=None):
    """Random shapes and options in PyTorch's conventions, with the given
    mask kind (none, bool, float, causal) and GQA on or off; returns the
    arguments for both attn and npref (mask under 'mask')."""
    nlead = int(rng.integers(1 if gqa else 0, 4))
    lead = [int(x) for x in rng.integers(1, 4, size=nlead)]
    L, S = (int(rng.choice(SIZES)) for _ in range(2))
    E, Ev = int(rng.choice(FEATS)), int(rng.choice(FEATS))
    kv_lead = list(lead)
    if gqa:
        hkv = int(rng.integers(1, 3))
        lead[-1] = hkv * int(rng.integers(1, 4))
        kv_lead[-1] = hkv
    # Some leading axes of key/value (not the GQA head axis) broadcast.
    for i in range(nlead - (1 if gqa else 0)):
        if rng.random() < 0.25:
            kv_lead[i] = 1
    q = rng.standard_normal(tuple(lead) + (L, E)).astype(dtype)
    k = rng.standard_normal(tuple(kv_lead) + (S, E)).astype(dtype)
    v = rng.standard_normal(tuple(kv_lead) + (S, Ev)).astype(dtype)
    mask = None
    if kind in ("bool", "float"):
        full = tuple(lead) + (L, S)
        drop = int(rng.integers(0, len(full) - 1))  # leading axes the mask omits
        mshape = tuple(d if rng.random() < 0.6 else 1 for d in full[drop:])
        if kind == "bool":
            mask = rng.random(mshape) < 0.7
            if not dead_rows:
                mask[..., 0] = True
        else:
            mask = rng.standard_normal(mshape).astype(dtype)
            mask[rng.random(mshape) < 0.15] = -np.inf
            if not dead_rows:
                mask[..., 0] = 0.0
    scale = None if rng.random() < 0.7 else float(rng.uniform(0.05, 1.0))
    return dict(q=q, k=k, v=v, mask=mask, causal=kind == "causal", scale=scale, gqa=gqa)


def mha(params, query, key, value, num_heads, key_padding_mask=None, attn_mask=None, is_causal=False):
    """torch.nn.MultiheadAttention's forward in float64, batch-first inputs
    (B, L, D), (B, S, kdim), (B, S, vdim) and PyTorch's mask conventions
    (bool attn_mask True = blocked). Returns (out, per-head weights)."""
    p = {n: np.asarray(a, np.float64) for n, a in params.items()}
    H = num_heads
    if "in_proj_weight" in p:
        wq, wk, wv = np.split(p["in_proj_weight"], 3)
    else:
        wq, wk, wv = p["q_proj_weight"], p["k_proj_weight"], p["v_proj_weight"]
    if "in_proj_bias" in p:
        bq, bk, bv = np.split(p["in_proj_bias"], [wq.shape[0], wq.shape[0] + wk.shape[0]])
    else:
        bq, bk, bv = (np.zeros(w.shape[0]) for w in (wq, wk, wv))

    def heads(x, w, b):  # (B, N, width) -> (B, H, N, d)
        y = x.astype(np.float64) @ w.T + b
        return y.reshape(y.shape[0], y.shape[1], H, -1).transpose(0, 2, 1, 3)

    q, k, v = heads(query, wq, bq), heads(key, wk, bk), heads(value, wv, bv)
    B, _, L, _ = q.shape
    S = k.shape[2]
    bias = np.zeros((B, H, L, S))
    if attn_mask is not None:
        m = np.asarray(attn_mask)
        m = m.reshape(B, H, L, S) if m.ndim == 3 else m
        bias = bias + (np.where(m, -np.inf, 0.0) if m.dtype == np.bool_ else m)
    if key_padding_mask is not None:
        kpm = np.asarray(key_padding_mask)
        add = np.where(kpm, -np.inf, 0.0) if kpm.dtype == np.bool_ else kpm
        bias = bias + add[:, None, None, :]
    o, _, w = sdpa(q, k, v, bias, is_causal)
    o = o.transpose(0, 2, 1, 3).reshape(B, L, -1)
    out = o @ p["out_proj.weight"].T + p.get("out_proj.bias", 0.0)
    return out, w


def seed_of(*parts):
    """A stable seed from test parameters (hash() of a str varies per run)."""
    import zlib

    return zlib.crc32(repr(parts).encode())
