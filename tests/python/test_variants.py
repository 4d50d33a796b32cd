"""The attention variants from Python (docs/variants.md): window, ALiBi,
soft-cap, sinks, position offset and packed variable-length batches, forward
and backward, against a float64 NumPy reference written here that builds each
variant the plain way (the window as a boolean mask, ALiBi as an additive
bias matrix, the sinks as one extra key column of value zero, soft-cap by its
formula, varlen as a loop of dense calls), and against PyTorch where torch
can express the same thing."""

import numpy as np
import pytest

import attn
import npref

# ---------------------------------------------------------------- reference


def ref_forward(q, k, v, *, scale=None, causal=False, window=None, alibi=None, softcap=None, sinks=None,
                offset=0):
    """q (B, H, L, E), k (B, Hkv, S, E), v (B, Hkv, S, Ev) -> out, lse and what the backward needs."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, H, L, E = q.shape
    S = k.shape[2]
    rep = H // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    scale = 1 / np.sqrt(E) if scale is None else scale
    u = q @ np.swapaxes(k, -1, -2) * scale
    s = softcap * np.tanh(u / softcap) if softcap else u.copy()
    pos = np.arange(L)[:, None] + offset  # query positions
    j = np.arange(S)[None, :]
    if alibi is not None:  # an additive bias matrix
        s = s - np.asarray(alibi, np.float64)[None, :, None, None] * np.abs(pos - j)
    s = np.where(npref.band_mask(L, S, causal, window, offset), s, -np.inf)  # the window and causal as a boolean mask
    if sinks is not None:  # one more key column whose score is the sink and whose value is zero
        col = np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None, None], (B, H, L, 1))
        s = np.concatenate([s, col], axis=-1)
        v = np.concatenate([v, np.zeros((B, H, 1, v.shape[-1]))], axis=2)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    e = np.exp(s - m)
    tot = e.sum(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(tot > 0, e / tot, 0)
        lse = np.where(tot[..., 0] > 0, np.log(tot[..., 0]) + m[..., 0], -np.inf)
    out = p @ v
    return out, lse, dict(p=p, u=u, k=k, v=v, q=q, scale=scale, rep=rep, S=S)


def ref_backward(dout, fwd, out, *, softcap=None, sinks=None):
    """Gradients (dq, dk, dv[, dsinks]) of ref_forward, step by step."""
    p, k, v, q, scale, rep, S = (fwd[n] for n in ("p", "k", "v", "q", "scale", "rep", "S"))
    dout = np.asarray(dout, np.float64)
    dv = np.swapaxes(p, -1, -2) @ dout
    dp = dout @ np.swapaxes(v, -1, -2)
    D = (dout * out).sum(-1, keepdims=True)
    ds = p * (dp - D)
    dsinks = ds[..., S].sum(axis=(0, 2)) if sinks is not None else None
    ds, dv = ds[..., :S], dv[:, :, :S]
    if softcap:
        ds = ds * (1 - np.tanh(fwd["u"] / softcap) ** 2)
    dq = ds @ k * scale
    dk = np.swapaxes(ds, -1, -2) @ q * scale
    B, H = q.shape[:2]
    dk = dk.reshape(B, H // rep, rep, *dk.shape[2:]).sum(2)
    dv = dv.reshape(B, H // rep, rep, *dv.shape[2:]).sum(2)
    return (dq, dk, dv) + ((dsinks,) if sinks is not None else ())


# ------------------------------------------------------------------- cases

CASES = {
    "window": dict(window=(2, 1)),
    "window_left_only": dict(window=(3, -1)),
    "window_causal": dict(window=(2, 0), causal=True),
    "alibi": dict(alibi=True),
    "softcap": dict(softcap=2.0),
    "sinks": dict(sinks=True),
    "offset_causal": dict(causal=True, offset=2),
    "offset_window_alibi": dict(window=(1, 1), offset=-3, alibi=True),
    "all": dict(window=(3, 0), causal=True, alibi=True, softcap=1.5, sinks=True, offset=1),
    "sinks_masked_rows": dict(window=(0, 0), offset=-4, sinks=True),  # rows 0..3 see no key
}


def draw(rng, dtype, B=2, H=4, Hkv=2, L=5, S=7, E=8, Ev=6):
    q = rng.standard_normal((B, H, L, E)).astype(dtype)
    k = rng.standard_normal((B, Hkv, S, E)).astype(dtype)
    v = rng.standard_normal((B, Hkv, S, Ev)).astype(dtype)
    dout = rng.standard_normal((B, H, L, Ev)).astype(dtype)
    slopes = np.exp2(-8.0 * np.arange(1, H + 1) / H).astype(dtype)
    sinks = rng.standard_normal(H).astype(dtype)
    return q, k, v, dout, slopes, sinks


def kwargs_of(case, slopes, sinks):
    """(attn keywords, reference keywords) of a case."""
    c = CASES[case]
    a = dict(is_causal=c.get("causal", False), window_size=c.get("window"), softcap=c.get("softcap"),
             alibi_slopes=slopes if c.get("alibi") else None, sinks=sinks if c.get("sinks") else None,
             position_offset=c.get("offset"))
    r = dict(causal=a["is_causal"], window=a["window_size"], softcap=a["softcap"], alibi=a["alibi_slopes"],
             sinks=a["sinks"], offset=c.get("offset", 0))
    return a, r


BACKENDS = [("reference", np.float64, 1e-12), ("reference", np.float32, 2e-5), ("fused", np.float32, 2e-5)]


@pytest.mark.parametrize("backend,dtype,tol", BACKENDS, ids=[f"{b}-{np.dtype(d).name}" for b, d, _ in BACKENDS])
@pytest.mark.parametrize("case", sorted(CASES))
def test_dense_variant_forward_backward(case, backend, dtype, tol):
    rng = np.random.default_rng(abs(hash(case)) % 2**32)
    q, k, v, dout, slopes, sinks = draw(rng, dtype)
    a, r = kwargs_of(case, slopes, sinks)
    out, lse = attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, backend=backend, return_lse=True, **a)
    want, want_lse, fwd = ref_forward(q, k, v, **r)
    assert out.dtype == dtype and out.shape == want.shape
    np.testing.assert_allclose(out, want, atol=tol, rtol=tol)
    np.testing.assert_allclose(lse, want_lse, atol=tol, rtol=tol)
    grads = attn.scaled_dot_product_attention_backward(dout, q, k, v, enable_gqa=True, backend=backend, **a)
    want_grads = ref_backward(dout, fwd, want, softcap=r["softcap"], sinks=r["sinks"])
    assert len(grads) == len(want_grads)
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), grads, want_grads):
        assert g.shape == w.shape, name
        np.testing.assert_allclose(g, w, atol=10 * tol, rtol=10 * tol, err_msg=name)


def test_sinks_rows_that_see_no_key():
    """A row whose keys are all masked puts all its weight on the sink: out 0, lse = sink."""
    rng = np.random.default_rng(3)
    q, k, v, dout, slopes, sinks = draw(rng, np.float64)
    out, lse = attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, window_size=(0, 0), position_offset=-4,
                                                 sinks=sinks, return_lse=True)
    assert np.all(out[:, :, :4] == 0)
    np.testing.assert_array_equal(lse[:, :, :4], np.broadcast_to(sinks[None, :, None], (2, 4, 4)))
    assert np.all(out[:, :, 4] != 0)


def test_sinks_gradient_by_finite_differences():
    rng = np.random.default_rng(4)
    q, k, v, dout, slopes, sinks = draw(rng, np.float64)
    kw = dict(enable_gqa=True, window_size=(2, 1), softcap=3.0, backend="reference")
    dsinks = attn.scaled_dot_product_attention_backward(dout, q, k, v, sinks=sinks, **kw)[3]
    h = 1e-6
    for i in range(len(sinks)):
        e = np.zeros_like(sinks)
        e[i] = h
        up = attn.scaled_dot_product_attention(q, k, v, sinks=sinks + e, **kw)
        dn = attn.scaled_dot_product_attention(q, k, v, sinks=sinks - e, **kw)
        np.testing.assert_allclose(dsinks[i], ((up - dn) * dout).sum() / (2 * h), rtol=1e-6, atol=1e-8)


def test_variants_with_leading_axes_and_float_mask():
    """Variants combine with a float mask (and its gradient) and (..., L, E) inputs."""
    rng = np.random.default_rng(5)
    q, k, v, dout, slopes, sinks = draw(rng, np.float64, Hkv=4)
    bias = rng.standard_normal((1, 4, 5, 7))
    a = dict(window_size=(2, 2), alibi_slopes=slopes, sinks=sinks, backend="reference")
    out = attn.scaled_dot_product_attention(q, k, v, bias, **a)
    grads = attn.scaled_dot_product_attention_backward(dout, q, k, v, bias, **a)
    assert len(grads) == 5 and grads[3].shape == bias.shape and grads[4].shape == (4,)
    # ALiBi folded into the bias by hand gives the same result.
    alibi_bias = -slopes[:, None, None] * np.abs(np.arange(5)[:, None] - np.arange(7)[None, :])
    out2 = attn.scaled_dot_product_attention(q, k, v, bias + alibi_bias, window_size=(2, 2), sinks=sinks,
                                             backend="reference")
    np.testing.assert_allclose(out, out2, atol=1e-12)
    grads2 = attn.scaled_dot_product_attention_backward(dout, q, k, v, bias + alibi_bias, window_size=(2, 2),
                                                        sinks=sinks, backend="reference")
    for g, g2 in zip(grads, grads2):
        np.testing.assert_allclose(g, g2, atol=1e-12)


# ------------------------------------------------------------------ varlen


def packed(rng, dtype, lens_q, lens_k, H=4, Hkv=2, E=8, Ev=6):
    tq, tk = sum(lens_q), sum(lens_k)
    q = rng.standard_normal((tq, H, E)).astype(dtype)
    k = rng.standard_normal((tk, Hkv, E)).astype(dtype)
    v = rng.standard_normal((tk, Hkv, Ev)).astype(dtype)
    dout = rng.standard_normal((tq, H, Ev)).astype(dtype)
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int64)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int64)
    return q, k, v, dout, cu_q, cu_k


def to_dense(x):  # (N, H, d) -> (1, H, N, d)
    return np.swapaxes(x, 0, 1)[None]


@pytest.mark.parametrize("backend,dtype,tol", BACKENDS, ids=[f"{b}-{np.dtype(d).name}" for b, d, _ in BACKENDS])
@pytest.mark.parametrize("case", ["plain", "causal_window", "all"])
def test_varlen_is_a_loop_of_dense_calls(case, backend, dtype, tol):
    rng = np.random.default_rng(7)
    lens_q, lens_k = [3, 0, 6, 1, 5], [4, 2, 6, 3, 9]
    q, k, v, dout, cu_q, cu_k = packed(rng, dtype, lens_q, lens_k)
    slopes = np.exp2(-np.arange(1, 5)).astype(dtype)
    sinks = rng.standard_normal(4).astype(dtype)
    a = {"plain": {}, "causal_window": dict(is_causal=True, window_size=(2, -1)),
         "all": dict(is_causal=True, window_size=(3, 0), alibi_slopes=slopes, softcap=2.0, sinks=sinks,
                     position_offset=1)}[case]
    r = dict(causal=a.get("is_causal", False), window=a.get("window_size"), alibi=a.get("alibi_slopes"),
             softcap=a.get("softcap"), sinks=a.get("sinks"), offset=a.get("position_offset", 0))
    out, lse = attn.varlen_attention(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), backend=backend,
                                     return_lse=True, **a)
    grads = attn.varlen_attention_backward(dout, q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), backend=backend,
                                           output=out, lse=lse, **a)
    assert out.shape == (q.shape[0], 4, 6) and lse.shape == (4, q.shape[0])
    want_dq, want_dk, want_dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    want_dsinks = np.zeros(4)
    for b in range(len(lens_q)):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        w, wl, fwd = ref_forward(to_dense(q[sq]), to_dense(k[sk]), to_dense(v[sk]), **r)
        np.testing.assert_allclose(out[sq], w[0].swapaxes(0, 1), atol=tol, rtol=tol)
        np.testing.assert_allclose(lse[:, sq], wl[0], atol=tol, rtol=tol)
        g = ref_backward(to_dense(dout[sq]), fwd, w, softcap=r["softcap"], sinks=r["sinks"])
        want_dq[sq], want_dk[sk], want_dv[sk] = (x[0].swapaxes(0, 1) for x in g[:3])
        if r["sinks"] is not None:
            want_dsinks += g[3]
    for name, got, want in zip(("dq", "dk", "dv", "dsinks"), grads, (want_dq, want_dk, want_dv, want_dsinks)):
        np.testing.assert_allclose(got, want, atol=10 * tol, rtol=10 * tol, err_msg=name)
    assert len(grads) == (4 if r["sinks"] is not None else 3)


# ------------------------------------------------------------------ errors


def _small():
    return draw(np.random.default_rng(0), np.float32)


# Values are checked by the library (its message names the function and the
# option); what cannot be converted at all is refused by the Python layer.
@pytest.mark.parametrize("window,words", [
    ((-2, 0), r"attn::scaled_dot_product_attention\w*: option 'window\.left' is -2"),
    ((0, -5), r"attn::scaled_dot_product_attention\w*: option 'window\.right' is -5"),
    ((1,), "'window_size' is"), (3, "'window_size' is"), ((1.5, 0), "'window_size' is"),
    ((1, 2, 3), "'window_size' is"), ("ab", "'window_size' is")])
def test_bad_window_names_it(window, words):
    q, k, v, dout, slopes, sinks = _small()
    with pytest.raises(ValueError, match=words):
        attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, window_size=window)
    with pytest.raises(ValueError, match=words):
        attn.scaled_dot_product_attention_backward(dout, q, k, v, enable_gqa=True, window_size=window)


@pytest.mark.parametrize("name", ["alibi_slopes", "sinks"])
@pytest.mark.parametrize("value,words", [
    (np.zeros(3, np.float32), "argument '{}' has shape"), (np.zeros(5, np.float32), "argument '{}' has shape"),
    (np.zeros((4, 1), np.float32), "'{}' has dtype float32 and shape"), (np.zeros(4, bool), "'{}' has dtype bool")])
def test_wrong_per_head_arrays_name_the_argument(name, value, words):
    q, k, v, dout, slopes, sinks = _small()
    words = words.format(name)
    with pytest.raises(ValueError, match=words):
        attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, **{name: value})
    with pytest.raises(ValueError, match=words):
        attn.scaled_dot_product_attention_backward(dout, q, k, v, enable_gqa=True, **{name: value})
    qv, kv, vv, _, cu_q, cu_k = packed(np.random.default_rng(0), np.float32, [2, 3], [2, 3])
    with pytest.raises(ValueError, match=words):
        attn.varlen_attention(qv, kv, vv, cu_q, cu_k, 3, 3, **{name: value})


@pytest.mark.parametrize("softcap,words", [
    (-1.0, r"attn::scaled_dot_product_attention: option 'softcap' is -1, expected 0 \(off\) or a value within "
           r"\[2\^-64, 2\^64\]"),
    (float("inf"), "option 'softcap' is inf"), (float("nan"), "option 'softcap' is nan"),
    ("x", "'softcap' is 'x', expected a number")])
def test_bad_softcap_names_it(softcap, words):
    q, k, v, dout, slopes, sinks = _small()
    with pytest.raises(ValueError, match=words):
        attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, softcap=softcap)


def test_softcap_zero_means_off():
    """softcap=0.0 is off, as in FlashAttention and the library: the same as None, in every call."""
    q, k, v, dout, slopes, sinks = _small()
    for fn in (attn.scaled_dot_product_attention, attn.resolve_backend):
        assert _same(fn(q, k, v, enable_gqa=True, softcap=0.0), fn(q, k, v, enable_gqa=True))
    bwd = attn.scaled_dot_product_attention_backward
    for g, g0 in zip(bwd(dout, q, k, v, enable_gqa=True, softcap=0.0), bwd(dout, q, k, v, enable_gqa=True)):
        np.testing.assert_array_equal(g, g0)
    qv, kv, vv, _, cu_q, cu_k = packed(np.random.default_rng(0), np.float32, [2, 3], [2, 3])
    np.testing.assert_array_equal(attn.varlen_attention(qv, kv, vv, cu_q, cu_k, 3, 3, softcap=0.0),
                                  attn.varlen_attention(qv, kv, vv, cu_q, cu_k, 3, 3))
    cache = attn.KVCache(2, 2, 8, 8, value_dim=6)
    cache.append(k, v)
    np.testing.assert_array_equal(attn.decode_attention(q, cache, is_causal=True, softcap=0.0),
                                  attn.decode_attention(q, cache, is_causal=True, softcap=None))
    layer = attn.MultiheadAttention(8, 2, batch_first=True, seed=1)
    x = np.random.default_rng(1).standard_normal((1, 3, 8)).astype(np.float32)
    np.testing.assert_array_equal(layer(x, x, x, softcap=0.0)[0], layer(x, x, x)[0])


def _same(a, b):
    if isinstance(a, str):
        return a == b
    np.testing.assert_array_equal(a, b)
    return True


def test_bad_varlen_arguments():
    q, k, v, dout, cu_q, cu_k = packed(np.random.default_rng(0), np.float32, [2, 3], [2, 3])
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        attn.varlen_attention(q, k, v, cu_q.astype(np.float32), cu_k, 3, 3)
    with pytest.raises(ValueError, match="'q'"):
        attn.varlen_attention(q[None], k, v, cu_q, cu_k, 3, 3)
    with pytest.raises(ValueError, match="max_seqlen|cu_seqlens"):
        attn.varlen_attention(q, k, v, cu_q, cu_k, 1, 3)  # the longest query sequence is 3
    with pytest.raises(ValueError, match="position_offset"):
        attn.varlen_attention(q, k, v, cu_q, cu_k, 3, 3, position_offset=0.5)


@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_varlen_outputs_that_share_memory_are_refused(backend):
    """White-box (the public functions allocate their outputs): the extension's
    varlen calls refuse an output that shares memory with another or with an input."""
    from attn import _attn

    q, k, v, dout, cu_q, cu_k = packed(np.random.default_rng(0), np.float32, [2, 3], [2, 3], E=6, Ev=6)
    out, lse = np.empty_like(q), np.empty((q.shape[1], q.shape[0]), np.float32)
    fwd = dict(backend=backend)
    with pytest.raises(ValueError, match="varlen_attention: output 'out' overlaps input 'q'"):
        _attn.varlen_forward(q, k, v, cu_q, cu_k, 3, 3, q, lse=lse, **fwd)
    with pytest.raises(ValueError, match="varlen_attention: output 'out' overlaps output 'lse'"):
        _attn.varlen_forward(q, k, v, cu_q, cu_k, 3, 3, out, lse=out.reshape(-1)[:lse.size].reshape(lse.shape), **fwd)
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    with pytest.raises(ValueError, match="varlen_attention_backward: output 'dq' overlaps output 'dk'"):
        _attn.varlen_backward(q, k, v, cu_q, cu_k, 3, 3, dout, dq, dq.reshape(-1)[:dk.size].reshape(dk.shape), dv,
                              **fwd)
    with pytest.raises(ValueError, match="varlen_attention_backward: output 'dq' overlaps input 'dout'"):
        _attn.varlen_backward(q, k, v, cu_q, cu_k, 3, 3, dout, dout, dk, dv, **fwd)


# ------------------------------------------------------------------- torch


def _torch():
    return pytest.importorskip("torch")


def torch_reference(torch, q, k, v, *, causal=False, window=None, alibi=None, sinks=None, offset=0, bias=None):
    """torch's SDPA with the window and ALiBi as a float mask and the sinks as one extra key of zeros
    whose mask entry is the sink (so torch differentiates the sinks through its mask)."""
    B, H, L, E = q.shape
    S = k.shape[2]
    pos = torch.arange(L)[:, None] + offset
    j = torch.arange(S)[None, :]
    see = torch.from_numpy(npref.band_mask(L, S, causal, window, offset))
    m = torch.zeros(1, H, L, S, dtype=q.dtype).masked_fill(~see, float("-inf"))
    if alibi is not None:
        m = m - alibi[None, :, None, None] * (pos - j).abs().to(q.dtype)
    if bias is not None:
        m = m + bias
    if sinks is not None:
        k = torch.cat([k, torch.zeros(B, k.shape[1], 1, E, dtype=q.dtype)], 2)
        v = torch.cat([v, torch.zeros(B, v.shape[1], 1, v.shape[3], dtype=q.dtype)], 2)
        m = torch.cat([m.expand(B, H, L, S), sinks[None, :, None, None].expand(B, H, L, 1)], -1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, m, enable_gqa=True)


# torch gives NaN for rows that see no key, so the torch cases keep every row seeing one.
TORCH_CASES = dict(CASES, offset_window_alibi=dict(window=(1, 1), offset=2, alibi=True),
                   all_but_softcap=dict(window=(3, 0), causal=True, alibi=True, sinks=True, offset=1))


@pytest.mark.parametrize("case", ["window", "window_causal", "alibi", "sinks", "offset_window_alibi",
                                  "all_but_softcap"])
@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_torch_parity_dense(case, backend, parity):
    torch = _torch()
    rng = np.random.default_rng(11)
    q, k, v, dout, slopes, sinks = draw(rng, np.float32)
    c = TORCH_CASES[case]
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    ts = torch.tensor(sinks, requires_grad=True)
    ta = torch.tensor(slopes)
    kw = dict(is_causal=c.get("causal", False), window_size=c.get("window"), position_offset=c.get("offset"),
              alibi_slopes=ta if c.get("alibi") else None, sinks=ts if c.get("sinks") else None)
    import attn.torch as at

    out = at.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True, backend=backend, **kw)
    out.backward(torch.tensor(dout))
    got = [out.detach(), tq.grad, tk.grad, tv.grad] + ([ts.grad] if c.get("sinks") else [])
    assert (ts.grad is not None) == bool(c.get("sinks"))
    rq, rk, rv = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v))
    rs = torch.tensor(sinks, dtype=torch.float64, requires_grad=True)
    want_out = torch_reference(torch, rq, rk, rv, causal=kw["is_causal"], window=kw["window_size"],
                               alibi=ta.double() if c.get("alibi") else None, sinks=rs if c.get("sinks") else None,
                               offset=c.get("offset", 0))
    want_out.backward(torch.tensor(dout, dtype=torch.float64))
    want = [want_out.detach(), rq.grad, rk.grad, rv.grad] + ([rs.grad] if c.get("sinks") else [])
    for name, g, w in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
        a, r = parity.record(f"variants {case} {backend} {name}", g.numpy(), w.numpy())
        assert a < 1e-4, (name, a)


def test_torch_parity_float_mask_gradient_with_sinks(parity):
    torch = _torch()
    import attn.torch as at

    rng = np.random.default_rng(12)
    q, k, v, dout, slopes, sinks = draw(rng, np.float64, Hkv=4)
    bias = torch.tensor(rng.standard_normal((1, 4, 5, 7)), requires_grad=True)
    ts = torch.tensor(sinks, requires_grad=True)
    tq, tk, tv = (torch.tensor(x) for x in (q, k, v))
    out = at.scaled_dot_product_attention(tq, tk, tv, bias, window_size=(1, 2), sinks=ts)
    out.backward(torch.tensor(dout))
    rb = bias.detach().clone().requires_grad_(True)
    rs = ts.detach().clone().requires_grad_(True)
    want = torch_reference(torch, tq, tk, tv, window=(1, 2), sinks=rs, bias=rb)
    want.backward(torch.tensor(dout))
    for name, g, w in (("out", out.detach(), want.detach()), ("dbias", bias.grad, rb.grad), ("dsinks", ts.grad, rs.grad)):
        a, _ = parity.record(f"variants float-mask+sinks {name}", g.numpy(), w.numpy())
        assert a < 1e-10, name


def test_torch_parity_varlen_by_a_loop(parity):
    torch = _torch()
    import attn.torch as at

    rng = np.random.default_rng(13)
    lens_q, lens_k = [3, 6, 1], [4, 6, 5]
    q, k, v, dout, cu_q, cu_k = packed(rng, np.float32, lens_q, lens_k)
    sinks = rng.standard_normal(4).astype(np.float32)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    ts = torch.tensor(sinks, requires_grad=True)
    out = at.varlen_attention(tq, tk, tv, torch.tensor(cu_q), torch.tensor(cu_k), 6, 6, is_causal=True,
                              window_size=(2, 0), sinks=ts)
    out.backward(torch.tensor(dout))
    rq, rk, rv = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v))
    rs = torch.tensor(sinks, dtype=torch.float64, requires_grad=True)
    parts = []
    for b in range(3):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        y = torch_reference(torch, rq[sq].transpose(0, 1)[None], rk[sk].transpose(0, 1)[None],
                            rv[sk].transpose(0, 1)[None], causal=True, window=(2, 0), sinks=rs)
        parts.append(y[0].transpose(0, 1))
    want = torch.cat(parts)
    want.backward(torch.tensor(dout, dtype=torch.float64))
    for name, g, w in (("out", out.detach(), want.detach()), ("dq", tq.grad, rq.grad), ("dk", tk.grad, rk.grad),
                       ("dv", tv.grad, rv.grad), ("dsinks", ts.grad, rs.grad)):
        a, _ = parity.record(f"varlen causal+window+sinks {name}", g.numpy(), w.numpy())
        assert a < 1e-4, name


def test_torch_training_step_moves_the_sinks():
    """A tiny model: learnable sinks inside attention, one SGD step; the sinks move by -lr * grad,
    the grad being torch's own (sinks as an extra key) and the loss going down."""
    torch = _torch()
    import attn.torch as at

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 4, 9, 8), torch.randn(2, 4, 9, 8)
    target = torch.randn(2, 4, 6, 8)
    sinks = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([sinks], lr=0.5)

    def loss_of(fn, s):
        return ((fn(s) - target) ** 2).mean()

    ours = lambda s: at.scaled_dot_product_attention(q, k, v, window_size=(3, 3), sinks=s)  # noqa: E731
    theirs = lambda s: torch_reference(torch, q, k, v, window=(3, 3), sinks=s)  # noqa: E731
    ref = sinks.detach().clone().requires_grad_(True)
    loss_of(theirs, ref).backward()
    before = loss_of(ours, sinks)
    opt.zero_grad()
    before.backward()
    assert sinks.grad is not None and sinks.grad.abs().max() > 0
    torch.testing.assert_close(sinks.grad, ref.grad, atol=1e-6, rtol=1e-5)
    opt.step()
    torch.testing.assert_close(sinks.detach(), -0.5 * ref.grad, atol=1e-6, rtol=1e-5)
    with torch.no_grad():
        assert loss_of(ours, sinks) < before


@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_nan_in_a_query_reaches_its_row_only(backend):
    q, k, v, dout, slopes, sinks = draw(np.random.default_rng(9), np.float32)
    q[0, 1, 2, 3] = np.nan
    kw = dict(enable_gqa=True, window_size=(1, 1), alibi_slopes=slopes, softcap=4.0, sinks=sinks, backend=backend)
    out = attn.scaled_dot_product_attention(q, k, v, **kw)
    assert np.isnan(out[0, 1, 2]).all()
    keep = np.ones(out.shape[:3], bool)
    keep[0, 1, 2] = False
    assert np.isfinite(out[keep]).all()
    dq, dk, dv, dsinks = attn.scaled_dot_product_attention_backward(dout, q, k, v, **kw)
    assert np.isnan(dq[0, 1, 2]).all() and np.isfinite(dq[keep]).all()
    assert np.isnan(dsinks[1]) and np.isfinite(dsinks[[0, 2, 3]]).all()


def test_resolve_backend_takes_the_variants():
    q, k, v, dout, slopes, sinks = _small()
    got = attn.resolve_backend(q, k, v, enable_gqa=True, window_size=(2, 0), alibi_slopes=slopes, softcap=3.0,
                               sinks=sinks, position_offset=1)
    assert got in ("reference", "fused")
    assert attn.resolve_backend(q, k, v, enable_gqa=True, window_size=(2, 0), sinks=sinks,
                                backend="reference") == "reference"
    with pytest.raises(ValueError, match="sinks"):
        attn.resolve_backend(q, k, v, enable_gqa=True, sinks=sinks[:2])


def test_torch_refuses_slopes_that_require_grad():
    torch = _torch()
    import attn.torch as at

    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    slopes = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="alibi_slopes"):
        at.scaled_dot_product_attention(q, k, v, alibi_slopes=slopes)
    with pytest.raises(ValueError, match="alibi_slopes"):
        at.varlen_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                            torch.tensor([0, 3]), torch.tensor([0, 3]), 3, 3, alibi_slopes=slopes)
    with torch.no_grad():
        assert at.scaled_dot_product_attention(q, k, v, alibi_slopes=slopes).shape == (1, 2, 3, 4)
