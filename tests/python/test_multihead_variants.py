"""attn.MultiheadAttention with the variants (window_size, softcap, alibi_slopes,
learnable sinks) against an independent formulation: a float64 NumPy
computation that writes each variant as its definition (the window and ALiBi
as one dense additive bias, soft-capping as c·tanh(s/c), the sink as an extra
key column with a zero value), the sinks' gradient against central finite
differences, and torch.nn.MultiheadAttention with the equivalent dense float
mask (window and ALiBi) and add_zero_attn (a zero key and value: a sink of
logit 0, the layer's initial sinks) where torch is installed."""

import numpy as np
import pytest

import attn
import npref


def reference(params, x, H, window=None, softcap=None, alibi=None, sinks=None, causal=False):
    """Self-attention of x (B, N, D) in float64 with every variant spelled out."""
    p = {n: np.asarray(a, np.float64) for n, a in params.items()}
    B, N, D = x.shape
    E = D // H
    qkv = x.astype(np.float64) @ p["in_proj_weight"].T + p["in_proj_bias"]
    q, k, v = (t.reshape(B, N, H, E).transpose(0, 2, 1, 3) for t in np.split(qkv, 3, axis=-1))
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(E)
    if softcap:
        s = softcap * np.tanh(s / softcap)
    i, j = np.arange(N)[:, None], np.arange(N)[None, :]
    bias = np.zeros((H, N, N))
    if alibi is not None:
        bias -= np.asarray(alibi, np.float64)[:, None, None] * np.abs(i - j)
    s = s + bias + np.where(npref.band_mask(N, N, causal, window), 0.0, -np.inf)
    if sinks is not None:  # one more key: logit sinks[h], value 0
        col = np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None, None], (B, H, N, 1))
        s = np.concatenate([s, col], axis=-1)
    w = np.exp(s - s.max(-1, keepdims=True))
    w = w / w.sum(-1, keepdims=True)
    w = w[..., :N]
    o = (w @ v).transpose(0, 2, 1, 3).reshape(B, N, D)
    return o @ p["out_proj.weight"].T + p["out_proj.bias"], w


def random_layer(rng, dtype, D=8, H=2, sinks=False):
    layer = attn.MultiheadAttention(D, H, batch_first=True, dtype=dtype, seed=3, sinks=sinks)
    params = {n: rng.standard_normal(a.shape) * 0.5 for n, a in layer.state_dict().items()}
    layer.load_state_dict(params)
    return layer, params


CASES = [
    dict(window=(2, 1)),
    dict(window=(1, -1), causal=True),
    dict(softcap=0.8),
    dict(alibi=True),
    dict(sinks=True),
    dict(window=(3, 0), alibi=True, sinks=True, softcap=1.5),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_variants_match_numpy(dtype, case):
    c = CASES[case]
    rng = np.random.default_rng(npref.seed_of("variants", case, np.dtype(dtype).name))
    H = 2
    layer, params = random_layer(rng, dtype, H=H, sinks=c.get("sinks", False))
    slopes = rng.random(H).astype(dtype) if c.get("alibi") else None
    x = rng.standard_normal((2, 7, 8)).astype(dtype)
    out, w = layer(x, x, x, average_attn_weights=False, is_causal=c.get("causal", False),
                   window_size=c.get("window"), softcap=c.get("softcap"), alibi_slopes=slopes)
    want, want_w = reference(params, x, H, c.get("window"), c.get("softcap"), slopes,
                             params.get("sinks"), c.get("causal", False))
    np.testing.assert_allclose(out, want, rtol=0, atol=npref.tol(dtype, 8, np.abs(want).max(), 50.0))
    np.testing.assert_allclose(w, want_w, rtol=0, atol=npref.tol(dtype, 8, 1.0, 50.0))
    if c.get("sinks"):  # every row gives part of its weight to the sink
        assert (want_w.sum(-1) < 1).all()
        np.testing.assert_allclose(w.sum(-1), want_w.sum(-1), rtol=0, atol=npref.tol(dtype, 8, 1.0, 50.0))


def test_sinks_are_a_parameter_with_a_gradient():
    rng = np.random.default_rng(5)
    H = 2
    layer, params = random_layer(rng, np.float64, H=H, sinks=True)
    assert layer.parameter_names()[-1] == "sinks"
    assert attn.MultiheadAttention(8, 2, sinks=True, seed=1).state_dict()["sinks"].tolist() == [0.0, 0.0]
    given = attn.MultiheadAttention(8, 2, sinks=[0.5, -1.0], seed=1, dtype=np.float64)
    assert given.state_dict()["sinks"].tolist() == [0.5, -1.0]
    x = rng.standard_normal((2, 6, 8))
    g = rng.standard_normal((2, 6, 8))
    kw = dict(window_size=(2, 2), alibi_slopes=np.array([0.3, 0.1]))
    layer.zero_grad()
    layer(x, x, x, **kw)
    grads = layer.backward(g)
    dsinks = layer.grads()["sinks"]
    assert grads["query"].shape == x.shape

    def loss(s):
        p = dict(params, sinks=s)
        return float((reference(p, x, H, window=(2, 2), alibi=kw["alibi_slopes"], sinks=s)[0] * g).sum())

    eps = 1e-6
    for h in range(H):
        e = np.zeros(H)
        e[h] = eps
        numeric = (loss(params["sinks"] + e) - loss(params["sinks"] - e)) / (2 * eps)
        assert abs(dsinks[h] - numeric) <= 1e-6 * max(1.0, abs(numeric)), (h, dsinks[h], numeric)
    # the input gradient too, one direction
    d = rng.standard_normal(x.shape)
    f = lambda t: float((reference(params, x + t * d, H, window=(2, 2), alibi=kw["alibi_slopes"],
                                   sinks=params["sinks"])[0] * g).sum())
    numeric = (f(eps) - f(-eps)) / (2 * eps)
    assert abs(float((grads["query"] * d).sum()) - numeric) <= 1e-5 * max(1.0, abs(numeric))


def test_bad_variant_arguments_are_named():
    layer = attn.MultiheadAttention(8, 2, batch_first=True, seed=1)
    x = np.zeros((1, 3, 8), np.float32)
    for kw, part in [(dict(window_size=(1,)), "attn.MultiheadAttention.forward: 'window_size' is"),
                     # the layer checks the rules itself, under its own name
                     (dict(softcap=-1.0), "attn::MultiheadAttention::forward: option 'softcap' is -1"),
                     (dict(alibi_slopes=np.ones(3)), r"attn::MultiheadAttention::forward: argument 'alibi_slopes' "
                                                     r"has shape \(3,\), expected \(H,\) = \(2,\)")]:
        with pytest.raises(ValueError, match=part):
            layer(x, x, x, **kw)
    with pytest.raises(ValueError, match=r"attn::MultiheadAttention::load_parameter: parameter 'sinks' has shape"):
        attn.MultiheadAttention(8, 2, sinks=[1.0, 2.0, 3.0])


def test_matches_torch_with_dense_masks(parity):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(11)
    D, H, B, N = 8, 2, 2, 7
    ref = torch.nn.MultiheadAttention(D, H, batch_first=True, dtype=torch.float64)
    layer = attn.MultiheadAttention(D, H, batch_first=True, dtype=np.float64, seed=1)
    layer.load_state_dict(ref.state_dict())
    x = rng.standard_normal((B, N, D))
    slopes = np.array([0.5, 0.125])
    # window (2, 1) and ALiBi as one float mask (B·H, L, S), PyTorch's additive form
    i, j = np.arange(N)[:, None], np.arange(N)[None, :]
    dense = -slopes[:, None, None] * np.abs(i - j) + np.where(npref.band_mask(N, N, window=(2, 1)), 0.0, -np.inf)
    mask = torch.from_numpy(np.tile(dense, (B, 1, 1)))
    xt = torch.from_numpy(x)
    with torch.no_grad():
        want, want_w = ref(xt, xt, xt, attn_mask=mask, average_attn_weights=False)
    out, w = layer(x, x, x, window_size=(2, 1), alibi_slopes=slopes, average_attn_weights=False)
    parity.record("MultiheadAttention window+alibi", out, want.numpy())
    np.testing.assert_allclose(out, want.numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(w, want_w.numpy(), rtol=1e-10, atol=1e-10)
    # sinks at their initial 0 = add_zero_attn's zero key with a zero value
    zero = torch.nn.MultiheadAttention(D, H, batch_first=True, add_zero_attn=True, dtype=torch.float64)
    sinky = attn.MultiheadAttention(D, H, batch_first=True, dtype=np.float64, seed=1, sinks=True)
    sd = {k: v for k, v in zero.state_dict().items()}
    sd["sinks"] = np.zeros(H)
    sinky.load_state_dict(sd)
    with torch.no_grad():
        want, want_w = zero(xt, xt, xt, average_attn_weights=False)
    out, w = sinky(x, x, x, average_attn_weights=False)
    parity.record("MultiheadAttention sinks=0 vs add_zero_attn", out, want.numpy())
    np.testing.assert_allclose(out, want.numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(w, want_w.numpy()[..., :N], rtol=1e-10, atol=1e-10)
