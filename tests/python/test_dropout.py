"""Attention dropout from Python: the NumPy API against the keep-mask
formulation (the weights with dropout are the weights without it times 0 or
1/(1-p), the output is those weights times V), forward and backward agreeing
on the mask, the seed required, and attn.torch: gradients through the same
mask (torch.autograd.gradcheck in float64 with a fixed seed), and a fresh
mask per call drawn from torch's generator."""

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
