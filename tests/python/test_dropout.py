"""Attention dropout from Python: the NumPy API against the keep-mask
formulation (the weights with dropout are the weights without it times 0 or
1/(1-p), the output is those weights times V), forward and backward agreeing
on the mask, the seed required, and attn.torch: gradients through the same
mask (torch.autograd.gradcheck in float64 with a fixed seed), and a fresh
mask per call drawn from torch's generator. attn.MultiheadAttention: in
training mode its forward and backward are the projections around the dense
call with the same seed, composed here in NumPy; finite differences through a
fixed seed; eval mode is dropout 0; the seeds come from the layer's generator;
bad values name the argument; against torch.nn.MultiheadAttention, the same
eval-mode result and training-mode weights of the same form."""

import numpy as np
import pytest

import attn


def inputs(dtype=np.float64, B=2, H=3, L=7, S=9, E=5, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(dtype) for s in ((B, H, L, E), (B, H, S, E), (B, H, S, E), (B, H, L, E))]


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_numpy_dropout_is_the_keep_mask_formulation(backend):
    dtype = np.float64 if backend == "reference" else np.float32
    q, k, v, _ = inputs(dtype)
    p = 0.4
    out0, lse0, w0 = attn.scaled_dot_product_attention(q, k, v, is_causal=True, backend=backend,
                                                       return_lse=True, return_weights=True)
    out, lse, w = attn.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, backend=backend,
                                                    return_lse=True, return_weights=True, dropout_seed=7)
    np.testing.assert_array_equal(lse, lse0)
    kept = w != 0
    assert 0 < kept[w0 != 0].mean() < 1
    np.testing.assert_allclose(w[kept] / w0[kept], 1 / (1 - p), rtol=1e-6)
    np.testing.assert_allclose(out, w @ v, rtol=1e-5, atol=1e-6)
    assert not np.allclose(out, out0)
    # Another seed or offset: another mask; the same: the same output.
    again = attn.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, backend=backend, dropout_seed=7)
    np.testing.assert_array_equal(again, out)
    other = attn.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, backend=backend,
                                              dropout_seed=7, dropout_offset=1)
    assert not np.allclose(other, out)


def test_numpy_backward_uses_the_forwards_mask():
    q, k, v, g = inputs()
    kw = dict(dropout_p=0.3, is_causal=True, backend="reference", dropout_seed=11)
    dq, dk, dv = attn.scaled_dot_product_attention_backward(g, q, k, v, **kw)
    eps = 1e-6
    for x, dx in ((q, dq), (k, dk), (v, dv)):
        for idx in [(0, 1, 2, 3), (1, 2, 4, 0)]:
            old = x[idx]
            x[idx] = old + eps
            up = np.sum(g * attn.scaled_dot_product_attention(q, k, v, **kw))
            x[idx] = old - eps
            down = np.sum(g * attn.scaled_dot_product_attention(q, k, v, **kw))
            x[idx] = old
            assert dx[idx] == pytest.approx((up - down) / (2 * eps), rel=1e-5, abs=1e-8)


def test_dropout_errors_name_the_argument():
    q, k, v, _ = inputs()
    with pytest.raises(ValueError, match="'dropout_seed' is required"):
        attn.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match="dropout_p"):
        attn.scaled_dot_product_attention(q, k, v, dropout_p=1.5, dropout_seed=1)
    with pytest.raises(ValueError, match="'dropout_seed' is -1"):
        attn.scaled_dot_product_attention(q, k, v, dropout_p=0.1, dropout_seed=-1)


def test_torch_dropout_gradients_and_fresh_masks():
    torch = pytest.importorskip("torch")
    import attn.torch as at
    q, k, v, _ = (torch.tensor(x, requires_grad=True) for x in inputs(B=1, H=2, L=5, S=6, E=3))
    torch.manual_seed(0)
    a = at.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(0)
    b = at.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    c = at.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert torch.equal(a, b) and not torch.equal(a, c)
    # gradcheck through a fixed seed: the mask stays put while the inputs move.
    fn = lambda q, k, v: at.ScaledDotProductAttention.apply(q, k, v, None, 0.3, True, None, False, "reference",
                                                            None, None, None, 0, None, None, 1234)
    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_varlen_dropout_forward_and_backward_agree_with_the_mask():
    torch = pytest.importorskip("torch")
    import attn.torch as at
    rng = np.random.default_rng(3)
    cu = torch.tensor([0, 4, 9], dtype=torch.int64)
    q, k, v = (torch.tensor(rng.standard_normal((9, 2, 3)), requires_grad=True) for _ in range(3))
    fn = lambda q, k, v: at.VarlenAttention.apply(q, k, v, cu, cu, 5, 5, None, True, None, None, None, 0, None,
                                                  None, "reference", 0.3, 99)
    assert torch.autograd.gradcheck(fn, (q, k, v))
    torch.manual_seed(1)
    a = at.varlen_attention(q, k, v, cu, cu, 5, 5, is_causal=True, dropout_p=0.3)
    torch.manual_seed(1)
    b = at.varlen_attention(q, k, v, cu, cu, 5, 5, is_causal=True, dropout_p=0.3)
    assert torch.equal(a, b)


# ---------------------------------------------------------------------------
# attn.MultiheadAttention

def mha_case(dropout, seed=3, D=12, H=3, B=2, L=7):
    rng = np.random.default_rng(seed)
    layer = attn.MultiheadAttention(D, H, dropout, batch_first=True, dtype=np.float64, seed=seed)
    layer.load_state_dict({n: rng.standard_normal(a.shape) * 0.5 for n, a in layer.state_dict().items()})
    return layer, rng.standard_normal((B, L, D)), rng.standard_normal((B, L, D))


def composed(layer, x, dy, mm=np.matmul, **sdpa_kw):
    """The layer's forward and backward written out around attn's dense call:
    q, k, v = x·W_tᵀ + b_t split into heads, O = sdpa(q, k, v), y = O·W_oᵀ + b_o;
    dO = dy·W_o, (dq, dk, dv) = its backward, dx = Σ_t dP_t·W_t, dW_in = dPᵀ·x;
    every matrix product through mm."""
    sd = layer.state_dict()
    B, L, D = x.shape
    H = layer.num_heads
    E = D // H
    heads = lambda a: a.reshape(B, L, H, E).transpose(0, 2, 1, 3)
    merge = lambda a: a.transpose(0, 2, 1, 3).reshape(B, L, D)
    W, b = sd["in_proj_weight"], sd["in_proj_bias"]
    q, k, v = (heads(mm(x, W[t * D:(t + 1) * D].T) + b[t * D:(t + 1) * D]) for t in range(3))
    o, w = attn.scaled_dot_product_attention(q, k, v, return_weights=True, **sdpa_kw)
    y = mm(merge(o), sd["out_proj.weight"].T) + sd["out_proj.bias"]
    dP = [merge(g) for g in attn.scaled_dot_product_attention_backward(heads(mm(dy, sd["out_proj.weight"])), q, k, v,
                                                                       **sdpa_kw)]
    dx = sum(mm(dP[t], W[t * D:(t + 1) * D]) for t in range(3))
    dW = np.concatenate([mm(g.reshape(B * L, D).T, x.reshape(B * L, D)) for g in dP])
    return y, w, dx, dW


def test_multihead_training_dropout_is_the_composed_dense_call():
    layer, x, dy = mha_case(0.3)
    assert layer.training
    out, w = layer(x, x, x, is_causal=True, average_attn_weights=False, dropout_seed=77)
    grads = layer.backward(dy)
    y, w_ref, dx, dW = composed(layer, x, dy, is_causal=True, dropout_p=0.3, dropout_seed=77)
    np.testing.assert_allclose(out, y, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(w, w_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(grads["query"], dx, rtol=1e-11, atol=1e-11)
    np.testing.assert_allclose(layer.grads()["in_proj_weight"], dW, rtol=1e-11, atol=1e-11)
    seen = w[:, :, np.tril(np.ones((7, 7), bool))]  # the weights causal leaves: about 30% dropped (6σ)
    assert abs(np.mean(seen == 0) - 0.3) < 6 * np.sqrt(0.3 * 0.7 / seen.size)
    # the composition tells masks apart: another seed, or none, is far off
    for kw in (dict(dropout_p=0.3, dropout_seed=78), {}):
        other, _, _, _ = composed(layer, x, dy, is_causal=True, **kw)
        assert np.max(np.abs(other - out)) > 1e-2


def test_multihead_dropout_gradients_match_finite_differences():
    layer, x, dy = mha_case(0.4, seed=5, D=6, H=2, L=5)
    layer(x, x, x, dropout_seed=9)
    dx = layer.backward(dy)["query"]
    f = lambda: float(np.sum(layer(x, x, x, need_weights=False, dropout_seed=9)[0] * dy))
    eps = 1e-6
    for idx in [(0, 0, 0), (0, 3, 5), (1, 2, 1), (1, 4, 4)]:
        old = x[idx]
        x[idx] = old + eps
        up = f()
        x[idx] = old - eps
        down = f()
        x[idx] = old
        assert dx[idx] == pytest.approx((up - down) / (2 * eps), rel=1e-6, abs=1e-8)


def test_multihead_eval_mode_is_dropout_zero_and_seeds_come_from_the_generator():
    plain, x, _ = mha_case(0.0)
    layer, _, _ = mha_case(0.5)
    ref, ref_w = plain(x, x, x)
    assert layer.eval() is layer and not layer.training
    out, w = layer(x, x, x)
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(w, ref_w)
    assert layer.train() is layer and layer.training
    a, _ = layer(x, x, x)
    b, _ = layer(x, x, x)
    assert np.max(np.abs(a - ref)) > 1e-2 and np.max(np.abs(b - a)) > 1e-2  # a fresh mask per call
    # the seeds are the generator's draws: the default generator is default_rng(seed)
    draws = np.random.default_rng(3)
    for got in (a, b):
        want, _ = layer(x, x, x, dropout_seed=draws.integers(0, 2**64, dtype=np.uint64))
        np.testing.assert_array_equal(got, want)
    mine = attn.MultiheadAttention(12, 3, 0.5, batch_first=True, dtype=np.float64, seed=3,
                                   generator=np.random.default_rng(42))
    mine.load_state_dict(layer.state_dict())
    want, _ = layer(x, x, x, dropout_seed=np.random.default_rng(42).integers(0, 2**64, dtype=np.uint64))
    np.testing.assert_array_equal(mine(x, x, x)[0], want)


def test_multihead_dropout_errors_name_the_argument():
    for bad in (1.5, -0.1, float("nan"), "0.1", True):
        with pytest.raises(ValueError, match="'dropout'"):
            attn.MultiheadAttention(8, 2, bad)
    with pytest.raises(ValueError, match="'generator'"):
        attn.MultiheadAttention(8, 2, 0.1, generator=7)
    layer = attn.MultiheadAttention(8, 2, 0.1)
    x = np.zeros((3, 2, 8), np.float32)
    for bad in (-1, 2**64, 0.5):
        with pytest.raises(ValueError, match="'dropout_seed'"):
            layer(x, x, x, dropout_seed=bad)


def test_multihead_dropout_modes_as_torch():
    """torch.nn.MultiheadAttention with the same weights: in eval mode both equal
    the undropped layer; in training mode both return weights that are the
    eval-mode ones times 0 or 1/(1 - p) (the masks themselves come from
    different generators)."""
    torch = pytest.importorskip("torch")
    ref = torch.nn.MultiheadAttention(12, 3, dropout=0.5, batch_first=True, dtype=torch.float64)
    layer = attn.MultiheadAttention(12, 3, 0.5, batch_first=True, dtype=np.float64)
    layer.load_state_dict(ref.state_dict())
    x = torch.tensor(np.random.default_rng(0).standard_normal((2, 7, 12)))
    with torch.no_grad():
        want, want_w = ref.eval()(x, x, x, average_attn_weights=False)
        got, got_w = layer.eval()(x, x, x, average_attn_weights=False)
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(got_w.numpy(), want_w.numpy(), rtol=1e-12, atol=1e-12)
        for module in (ref.train(), layer.train()):
            _, w = module(x, x, x, average_attn_weights=False)
            w = np.asarray(w)
            kept = w != 0
            assert 0 < kept.mean() < 1
            np.testing.assert_allclose(w[kept], 2 * want_w.numpy()[kept], rtol=1e-12)
