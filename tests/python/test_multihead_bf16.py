"""attn.MultiheadAttention with bfloat16 parameters (dtype=bfloat16): the
float32 layer with bfloat16 products on the same bfloat16 values, rounded at
the exit; parameters rounded to nearest even; at least as accurate as torch's
layer in bfloat16 against float64."""

import numpy as np
import pytest

import attn

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)


def bf16(a):
    return np.asarray(a, np.float32).astype(BF16)


def layers(rng, D, H, kdim=None, vdim=None, batch_first=True):
    """A bfloat16 layer with random parameters and a float32 one holding the same (bfloat16) values."""
    half = attn.MultiheadAttention(D, H, kdim=kdim, vdim=vdim, batch_first=batch_first, dtype="bfloat16", seed=3)
    full = attn.MultiheadAttention(D, H, kdim=kdim, vdim=vdim, batch_first=batch_first, seed=3,
                                   compute_dtype="bfloat16")
    sd = {n: rng.standard_normal(a.shape).astype(np.float32) * 0.3 for n, a in half.state_dict().items()}
    half.load_state_dict(sd)
    full.load_state_dict({n: a.astype(np.float32) for n, a in half.state_dict().items()})
    return half, full


@pytest.mark.parametrize("self_attention", [True, False])
@pytest.mark.parametrize("batch_first", [True, False])
def test_bfloat16_layer_is_the_float32_layer_rounded(self_attention, batch_first):
    """Forward (output, weights) and backward (input and parameter gradients)
    are the float32 layer's with bfloat16 products on the widened inputs, each
    rounded to bfloat16 once: bit for bit."""
    rng = np.random.default_rng(0 + 2 * self_attention + batch_first)
    D, H, N, L, S = 32, 4, 2, 40, 24
    kv = {} if self_attention else dict(kdim=12, vdim=20)
    half, full = layers(rng, D, H, batch_first=batch_first, **kv)
    shape = (lambda n, w: (N, n, w)) if batch_first else (lambda n, w: (n, N, w))
    xq = bf16(rng.standard_normal(shape(L, D)))
    xk = xq if self_attention else bf16(rng.standard_normal(shape(S, 12)))
    xv = xq if self_attention else bf16(rng.standard_normal(shape(S, 20)))
    Sk = L if self_attention else S
    mask = bf16(rng.standard_normal((L, Sk)))  # a float mask in the layer's dtype
    dy = bf16(rng.standard_normal(shape(L, D)))

    y, w = half(xq, xk, xv, attn_mask=mask)
    w32 = lambda a: a.astype(np.float32)
    q32 = w32(xq)  # self-attention: one object as query, key and value, as in the call above
    y_ref, w_ref = full(q32, q32 if self_attention else w32(xk), q32 if self_attention else w32(xv),
                        attn_mask=w32(mask))
    assert y.dtype == BF16 and w.dtype == BF16
    np.testing.assert_array_equal(w32(y), w32(bf16(y_ref)))
    np.testing.assert_array_equal(w32(w), w32(bf16(w_ref)))

    g = half.backward(dy)
    g_ref = full.backward(w32(dy))
    for name in ("query", "key", "value"):
        if g_ref[name] is None:
            assert g[name] is None
            continue
        assert g[name].dtype == BF16
        np.testing.assert_array_equal(w32(g[name]), w32(bf16(g_ref[name])))
    for name, a in half.grads().items():
        assert a.dtype == BF16
        np.testing.assert_array_equal(w32(a), w32(bf16(full.grads()[name])))


def test_parameters_hold_bfloat16_values():
    rng = np.random.default_rng(5)
    layer = attn.MultiheadAttention(16, 2, dtype=BF16, seed=1)
    for a in layer.state_dict().values():  # the initial values, rounded
        assert a.dtype == BF16
    init = attn.MultiheadAttention(16, 2, seed=1).state_dict()
    for n, a in layer.state_dict().items():
        np.testing.assert_array_equal(a.astype(np.float32), bf16(init[n]).astype(np.float32))
    sd = {n: rng.standard_normal(a.shape) for n, a in layer.state_dict().items()}  # float64 values
    layer.load_state_dict(sd)
    for n, a in layer.state_dict().items():  # nearest even, as ml_dtypes and torch round
        np.testing.assert_array_equal(a.astype(np.float32), sd[n].astype(np.float32).astype(BF16).astype(np.float32))
    assert layer.compute_dtype == "bfloat16"
    assert "dtype=bfloat16" in repr(layer)
    full = attn.MultiheadAttention(16, 2, seed=4)  # a float32 layer takes bfloat16 values exactly
    full.load_state_dict(layer.state_dict())
    for n, a in full.state_dict().items():
        assert a.dtype == np.float32
        np.testing.assert_array_equal(a, layer.state_dict()[n].astype(np.float32))


def test_float32_products_on_a_bfloat16_layer():
    """compute_dtype="float32" keeps the products exact on the bfloat16 values."""
    rng = np.random.default_rng(6)
    half = attn.MultiheadAttention(16, 4, batch_first=True, dtype=BF16, seed=2, compute_dtype="float32")
    full = attn.MultiheadAttention(16, 4, batch_first=True, seed=2)
    full.load_state_dict({n: a.astype(np.float32) for n, a in half.state_dict().items()})
    x = bf16(rng.standard_normal((2, 9, 16)))
    y, _ = half(x, x, x, need_weights=False)
    x32 = x.astype(np.float32)
    y_ref, _ = full(x32, x32, x32, need_weights=False)
    np.testing.assert_array_equal(y.astype(np.float32), bf16(y_ref).astype(np.float32))


def test_decode_rounds_the_float32_layers_step():
    rng = np.random.default_rng(7)
    half, full = layers(rng, 16, 2)
    x = bf16(rng.standard_normal((1, 6, 16)))
    caches = [attn.KVCache(1, 2, 8, 8) for _ in range(2)]
    for n0 in (0, 4):
        got = half.decode(x[:, n0:n0 + 4 if n0 == 0 else 6], caches[0], is_causal=True)
        want = full.decode(x[:, n0:n0 + 4 if n0 == 0 else 6].astype(np.float32), caches[1], is_causal=True)
        assert got.dtype == BF16
        np.testing.assert_array_equal(got.astype(np.float32), bf16(want).astype(np.float32))


def test_errors_name_the_argument():
    layer = attn.MultiheadAttention(8, 2, batch_first=True, dtype="bfloat16")
    x = np.zeros((1, 3, 8), np.float32)
    with pytest.raises(ValueError, match=r"'query' has dtype float32, expected bfloat16"):
        layer(x, x, x)
    xb = bf16(x)
    layer(xb, xb, xb)
    with pytest.raises(ValueError, match=r"'grad_output' has dtype float32, expected bfloat16"):
        layer.backward(x)
    with pytest.raises(ValueError, match="compute_dtype is bfloat16"):
        attn.MultiheadAttention(8, 2, dtype=np.float64, compute_dtype="bfloat16")
    with pytest.raises(ValueError, match="expected float32, float64 or bfloat16"):
        attn.MultiheadAttention(8, 2, dtype=np.float16)


def test_edge_conversions_are_torchs_and_ml_dtypes():
    """The layer's edges (the library's bulk conversions): widening is exact
    and rounding gives torch's and ml_dtypes' bits on finite values (random
    over the range, ties, subnormals, the largest values, ±inf), NaN stays
    NaN; a bfloat16 input in any layout gives the contiguous copy's result."""
    torch = pytest.importorskip("torch")
    from attn import _attn

    rng = np.random.default_rng(5)
    x = rng.integers(0, 2**32, 100003, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.where(np.isnan(x), np.float32(1.5), x)
    special = np.array([0.0, -0.0, 1 + 2.0**-8, 1 + 3 * 2.0**-8, 1 + 2.0**-9, 2.0**-130, -(2.0**-140),
                        3.38953139e38, -3.4e38, np.inf, -np.inf], np.float32)
    x[:special.size] = special
    bits = np.empty(x.shape, np.uint16)
    _attn.from_float_bf16(x, bits)
    assert np.array_equal(bits, torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
    assert np.array_equal(bits, x.astype(BF16).view(np.uint16))
    wide = np.empty(x.shape, np.float32)
    bits.setflags(write=False)  # (read-only sources are taken)
    _attn.to_float_bf16(bits, wide)
    assert np.array_equal(wide.view(np.uint32), bits.astype(np.uint32) << 16)
    nan = np.empty(2, np.uint16)
    _attn.from_float_bf16(np.array([np.nan, -np.nan], np.float32), nan)
    assert np.isnan(nan.view(BF16).astype(np.float32)).all()
    with pytest.raises(ValueError, match="argument 'dst' has 3 elements"):
        _attn.from_float_bf16(x[:4], np.empty(3, np.uint16))

    layer = attn.MultiheadAttention(16, 2, batch_first=True, dtype=torch.bfloat16, seed=1)
    xs = torch.randn(5, 3, 16).to(torch.bfloat16).transpose(0, 1)  # (3, 5, 16), not contiguous
    y, _ = layer(xs, xs, xs, need_weights=False)
    yc, _ = layer(xs.contiguous(), xs.contiguous(), xs.contiguous(), need_weights=False)
    assert y.dtype == torch.bfloat16 and torch.equal(y.view(torch.int16), yc.view(torch.int16))


def test_at_least_as_accurate_as_torch_bfloat16_layer():
    """Against the float64 layer on the same bfloat16 parameters and inputs:
    the median error (relative to the largest value) of the output, the input
    gradient and the weight gradient, over every element of a set of shapes,
    is at most that of torch's layer in bfloat16."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(8)
    torch.manual_seed(8)  # torch's layer draws its parameters from the global generator
    errs = {k: ([], []) for k in ("y", "dx", "dW")}
    for D, H, N, L in [(32, 4, 2, 33), (64, 2, 1, 70), (48, 6, 3, 17), (128, 8, 2, 64)]:
        ref_t = torch.nn.MultiheadAttention(D, H, batch_first=True).to(torch.bfloat16)
        half = attn.MultiheadAttention(D, H, batch_first=True, dtype=torch.bfloat16, seed=0)
        half.load_state_dict(ref_t.state_dict())  # bfloat16 tensors
        exact = attn.MultiheadAttention(D, H, batch_first=True, dtype=np.float64, seed=0)
        exact.load_state_dict({n: a.astype(np.float64) for n, a in half.state_dict().items()})
        xt = torch.randn(N, L, D, generator=torch.Generator().manual_seed(D)).to(torch.bfloat16)
        dyt = torch.randn(N, L, D, generator=torch.Generator().manual_seed(L)).to(torch.bfloat16)
        x64, dy64 = xt.double().numpy(), dyt.double().numpy()
        y64, _ = exact(x64, x64, x64, need_weights=False)
        dx64 = exact.backward(dy64)["query"]
        dW64 = exact.grads()["in_proj_weight"]

        y, _ = half(xt, xt, xt, need_weights=False)
        dx = half.backward(dyt)["query"]
        dW = half.grads()["in_proj_weight"].astype(np.float64)
        xg = xt.clone().requires_grad_(True)
        yt, _ = ref_t(xg, xg, xg, need_weights=False)
        yt.backward(dyt)
        for k, ours, theirs, want in (("y", y.double().numpy(), yt.detach().double().numpy(), y64),
                                      ("dx", dx.double().numpy(), xg.grad.double().numpy(), dx64),
                                      ("dW", dW, ref_t.in_proj_weight.grad.double().numpy(), dW64)):
            scale = np.max(np.abs(want))
            errs[k][0].append(np.abs(ours - want).ravel() / scale)
            errs[k][1].append(np.abs(theirs - want).ravel() / scale)
            assert np.max(np.abs(ours - want)) < 2**-6 * scale  # bfloat16's rounding, within its bound
    for k, (ours, theirs) in errs.items():  # the median over every element of every shape
        ours, theirs = np.median(np.concatenate(ours)), np.median(np.concatenate(theirs))
        assert ours <= theirs, (k, ours, theirs)
