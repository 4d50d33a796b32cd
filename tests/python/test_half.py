"""Half-precision query/key/value in the dense call: NumPy float16,
ml_dtypes.bfloat16 (when installed), torch.float16/bfloat16 (when torch is
installed), through attn.scaled_dot_product_attention, its backward and the
attn.torch autograd Function. The contract checked: with exact arithmetic
(float16 by default, bfloat16 with compute_dtype="float32") the result is the
float32 call's on the rounded values, bit for bit (forward and backward, on the
widened route and on the decode route that reads half K/V in place), and that
is exact attention of the rounded values (the float64 NumPy oracle, to
float32's bound); bfloat16 by default is the float32 call's with
compute_dtype="bfloat16" on the rounded values, bit for bit, within bfloat16's
bound of the exact attention; results are float32 (attn.torch: the inputs'
dtype)."""

import numpy as np
import pytest

import attn
import npref

F32 = np.float32

# (L, S, E, Ev, H, Hkv, is_causal, mask): the widened route and the decode route (L <= 32).
SHAPES = [
    (37, 53, 24, 20, 4, 2, False, "none"),
    (45, 30, 16, 16, 3, 1, True, "none"),
    (40, 70, 9, 5, 2, 2, False, "bool"),
    (36, 29, 8, 12, 4, 4, False, "float"),
    (1, 600, 40, 24, 8, 2, False, "none"),
    (3, 300, 16, 16, 4, 1, False, "bool"),
]


def make(rng, L, S, E, Ev, H, Hkv, mask_kind, B=2):
    q = rng.standard_normal((B, H, L, E))
    k = rng.standard_normal((B, Hkv, S, E))
    v = rng.standard_normal((B, Hkv, S, Ev))
    mask = None
    if mask_kind == "bool":
        mask = rng.random((B, H, L, S)) < 0.7
        mask[0, 0, 0, :] = False  # a row that sees no key
    elif mask_kind == "float":
        mask = rng.standard_normal((1, H, L, S)).astype(F32)
        mask[0, 0, 0, :] = -np.inf
    return q, k, v, mask


def check_against_float32(args16, args32, mask, causal, gqa, dout, want_compute_dtype=None, **kw):
    """The half call (args16) against the float32 call on the rounded values (args32), that
    one with compute_dtype=want_compute_dtype when given."""
    kw32 = dict(kw, compute_dtype=want_compute_dtype) if want_compute_dtype else kw
    out, lse = attn.scaled_dot_product_attention(*args16, mask, is_causal=causal, enable_gqa=gqa,
                                                 return_lse=True, **kw)
    want, want_lse = attn.scaled_dot_product_attention(*args32, mask, is_causal=causal, enable_gqa=gqa,
                                                       return_lse=True, **kw32)
    assert np.asarray(out).dtype == F32 and np.asarray(lse).dtype == F32
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))
    grads = attn.scaled_dot_product_attention_backward(dout, *args16, mask, is_causal=causal, enable_gqa=gqa, **kw)
    want_g = attn.scaled_dot_product_attention_backward(dout, *args32, mask, is_causal=causal, enable_gqa=gqa, **kw32)
    assert len(grads) == len(want_g)
    for g, w in zip(grads, want_g):
        assert np.asarray(g).dtype == F32
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    return out, grads


@pytest.mark.parametrize("shape", SHAPES)
def test_numpy_float16_is_the_float32_call_on_the_rounded_values(shape):
    L, S, E, Ev, H, Hkv, causal, mask_kind = shape
    rng = np.random.default_rng(npref.seed_of("f16", *shape[:6]))
    q, k, v, mask = make(rng, L, S, E, Ev, H, Hkv, mask_kind)
    h = [x.astype(np.float16) for x in (q, k, v)]
    r = [x.astype(F32) for x in h]  # the rounded values, exactly
    dout = rng.standard_normal((2, H, L, Ev)).astype(F32)
    gqa = H != Hkv
    out, grads = check_against_float32(h, r, mask, causal, gqa, dout)
    # ... which is exact attention of the rounded values, to float32's bound.
    ref_out, _, _ = npref.sdpa(*r, mask=mask, causal=causal, gqa=gqa)
    n = S + E
    np.testing.assert_allclose(out, ref_out, rtol=0, atol=npref.tol(F32, n, 1.0, 40))
    ref_g = npref.sdpa_backward(dout, *r, mask=mask, causal=causal, gqa=gqa)
    for g, w in zip(grads, ref_g):
        np.testing.assert_allclose(g, w, rtol=0, atol=npref.tol(F32, n, np.abs(w).max(), 80))


def test_float16_layouts_and_variants():
    rng = np.random.default_rng(5)
    # (B, N, H, d) memory viewed as (B, H, N, d): transposed, non-contiguous views.
    q = rng.standard_normal((2, 33, 4, 16)).astype(np.float16).transpose(0, 2, 1, 3)
    k = rng.standard_normal((2, 41, 2, 16)).astype(np.float16).transpose(0, 2, 1, 3)
    v = rng.standard_normal((2, 41, 2, 8)).astype(np.float16).transpose(0, 2, 1, 3)
    r = [x.astype(F32) for x in (q, k, v)]
    dout = rng.standard_normal((2, 4, 33, 8)).astype(F32)
    sinks = rng.standard_normal(4).astype(F32)
    for kw in (dict(window_size=(9, 3)), dict(softcap=4.0, alibi_slopes=np.abs(rng.standard_normal(4)).astype(F32)),
               dict(sinks=sinks, position_offset=5, window_size=(6, 0))):
        check_against_float32((q, k, v), r, None, False, True, dout, **kw)


def test_nan_in_a_float16_query_reaches_its_row_only():
    rng = np.random.default_rng(6)
    for L in (2, 40):  # decode route, widened route
        q = rng.standard_normal((1, 2, L, 8)).astype(np.float16)
        k = rng.standard_normal((1, 2, 50, 8)).astype(np.float16)
        v = rng.standard_normal((1, 2, 50, 8)).astype(np.float16)
        q[0, 0, 1, 3] = np.nan
        out, lse = attn.scaled_dot_product_attention(q, k, v, return_lse=True)
        bad = np.zeros((1, 2, L), bool)
        bad[0, 0, 1] = True
        assert np.array_equal(np.isnan(lse), bad)
        assert np.array_equal(np.isnan(out).all(axis=-1), bad) and not np.isnan(out[~bad]).any()
        with pytest.raises(ValueError, match=r"argument 'q' contains NaN"):
            attn.scaled_dot_product_attention(q, k, v, check_finite=True)


def test_mixed_dtypes_are_a_value_error_naming_the_argument():
    q = np.zeros((1, 1, 4, 8), np.float16)
    with pytest.raises(ValueError, match=r"'key' has dtype float32, expected float16 \(the dtype of 'query'\)"):
        attn.scaled_dot_product_attention(q, q.astype(F32), q)
    with pytest.raises(ValueError, match=r"'value' has dtype uint16, expected float32, float64, float16 or bfloat16"):
        attn.scaled_dot_product_attention(q, q, q.view(np.uint16))
    assert attn.resolve_backend(q, q, q) == "fused"


def test_ml_dtypes_bfloat16():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(7)
    for L, S in ((37, 45), (1, 400)):
        q, k, v, mask = make(rng, L, S, 16, 8, 4, 2, "bool")
        h = [x.astype(ml_dtypes.bfloat16) for x in (q, k, v)]
        r = [x.astype(F32) for x in h]
        dout = rng.standard_normal((2, 4, L, 8)).astype(F32)
        check_against_float32(h, r, mask, False, True, dout, compute_dtype="float32")
        # By default bfloat16 products: the float32 call's with compute_dtype="bfloat16", and
        # within bfloat16's bound (P rounded: 2^-8 relative, docs/fused.md) of the exact one.
        got, _ = check_against_float32(h, r, mask, False, True, dout, want_compute_dtype="bfloat16")
        exact = attn.scaled_dot_product_attention(*r, mask, enable_gqa=True)
        if L > 32:  # (the decode route, few query rows, rounds only where that pays: docs/decode.md)
            assert not np.array_equal(np.asarray(got), np.asarray(exact))
        assert np.abs(np.asarray(got) - np.asarray(exact)).max() <= 2.0**-8 * np.abs(r[2]).max() + 1e-5
        # bfloat16 rounds differently from float16: the inputs really were read as bfloat16.
        assert not np.array_equal(r[0], q.astype(np.float16).astype(F32))


torch_params = pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])


@torch_params
@pytest.mark.parametrize("L", [1, 29])
def test_torch_half_tensors(dtype_name, L):
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    import attn.torch

    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(L)
    q = torch.randn(2, 4, L, 16, generator=g).to(dtype)
    k = torch.randn(2, 2, 70, 16, generator=g).to(dtype)
    v = torch.randn(2, 2, 70, 8, generator=g).to(dtype)
    r = [x.float() for x in (q, k, v)]
    dout = torch.randn(2, 4, L, 8, generator=g)
    # The NumPy-level API: float32 results, the float32 call's on the rounded values
    # (bfloat16: exact with compute_dtype="float32"; by default the bfloat16 products of
    # the float32 call with compute_dtype="bfloat16").
    bf16 = dtype_name == "bfloat16"
    check_against_float32((q, k, v), r, None, True, True, dout, **(dict(compute_dtype="float32") if bf16 else {}))
    products = dict(compute_dtype="bfloat16") if bf16 else {}
    check_against_float32((q, k, v), r, None, True, True, dout, want_compute_dtype=products.get("compute_dtype"))
    # attn.torch: the inputs' dtype, like PyTorch, and autograd gradients in it too.
    y = attn.torch.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    want, want_lse = attn.scaled_dot_product_attention(*r, is_causal=True, enable_gqa=True, return_lse=True,
                                                       **products)
    assert y.dtype == dtype and torch.equal(y, want.to(dtype))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    y = attn.torch.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
    assert y.dtype == dtype
    y.backward(dout.to(dtype))
    # (The Function hands its forward's output and lse to the backward; so does this.)
    want_g = attn.scaled_dot_product_attention_backward(dout.to(dtype).float(), *r, is_causal=True, enable_gqa=True,
                                                        output=want, lse=want_lse, **products)
    for leaf, w in zip(leaves, want_g):
        assert leaf.grad.dtype == dtype
        assert torch.equal(leaf.grad, w.to(dtype))
    # Against PyTorch's own SDPA on the rounded values in float64.
    ref = torch.nn.functional.scaled_dot_product_attention(*[x.double() for x in r], is_causal=True, enable_gqa=True)
    rounding = 2.0**-8 * r[2].abs().max().item() if bf16 else 0.0  # P rounded to bfloat16 (docs/fused.md)
    assert (want.double() - ref).abs().max().item() < npref.tol(F32, 70 + 16, 1.0, 40) + rounding


def test_torch_half_float_mask_and_sinks_get_gradients_in_their_dtype():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    import attn.torch

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 9, 8, generator=g).half().requires_grad_() for _ in range(3))
    mask = torch.randn(1, 2, 9, 9, generator=g).half().requires_grad_()
    sinks = torch.randn(2, generator=g).requires_grad_()
    y = attn.torch.scaled_dot_product_attention(q, k, v, mask, sinks=sinks)
    y.float().sum().backward()
    assert mask.grad.dtype == torch.float16 and sinks.grad.dtype == torch.float32
    r = [x.detach().float() for x in (q, k, v)]
    want = attn.scaled_dot_product_attention_backward(torch.ones(1, 2, 9, 8), *r, mask.detach().float(),
                                                      sinks=sinks.detach())
    assert torch.equal(mask.grad, want[3].half()) and torch.equal(sinks.grad, want[4])


def test_compute_dtype_names_and_refusals():
    """compute_dtype takes names, NumPy and torch dtypes; anything else is a ValueError naming it."""
    rng = np.random.default_rng(11)
    q, k, v, _ = make(rng, 40, 50, 16, 8, 2, 2, "none")
    r = [x.astype(F32) for x in (q, k, v)]
    want = attn.scaled_dot_product_attention(*r, compute_dtype="bfloat16")
    names = ["bf16"]
    try:
        import ml_dtypes

        names.append(ml_dtypes.bfloat16)
    except ImportError:
        pass
    for name in names:
        assert np.array_equal(attn.scaled_dot_product_attention(*r, compute_dtype=name), want)
    exact = attn.scaled_dot_product_attention(*r)
    assert np.array_equal(attn.scaled_dot_product_attention(*r, compute_dtype=np.float32), exact)
    assert not np.array_equal(want, exact)
    with pytest.raises(ValueError, match=r"'compute_dtype' is 'int8'"):
        attn.scaled_dot_product_attention(*r, compute_dtype="int8")
    with pytest.raises(ValueError, match=r"option 'compute_dtype' is float16"):
        attn.scaled_dot_product_attention(*r, compute_dtype="float16")
    with pytest.raises(ValueError, match=r"option 'compute_dtype' is bfloat16, which takes float32"):
        attn.scaled_dot_product_attention(q, k, v, compute_dtype="bfloat16")  # float64
    with pytest.raises(ValueError, match=r"option 'compute_dtype' is bfloat16, which the reference backend"):
        attn.scaled_dot_product_attention(*r, compute_dtype="bfloat16", backend="reference")


# (B, H, Hkv, L, S, E, is_causal): full and causal, grouped heads, one-row
# decoding, E from 32 to 128.
ACCURACY_SHAPES = [
    (1, 4, 4, 64, 64, 64, False),
    (2, 4, 2, 128, 256, 64, True),
    (1, 8, 8, 257, 257, 128, True),
    (1, 2, 1, 33, 500, 32, False),
    (2, 3, 3, 100, 100, 80, False),
    (1, 4, 4, 512, 512, 64, False),
    (1, 4, 2, 1, 300, 64, False),
    (1, 2, 2, 700, 700, 128, True),
]


def test_bfloat16_at_least_as_accurate_as_torch():
    """torch bfloat16 tensors through attn.torch (bfloat16 compute, the
    default) against PyTorch's own bfloat16 SDPA on the same inputs: the
    relative error (Frobenius) of the output and of dq, dk, dv against the
    float64 attention of the same bfloat16 values, median over the shapes,
    is no larger than PyTorch's."""
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    import statistics

    import attn.torch as at

    def exact(q, k, v, causal, dout):
        q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
        g = q.shape[1] // k.shape[1]
        s = q @ k.repeat_interleave(g, 1).transpose(-1, -2) / q.shape[-1] ** 0.5
        if causal:  # top-left aligned, as is_causal in both
            s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
        y = torch.softmax(s, -1) @ v.repeat_interleave(g, 1)
        y.backward(dout.double())
        return [y.detach(), q.grad, k.grad, v.grad]

    def run(fn, q, k, v, causal, dout):
        q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
        y = fn(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
        y.backward(dout)
        assert y.dtype == torch.bfloat16 and q.grad.dtype == torch.bfloat16
        return [y.detach(), q.grad, k.grad, v.grad]

    g = torch.Generator().manual_seed(5)
    errors = {"attn": [], "torch": []}
    for B, H, Hkv, L, S, E, causal in ACCURACY_SHAPES:
        q, dout = (torch.randn(B, H, L, E, generator=g).bfloat16() for _ in range(2))
        k, v = (torch.randn(B, Hkv, S, E, generator=g).bfloat16() for _ in range(2))
        want = exact(q, k, v, causal, dout)
        for name, fn in (("attn", at.scaled_dot_product_attention),
                         ("torch", torch.nn.functional.scaled_dot_product_attention)):
            got = run(fn, q, k, v, causal, dout)
            errors[name].append([((a.double() - b).norm() / b.norm()).item() for a, b in zip(got, want)])
    for i, what in enumerate(("output", "dq", "dk", "dv")):
        ours = statistics.median(e[i] for e in errors["attn"])
        theirs = statistics.median(e[i] for e in errors["torch"])
        assert ours < 4e-3, (what, ours)  # a few units of bfloat16's rounding (2^-9)
        assert ours <= theirs, f"{what}: median relative error {ours:.3e}, PyTorch's {theirs:.3e}"
