"""attn.MultiheadAttention against the NumPy oracle (npref.mha, written with
torch.nn.MultiheadAttention's conventions): layouts, packed and separate
projections, masks of both polarities, weights, state_dict, errors."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import attn
import npref


def random_params(layer, rng):
    sd = {n: rng.standard_normal(a.shape) * 0.5 for n, a in layer.state_dict().items()}
    layer.load_state_dict(sd)
    return sd


def random_layer_case(rng, dtype, packed, batch_first):
    D, H = [(8, 2), (12, 3), (6, 1), (16, 4)][int(rng.integers(0, 4))]
    kdim = vdim = None
    if not packed:
        kdim, vdim = int(rng.integers(3, 10)), int(rng.integers(3, 10))
    layer = attn.MultiheadAttention(D, H, bias=bool(rng.random() < 0.7), kdim=kdim, vdim=vdim,
                                    batch_first=batch_first, dtype=dtype, seed=1)
    params = random_params(layer, rng)
    B, L, S = int(rng.integers(1, 4)), int(rng.integers(1, 8)), int(rng.integers(1, 8))
    xq = rng.standard_normal((B, L, D)).astype(dtype)
    xk = rng.standard_normal((B, S, layer.kdim)).astype(dtype)
    xv = rng.standard_normal((B, S, layer.vdim)).astype(dtype)
    return layer, params, xq, xk, xv


def layout(x, batch_first):
    """Batch-first (B, N, D) data in the layer's layout (a copy for (N, B, D))."""
    return x if batch_first else np.ascontiguousarray(x.transpose(1, 0, 2))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("masks", ["none", "bool", "float", "kpm", "bool+kpm", "per-head"])
def test_forward_matches_numpy(dtype, packed, batch_first, masks):
    rng = np.random.default_rng(npref.seed_of(packed, batch_first, masks))
    for _ in range(3):
        layer, params, xq, xk, xv = random_layer_case(rng, dtype, packed, batch_first)
        B, L, S, H = xq.shape[0], xq.shape[1], xk.shape[1], layer.num_heads
        attn_mask = kpm = None
        if masks in ("bool", "bool+kpm"):
            attn_mask = rng.random((L, S)) < 0.3  # True = blocked (PyTorch's MHA polarity)
            attn_mask[:, 0] = False
        elif masks == "float":
            attn_mask = rng.standard_normal((L, S)).astype(dtype)
        elif masks == "per-head":
            attn_mask = rng.random((B * H, L, S)) < 0.3
            attn_mask[..., 0] = False
        if masks in ("kpm", "bool+kpm"):
            kpm = rng.random((B, S)) < 0.3
            kpm[:, 0] = False
        out, w = layer(layout(xq, batch_first), layout(xk, batch_first), layout(xv, batch_first),
                       key_padding_mask=kpm, attn_mask=attn_mask, average_attn_weights=False)
        want, want_w = npref.mha(params, xq, xk, xv, H, kpm, attn_mask)
        atol = npref.tol(dtype, layer.embed_dim * S, np.abs(want).max(), factor=50)
        np.testing.assert_allclose(layout(out, batch_first), want, rtol=0, atol=atol)
        np.testing.assert_allclose(w, want_w, rtol=0, atol=atol)
        _, avg = layer(layout(xq, batch_first), layout(xk, batch_first), layout(xv, batch_first),
                       key_padding_mask=kpm, attn_mask=attn_mask)
        np.testing.assert_allclose(avg, want_w.mean(axis=1), rtol=0, atol=atol)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_self_attention_causal_and_unbatched(dtype):
    rng = np.random.default_rng(5)
    layer = attn.MultiheadAttention(8, 2, dtype=dtype, seed=3)
    params = layer.state_dict()
    x = rng.standard_normal((6, 8)).astype(dtype)  # unbatched (L, E)
    out, w = layer(x, x, x, is_causal=True, need_weights=True)
    want, want_w = npref.mha(params, x[None], x[None], x[None], 2, is_causal=True)
    atol = npref.tol(dtype, 48, np.abs(want).max(), factor=50)
    assert out.shape == (6, 8) and w.shape == (6, 6)
    np.testing.assert_allclose(out, want[0], rtol=0, atol=atol)
    np.testing.assert_allclose(w, want_w.mean(axis=1)[0], rtol=0, atol=atol)
    assert np.all(np.triu(w, 1) == 0)
    # need_weights=False returns None; a separate key/value copy of x gives the same output.
    out2, none = layer(x, x.copy(), x.copy(), need_weights=False, is_causal=True)
    assert none is None
    np.testing.assert_allclose(out2, out, rtol=0, atol=atol)


def test_state_dict_round_trip_and_initialisation():
    layer = attn.MultiheadAttention(12, 3, seed=7)
    sd = layer.state_dict()
    assert sorted(sd) == ["in_proj_bias", "in_proj_weight", "out_proj.bias", "out_proj.weight"]
    assert sd["in_proj_weight"].shape == (36, 12) and sd["out_proj.weight"].shape == (12, 12)
    assert sd["in_proj_weight"].dtype == np.float32
    # Xavier-uniform bound sqrt(6 / (fan_in + fan_out)) for a [3D, D] matrix; zero biases.
    bound = np.sqrt(6 / (12 + 36))
    assert np.abs(sd["in_proj_weight"]).max() <= bound and np.abs(sd["in_proj_weight"]).max() > bound / 2
    assert np.all(sd["in_proj_bias"] == 0) and np.all(sd["out_proj.bias"] == 0)
    other = attn.MultiheadAttention(12, 3, seed=8)
    other.load_state_dict(sd)
    for n, a in other.state_dict().items():
        np.testing.assert_array_equal(a, sd[n])
    sep = attn.MultiheadAttention(8, 2, kdim=5, vdim=3, bias=False)
    assert sorted(sep.state_dict()) == ["k_proj_weight", "out_proj.weight", "q_proj_weight", "v_proj_weight"]
    assert sep.state_dict()["k_proj_weight"].shape == (8, 5)


def test_errors():
    layer = attn.MultiheadAttention(8, 2)
    x = np.zeros((3, 2, 8), np.float32)
    with pytest.raises(ValueError, match=r"missing keys \['out_proj.bias'\]"):
        sd = layer.state_dict()
        del sd["out_proj.bias"]
        layer.load_state_dict(sd)
    with pytest.raises(ValueError, match="in_proj_weight"):
        layer.load_state_dict({**layer.state_dict(), "in_proj_weight": np.zeros((8, 8))})
    with pytest.raises(ValueError, match="'dropout'"):  # dropout itself works (test_dropout.py)
        attn.MultiheadAttention(8, 2, 1.5)
    with pytest.raises(ValueError, match="divisible|num_heads"):
        attn.MultiheadAttention(9, 2)
    # The expected dtype is the layer's, and the message says so (not "the
    # dtype of 'query'", which is the wrong array to blame).
    with pytest.raises(ValueError, match=r"'query' has dtype float64, expected float32 \(the layer's dtype"):
        layer(x.astype(np.float64), x, x)
    with pytest.raises(ValueError, match=r"'value' has dtype float64, expected float32 \(the layer's dtype"):
        layer(x, x, x.astype(np.float64))
    with pytest.raises(ValueError, match="'mask' has shape"):
        layer(x, x, x, attn_mask=np.zeros((4, 3), bool))
    with pytest.raises(ValueError, match="'key_padding_mask' has shape"):
        layer(x, x, x, key_padding_mask=np.zeros((3, 2), bool))
    with pytest.raises(ValueError, match="attn::MultiheadAttention::forward"):
        layer(x, np.zeros((3, 2, 7), np.float32), np.zeros((3, 2, 7), np.float32))


def test_threads_match_serial():
    rng = np.random.default_rng(9)
    layer = attn.MultiheadAttention(16, 4, dtype=np.float64, seed=2)
    xs = [rng.standard_normal((10 + i, 2, 16)) for i in range(8)]
    serial = [layer(x, x, x) for x in xs]
    with ThreadPoolExecutor(max_workers=4) as pool:
        got = list(pool.map(lambda x: layer(x, x, x), xs * 3))
    for i, (o, w) in enumerate(got):
        np.testing.assert_array_equal(o, serial[i % 8][0])
        np.testing.assert_array_equal(w, serial[i % 8][1])


def composed_bf16(layer, x, dy, **sdpa_kw):
    """test_dropout.composed with every product on bfloat16 operands: the
    GEMMs round both operands, the attention computes with
    compute_dtype="bfloat16"."""
    import ml_dtypes
    from test_dropout import composed
    r = lambda a: np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    y, _, dx, dW = composed(layer, x, dy, mm=lambda a, b: r(a) @ r(b), compute_dtype="bfloat16", **sdpa_kw)
    return y, dx, dW


def test_bfloat16_compute_is_the_composed_bfloat16_layer():
    """compute_dtype="bfloat16": every product of the layer takes bfloat16
    operands (the projections' GEMMs and the attention), forward and backward:
    the layer equals its composition with the operands rounded (float32 sums
    in another order), and differs from the exact layer by what the rounding
    allows."""
    rng = np.random.default_rng(11)
    D, H, B, L = 32, 4, 2, 48  # more query rows than the decode kernel takes
    exact = attn.MultiheadAttention(D, H, batch_first=True, seed=11)
    state = {n: (rng.standard_normal(a.shape) * 0.3).astype(np.float32) for n, a in exact.state_dict().items()}
    exact.load_state_dict(state)
    bf = attn.MultiheadAttention(D, H, batch_first=True, seed=11, compute_dtype="bfloat16")
    bf.load_state_dict(state)
    assert bf.compute_dtype == "bfloat16" and exact.compute_dtype is None
    x = rng.standard_normal((B, L, D)).astype(np.float32)
    dy = rng.standard_normal((B, L, D)).astype(np.float32)
    y, _ = bf(x, x, x, is_causal=True, need_weights=False)
    dx = bf.backward(dy)["query"]
    y_ref, dx_ref, dW_ref = composed_bf16(bf, x, dy, is_causal=True)
    scale = np.max(np.abs(y_ref))
    np.testing.assert_allclose(y, y_ref, rtol=0, atol=2e-5 * scale)
    np.testing.assert_allclose(dx, dx_ref, rtol=0, atol=2e-4 * np.max(np.abs(dx_ref)))
    np.testing.assert_allclose(bf.grads()["in_proj_weight"], dW_ref, rtol=0, atol=2e-4 * np.max(np.abs(dW_ref)))
    y_exact, _ = exact(x, x, x, is_causal=True, need_weights=False)
    diff = np.max(np.abs(y - y_exact))
    assert 1e-4 * scale < diff < 2 ** -6 * scale  # bfloat16's rounding shows, within its bound


def test_bfloat16_compute_errors_name_the_argument():
    with pytest.raises(ValueError, match="compute_dtype"):
        attn.MultiheadAttention(8, 2, compute_dtype="float16")
    with pytest.raises(ValueError, match="compute_dtype is bfloat16"):
        attn.MultiheadAttention(8, 2, dtype=np.float64, compute_dtype="bfloat16")
