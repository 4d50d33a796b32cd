"""attn.scaled_dot_product_attention and its backward against the NumPy
oracle in npref.py: random shapes (leading dimensions from none to three,
broadcast operands), bool / float / causal masks, grouped-query attention,
float32 and float64, every backend; plus finite differences, strided inputs,
the error messages, and the edge cases PyTorch users meet."""

import numpy as np
import pytest

import attn
import npref

DTYPES = [np.float32, np.float64]
BACKENDS = ["reference", "auto", "fused"]
KINDS = npref.KINDS


def fused_supported(dtype):
    q = np.zeros((1, 1, 4, 8), dtype)
    try:
        return attn.resolve_backend(q, q, q, backend="fused") == "fused"
    except ValueError:
        return False


def need_backend(backend, dtype):
    if backend == "fused" and not fused_supported(dtype):
        pytest.skip(f"the fused backend does not run {np.dtype(dtype).name} in this build")


def call(c, **kw):
    return attn.scaled_dot_product_attention(c["q"], c["k"], c["v"], attn_mask=c["mask"],
                                             is_causal=c["causal"], scale=c["scale"],
                                             enable_gqa=c["gqa"], **kw)


def ref(c):
    return npref.sdpa(c["q"], c["k"], c["v"], c["mask"], c["causal"], c["scale"], c["gqa"])


def forward_tol(c, dtype):
    """Error bound for float(dtype) results: rounding relative to the largest
    score |s| propagates through exp into the weights, then into sums over S."""
    z, _ = npref.scores(c["q"], c["k"], None, False, c["scale"], c["gqa"])
    s = np.abs(z).max()
    # factor 2: over 40 random cases per dtype the worst error (fused or
    # reference backend) was about 1/8 of this bound.
    return npref.tol(dtype, c["k"].shape[-2] + c["q"].shape[-1], np.abs(c["v"]).max() * (1 + s), factor=2)


def assert_close(got, want, atol, what):
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    finite = np.isfinite(want)
    assert np.array_equal(finite, np.isfinite(got)), f"{what}: non-finite entries differ"
    if not finite.any():
        return
    err = np.where(finite, np.abs(got - np.where(finite, want, 0)), 0)
    i = np.unravel_index(np.argmax(err), err.shape)
    assert err[i] <= atol, (f"{what}: max error {err[i]:.3g} > {atol:.3g} at {i}: "
                            f"got {got[i]!r}, expected {want[i]!r}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(12))
def test_forward_matches_numpy(dtype, backend, seed):
    need_backend(backend, dtype)
    rng = np.random.default_rng(1000 + seed)
    c = npref.random_case(rng, dtype, KINDS[seed % 4], seed % 8 >= 4)
    out, lse = call(c, backend=backend, return_lse=True)
    want_out, want_lse, want_p = ref(c)
    assert out.dtype == dtype and lse.dtype == dtype
    atol = forward_tol(c, dtype)
    assert_close(out, want_out, atol, f"out {c['q'].shape} {c['k'].shape}")
    assert_close(lse, want_lse, atol, "lse")
    if backend != "fused":
        out2, w = call(c, backend=backend, return_weights=True)
        assert_close(w, want_p, atol, "weights")
        if backend == "reference":
            np.testing.assert_array_equal(out2, out)
        else:
            # auto may route a call without weights to the decode kernel (few
            # query rows), which sums in another order than the fused kernel.
            assert_close(out2, out, atol, "out with weights")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(12))
def test_backward_matches_numpy(dtype, backend, seed):
    need_backend(backend, dtype)
    rng = np.random.default_rng(2000 + seed)
    c = npref.random_case(rng, dtype, KINDS[seed % 4], seed % 8 >= 4)
    out, lse = call(c, backend=backend, return_lse=True)
    dout = rng.standard_normal(out.shape).astype(dtype)
    grads = attn.scaled_dot_product_attention_backward(
        dout, c["q"], c["k"], c["v"], c["mask"], is_causal=c["causal"], scale=c["scale"],
        enable_gqa=c["gqa"], backend=backend, output=out, lse=lse)
    want = npref.sdpa_backward(dout, c["q"], c["k"], c["v"], c["mask"], c["causal"], c["scale"], c["gqa"])
    float_mask = c["mask"] is not None and c["mask"].dtype != np.bool_
    assert len(grads) == (4 if float_mask else 3)
    L, S = c["q"].shape[-2], c["k"].shape[-2]
    amax = max(np.abs(x).max() for x in (c["q"], c["k"], c["v"], dout))
    # Gradients sum over L or S terms, and over the batches/heads an operand
    # was broadcast to.
    reps = max(np.prod(out.shape[:-2], dtype=int), 1)
    atol = forward_tol(c, dtype) * amax * np.sqrt(reps * max(L, S))
    for name, g, w, x in zip(["dq", "dk", "dv", "dmask"], grads, want,
                             [c["q"], c["k"], c["v"], c["mask"]]):
        assert g.shape == x.shape and g.dtype == dtype, name
        assert_close(g, w, atol, name)


@pytest.mark.parametrize("causal,mask_kind", [(False, "none"), (True, "none"), (False, "bool"),
                                              (False, "float")])
def test_backward_matches_finite_differences(causal, mask_kind):
    """The reference backward against central differences in float64,
    including the gradient of a float mask broadcast over heads."""
    rng = np.random.default_rng(7)
    q, k = rng.standard_normal((2, 2, 4, 3)), rng.standard_normal((2, 2, 5, 3))
    v, w = rng.standard_normal((2, 2, 5, 2)), rng.standard_normal((2, 2, 4, 2))
    mask = None
    if mask_kind == "bool":
        mask = rng.random((4, 5)) < 0.7
        mask[:, 0] = True
    elif mask_kind == "float":
        mask = rng.standard_normal((2, 1, 4, 5))
    args = [q, k, v] + ([mask] if mask_kind == "float" else [])

    def loss(*xs):
        m = xs[3] if mask_kind == "float" else mask
        y = attn.scaled_dot_product_attention(xs[0], xs[1], xs[2], m, is_causal=causal,
                                              backend="reference")
        return float((y * w).sum())

    grads = attn.scaled_dot_product_attention_backward(w, q, k, v, mask, is_causal=causal,
                                                       backend="reference")
    h = 1e-6
    for i, (x, g) in enumerate(zip(args, grads)):
        num = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            saved = x[idx]
            x[idx] = saved + h
            up = loss(*args)
            x[idx] = saved - h
            down = loss(*args)
            x[idx] = saved
            num[idx] = (up - down) / (2 * h)
        np.testing.assert_allclose(g, num, rtol=1e-6, atol=1e-7, err_msg=f"argument {i}")


def test_weights_and_lse_properties():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 3, n, 8)) for n in (6, 9, 9))
    out, lse, w = attn.scaled_dot_product_attention(q, k, v, return_lse=True, return_weights=True)
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=0, atol=1e-14)
    np.testing.assert_allclose(out, w @ v, rtol=0, atol=1e-13)
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(8)
    np.testing.assert_allclose(lse, np.log(np.exp(s).sum(-1)), rtol=0, atol=1e-13)


def test_fully_masked_rows_give_zero_not_nan():
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((1, 2, 3, 4)) for _ in range(3))
    mask = np.ones((3, 3), bool)
    mask[1] = False  # query 1 sees nothing
    out, lse, w = attn.scaled_dot_product_attention(q, k, v, mask, return_lse=True, return_weights=True)
    assert np.all(out[:, :, 1] == 0) and np.all(w[:, :, 1] == 0) and np.all(lse[:, :, 1] == -np.inf)
    assert np.isfinite(out).all()
    grads = attn.scaled_dot_product_attention_backward(np.ones_like(out), q, k, v, mask)
    assert all(np.isfinite(g).all() for g in grads)
    assert np.all(grads[0][:, :, 1] == 0)


def test_float_mask_adds_and_bool_mask_selects():
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((2, 5, 4)) for _ in range(3))
    m = rng.random((5, 5)) < 0.6
    np.fill_diagonal(m, True)
    bias = np.where(m, 0.0, -np.inf)
    a = attn.scaled_dot_product_attention(q, k, v, m)
    b = attn.scaled_dot_product_attention(q, k, v, bias)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-15)
    causal = attn.scaled_dot_product_attention(q, k, v, is_causal=True)
    tril = attn.scaled_dot_product_attention(q, k, v, np.tril(np.ones((5, 5), bool)))
    np.testing.assert_array_equal(causal, tril)


def test_shapes_follow_pytorch():
    rng = np.random.default_rng(6)
    # No leading dimensions at all: (L, E).
    out = attn.scaled_dot_product_attention(*(rng.standard_normal((4, 3)) for _ in range(3)))
    assert out.shape == (4, 3)
    # Key/value broadcast over a batch of queries; L != S; E != Ev.
    q = rng.standard_normal((3, 2, 5, 4))
    k = rng.standard_normal((1, 2, 6, 4))
    v = rng.standard_normal((2, 6, 7))
    out = attn.scaled_dot_product_attention(q, k, v)
    assert out.shape == (3, 2, 5, 7)
    want, _, _ = npref.sdpa(q, k, v)
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-14)
    # enable_gqa groups query heads onto fewer key/value heads.
    q = rng.standard_normal((2, 6, 5, 4))
    k, v = rng.standard_normal((2, 2, 6, 4)), rng.standard_normal((2, 2, 6, 4))
    out = attn.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    want, _, _ = npref.sdpa(q, k, v, gqa=True)
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-14)
    dq, dk, dv = attn.scaled_dot_product_attention_backward(np.ones_like(out), q, k, v, enable_gqa=True)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def strided_variants(x):
    """The same values with other memory layouts."""
    yield "transposed", np.ascontiguousarray(np.swapaxes(x, 1, 2)).swapaxes(1, 2)
    big = np.zeros(x.shape[:-1] + (x.shape[-1] * 2 + 1,), x.dtype)
    big[..., 1::2] = x
    yield "every-other", big[..., 1::2]
    yield "reversed", np.ascontiguousarray(x[..., ::-1])[..., ::-1]
    yield "fortran", np.asfortranarray(x)
    yield "non-native-endian", x.astype(x.dtype.newbyteorder())


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_inputs_give_the_same_result(dtype):
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((2, 3, n, 5)).astype(dtype) for n in (4, 6, 6))
    mask = rng.standard_normal((2, 3, 4, 6)).astype(dtype)
    dout = rng.standard_normal((2, 3, 4, 5)).astype(dtype)
    want = attn.scaled_dot_product_attention(q, k, v, mask)
    want_g = attn.scaled_dot_product_attention_backward(dout, q, k, v, mask)
    for name, qs in strided_variants(q):
        for _, ks in strided_variants(k):
            got = attn.scaled_dot_product_attention(qs, ks, v, mask)
            np.testing.assert_array_equal(got, want, err_msg=name)
        for _, ms in strided_variants(mask):
            got = attn.scaled_dot_product_attention(qs, k, v, ms)
            np.testing.assert_array_equal(got, want, err_msg=name)
        g = attn.scaled_dot_product_attention_backward(dout, qs, k, v, mask)
        for a, b in zip(g, want_g):
            np.testing.assert_array_equal(a, b, err_msg=name)
    # Broadcast (stride-0) key/value along the batch axis.
    kb = np.broadcast_to(k[:1], k.shape)
    got = attn.scaled_dot_product_attention(q, kb, v, mask)
    np.testing.assert_array_equal(got, attn.scaled_dot_product_attention(q, k[:1], v, mask))


def test_leading_dims_that_need_merging():
    """Three leading axes with a mixed broadcast pattern (no single stride
    describes the merged batch) still give the oracle's answer."""
    rng = np.random.default_rng(9)
    q = rng.standard_normal((2, 3, 2, 4, 5))
    k = rng.standard_normal((2, 1, 2, 6, 5))
    v = rng.standard_normal((1, 3, 2, 6, 3))
    mask = rng.standard_normal((2, 1, 1, 4, 6))
    out = attn.scaled_dot_product_attention(q, k, v, mask)
    want, _, _ = npref.sdpa(q, k, v, mask)
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-14)
    dout = rng.standard_normal(out.shape)
    got = attn.scaled_dot_product_attention_backward(dout, q, k, v, mask)
    want_g = npref.sdpa_backward(dout, q, k, v, mask)
    for g, w in zip(got, want_g):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-13)


def test_inputs_are_not_modified():
    rng = np.random.default_rng(10)
    q, k, v = (rng.standard_normal((2, 4, 3)) for _ in range(3))
    copies = [x.copy() for x in (q, k, v)]
    attn.scaled_dot_product_attention(q, k, v)
    attn.scaled_dot_product_attention_backward(np.ones((2, 4, 3)), q, k, v)
    for a, b in zip((q, k, v), copies):
        np.testing.assert_array_equal(a, b)


def errors(fn, *args, **kw):
    with pytest.raises(ValueError) as e:
        fn(*args, **kw)
    return str(e.value)


def test_errors_name_the_argument():
    sdpa = attn.scaled_dot_product_attention
    q, k, v = np.zeros((1, 2, 3, 4)), np.zeros((1, 2, 5, 4)), np.zeros((1, 2, 5, 6))
    # Shapes and values are checked once, by the library, on the (B, H, N, d) views
    # it receives (q, k, v, mask, dout), and its messages arrive unchanged.
    assert errors(sdpa, q, np.zeros((1, 2, 5, 3)), v) == (
        "attn::scaled_dot_product_attention: argument 'k' has shape (1, 2, 5, 3), expected (1, Hkv, S, 4) "
        "with Hkv dividing H = 2 (q has shape (1, 2, 3, 4))")
    assert "argument 'v' has shape (1, 2, 4, 6), expected (1, 2, 5, Ev)" in errors(sdpa, q, k, np.zeros((1, 2, 4, 6)))
    assert "dtype int64" in errors(sdpa, q.astype(np.int64), k, v)
    assert "expected float64" in errors(sdpa, q, k.astype(np.float32), v)
    assert "do not broadcast" in errors(sdpa, q, np.zeros((1, 3, 5, 4)), np.zeros((1, 3, 5, 6)))
    assert ("argument 'mask' has shape (1, 1, 3, 4), expected each axis of (B, H, L, S) = (1, 2, 3, 5) or 1"
            in errors(sdpa, q, k, v, np.ones((3, 4), bool)))
    assert "'attn_mask' has dtype int32" in errors(sdpa, q, k, v, np.ones((3, 5), np.int32))
    assert "is_causal" in errors(sdpa, q, k, v, np.ones((3, 5), bool), is_causal=True)
    assert "dropout_p" in errors(sdpa, q, k, v, None, 0.1)
    assert "with Hkv dividing H = 2" in errors(sdpa, q, np.zeros((1, 3, 5, 4)), np.zeros((1, 3, 5, 6)),
                                               enable_gqa=True)
    assert "at least 2 dimensions" in errors(sdpa, np.zeros(4), k, v)
    msg = errors(sdpa, q, k, v, scale=0.0)
    assert msg == ("attn::scaled_dot_product_attention: option 'scale' is 0, expected a finite value > 0 within "
                   "[2^-64, 2^64] (about 5.4e-20 to 1.8e+19)")
    assert "unknown backend 'fast'" in errors(sdpa, q, k, v, backend="fast")
    assert "contains NaN or +Inf" in errors(sdpa, q, k, v, np.full((3, 5), np.inf))
    if not fused_supported(np.float64):
        assert "backend' is fused" in errors(sdpa, q, k, v, backend="fused")
    assert "every dimension" in errors(sdpa, np.zeros((1, 2, 0, 4)), k, v)
    bwd = attn.scaled_dot_product_attention_backward
    assert errors(bwd, np.zeros((1, 2, 3, 5)), q, k, v) == (
        "attn::scaled_dot_product_attention_backward: argument 'dout' has shape (1, 2, 3, 5), expected (1, 2, 3, 6)")
    assert "argument 'lse' has shape (1, 2, 4), expected (1, 2, 3)" in errors(bwd, np.zeros((1, 2, 3, 6)), q, k, v,
                                                                             lse=np.zeros((1, 2, 4)))
    # The leading (batch) axes are merged in Python, which checks them against the forward's.
    assert "'lse' has shape (1, 2), expected (1, 2, 3)" in errors(bwd, np.zeros((1, 2, 3, 6)), q, k, v,
                                                                  lse=np.zeros((1, 2)))


def test_common_layouts_are_not_copied():
    """White-box: the rank-4 views handed to the extension share memory with
    the caller's arrays for contiguous, transposed, sliced and broadcast inputs."""
    from attn._sdpa import _plan

    rng = np.random.default_rng(12)
    base = rng.standard_normal((2, 6, 3, 8))  # (B, L, H, E) memory
    q = base.transpose(0, 2, 1, 3)  # (B, H, L, E) view
    k = rng.standard_normal((2, 3, 9, 16))[..., ::2]  # every other feature
    v = np.broadcast_to(rng.standard_normal((1, 3, 9, 4)), (2, 3, 9, 4))
    mask = rng.standard_normal((3, 6, 9))
    p = _plan("test", q, k, v, mask, 0.0, False, None, False, "auto")
    for view, orig in ((p.q, base), (p.k, k), (p.v, v), (p.bias, mask)):
        assert np.shares_memory(view, orig)
    # Five leading axes that merge into one batch axis, still without a copy.
    q5 = rng.standard_normal((2, 2, 2, 3, 4, 5))
    p = _plan("test", q5, q5, q5, None, 0.0, False, None, False, "auto")
    assert p.q.shape == (8, 3, 4, 5) and np.shares_memory(p.q, q5)


def test_attn_torch_import_explains_a_missing_torch():
    try:
        import torch  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="attn.torch needs PyTorch"):
            import attn.torch  # noqa: F401
    else:
        pytest.skip("PyTorch is installed, so attn.torch imports")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["none", "causal", "bool", "float"])
def test_long_awkward_sequences_match_numpy(backend, kind):
    """Lengths past any tile size and not a multiple of one (267 queries,
    301 keys, E = 64, Ev = 40), float32, forward and backward."""
    dtype = np.float32
    need_backend(backend, dtype)
    rng = np.random.default_rng(npref.seed_of("long", kind))
    q = rng.standard_normal((1, 2, 267, 64)).astype(dtype)
    k = rng.standard_normal((1, 2, 301, 64)).astype(dtype)
    v = rng.standard_normal((1, 2, 301, 40)).astype(dtype)
    mask = None
    if kind == "bool":
        mask = rng.random((267, 301)) < 0.8
    elif kind == "float":
        mask = rng.standard_normal((2, 1, 301)).astype(dtype)
    c = dict(q=q, k=k, v=v, mask=mask, causal=kind == "causal", scale=None, gqa=False)
    out, lse = call(c, backend=backend, return_lse=True)
    want, want_lse, _ = ref(c)
    atol = forward_tol(c, dtype)
    assert_close(out, want, atol, "out")
    assert_close(lse, want_lse, atol, "lse")
    dout = rng.standard_normal(out.shape).astype(dtype)
    grads = attn.scaled_dot_product_attention_backward(dout, q, k, v, mask, is_causal=c["causal"],
                                                       backend=backend, output=out, lse=lse)
    want_g = npref.sdpa_backward(dout, q, k, v, mask, c["causal"])
    amax = max(np.abs(x).max() for x in (q, k, v, dout))
    for name, g, w in zip(["dq", "dk", "dv", "dmask"], grads, want_g):
        assert_close(g, w, atol * amax * np.sqrt(2 * 301), name)


@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_nan_propagates_and_check_finite_refuses_it(backend):
    rng = np.random.default_rng(11)
    q = rng.standard_normal((1, 2, 3, 4)).astype(np.float32)
    k = rng.standard_normal((1, 2, 5, 4)).astype(np.float32)
    v = rng.standard_normal((1, 2, 5, 4)).astype(np.float32)
    k[0, 1, 2, 0] = np.nan  # key 2 of head 1: every row of head 1 sees it
    out = attn.scaled_dot_product_attention(q, k, v, backend=backend)
    assert np.isnan(out[0, 1]).all()
    assert np.isfinite(out[0, 0]).all()
    with pytest.raises(ValueError, match="'k' contains NaN"):
        attn.scaled_dot_product_attention(q, k, v, backend=backend, check_finite=True)
    dout = np.ones_like(out)
    dout[0, 0, 1, 0] = np.inf
    with pytest.raises(ValueError, match="'dout' contains NaN or Inf"):
        attn.scaled_dot_product_attention_backward(dout, q, np.nan_to_num(k), v, backend=backend,
                                                   check_finite=True)
