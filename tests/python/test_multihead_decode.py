"""attn.MultiheadAttention.decode: a sequence fed through a KV cache a few
tokens at a time gives, step after step, the rows of the float64 oracle
(npref.mha, PyTorch's conventions) over the whole prefix; with the score
rules it equals the layer's own forward over the prefix; torch.nn.
MultiheadAttention agrees; errors leave the cache as it was."""

import numpy as np
import pytest

import attn
import npref

STEPS = [3, 1, 1, 4, 2, 1]


def layer_and_tokens(rng, D=8, H=2, B=2, batch_first=True, sinks=False, bias=True):
    layer = attn.MultiheadAttention(D, H, bias=bias, batch_first=batch_first, seed=3, sinks=sinks)
    sd = {n: (rng.standard_normal(a.shape) * 0.5).astype(np.float32) for n, a in layer.state_dict().items()}
    layer.load_state_dict(sd)
    x = rng.standard_normal((B, sum(STEPS), D)).astype(np.float32)
    return layer, sd, x


def cache_for(layer, B, capacity=16, dtype="float32", page_size=0):
    return attn.KVCache(B, layer.num_heads, capacity, layer.head_dim, dtype=dtype, page_size=page_size)


def steps(layer, x, cache, batch_first=True, **kw):
    """Yields (length after the step, the step's output as (B, n, D)); chunks of
    n > 1 tokens of a causal model, so is_causal=True."""
    n0 = 0
    for n in STEPS:
        chunk = x[:, n0:n0 + n]
        out = layer.decode(chunk if batch_first else np.ascontiguousarray(chunk.transpose(1, 0, 2)), cache,
                           is_causal=True, **kw)
        n0 += n
        yield n0, n, (out if batch_first else out.transpose(1, 0, 2))


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("page_size", [0, 3])
@pytest.mark.parametrize("bias", [True, False])
def test_every_step_matches_the_oracle(batch_first, page_size, bias):
    rng = np.random.default_rng(npref.seed_of(batch_first, page_size, bias))
    layer, sd, x = layer_and_tokens(rng, batch_first=batch_first, bias=bias)
    cache = cache_for(layer, 2, page_size=page_size)
    for length, n, out in steps(layer, x, cache, batch_first):
        assert cache.lengths == (length, length)
        pre = x[:, :length]
        want, _ = npref.mha(sd, pre, pre, pre, layer.num_heads, is_causal=True)
        np.testing.assert_allclose(out, want[:, length - n:], rtol=2e-5, atol=2e-5)


def test_mask_over_the_cache_uses_the_layers_polarity():
    rng = np.random.default_rng(5)
    layer, sd, x = layer_and_tokens(rng)
    blocked = rng.random(16) < 0.3  # True = NOT allowed, as in forward()
    blocked[0] = False
    cache = cache_for(layer, 2)
    for length, n, out in steps(layer, x, cache, attn_mask=np.broadcast_to(blocked, (1, 16))):
        pre = x[:, :length]
        # The same keys hidden for every query: the oracle's key_padding_mask.
        want, _ = npref.mha(sd, pre, pre, pre, layer.num_heads, is_causal=True,
                            key_padding_mask=np.broadcast_to(blocked[:length], (2, length)))
        np.testing.assert_allclose(out, want[:, length - n:], rtol=2e-5, atol=2e-5)


def test_a_float_mask_is_added_to_the_scores():
    rng = np.random.default_rng(9)
    layer, sd, x = layer_and_tokens(rng)
    blocked = rng.random(16) < 0.3
    blocked[0] = False
    additive = np.where(blocked, -np.inf, rng.standard_normal(16)).astype(np.float32)[None]  # (1, C)
    cache = cache_for(layer, 2, page_size=3)
    for length, n, out in steps(layer, x, cache, attn_mask=additive):
        pre = x[:, :length]
        want, _ = npref.mha(sd, pre, pre, pre, layer.num_heads, is_causal=True, attn_mask=additive[:, :length])
        np.testing.assert_allclose(out, want[:, length - n:], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_score_rules_equal_the_forward_over_the_prefix(dtype):
    rng = np.random.default_rng(6)
    layer, sd, x = layer_and_tokens(rng, D=12, H=3, sinks=True)
    layer.load_state_dict({"sinks": np.array([0.5, -1.0, 2.0], np.float32)}, strict=False)
    slopes = np.array([0.5, 0.25, 0.125], np.float32)
    kw = dict(window_size=(4, -1), softcap=2.0, alibi_slopes=slopes)
    cache = cache_for(layer, 2, dtype=dtype, page_size=4)
    for length, n, out in steps(layer, x, cache, **kw):
        pre = x[:, :length]
        want, _ = layer(pre, pre, pre, need_weights=False, is_causal=True, **kw)
        # bfloat16 keeps 8 bits of each stored key and value (relative error 2^-9).
        tol = 1e-5 if dtype == "float32" else 0.03
        np.testing.assert_allclose(out, want[:, length - n:], rtol=tol, atol=tol)


def test_unbatched_and_torch_tensors():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    layer, sd, x = layer_and_tokens(rng, B=1)
    ref = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()})
    with torch.no_grad():
        xt = torch.from_numpy(x)
        N = x.shape[1]
        causal = torch.triu(torch.ones(N, N, dtype=torch.bool), 1)
        want, _ = ref(xt, xt, xt, attn_mask=causal, need_weights=False)
        cache = cache_for(layer, 1)
        n0 = 0
        for n in STEPS:
            out = layer.decode(xt[0, n0:n0 + n], cache, is_causal=True)  # unbatched (L, E), a torch tensor
            assert isinstance(out, torch.Tensor) and tuple(out.shape) == (n, 8)
            torch.testing.assert_close(out, want[0, n0:n0 + n], rtol=2e-5, atol=2e-5)
            n0 += n
        with pytest.raises(ValueError, match="requires grad"):
            with torch.enable_grad():
                layer.decode(torch.zeros(1, 8, requires_grad=True), cache)


def test_errors_leave_the_cache_as_it_was():
    rng = np.random.default_rng(8)
    layer, sd, x = layer_and_tokens(rng)
    cache = cache_for(layer, 2, capacity=8)
    layer.decode(x[:, :3], cache, is_causal=True)
    bad = [
        (dict(x=x[:, :3, :6]), "'query'"),
        (dict(cache=cache_for(layer, 3)), "'query'"),
        (dict(cache=attn.KVCache(2, 1, 8, 4)), "'cache'"),
        (dict(window_size=(-3, 0)), r"option 'window\.left' is -3"),
        (dict(alibi_slopes=np.ones(3, np.float32)), "'alibi_slopes'"),
        (dict(attn_mask=np.zeros((3, 5), bool)), "'mask'"),
        # a float attn_mask reaches the library as its attn_bias
        (dict(attn_mask=np.zeros((2, 5), np.float32)),
         r"attn::MultiheadAttention::decode: argument 'bias' has shape \(1, 1, 2, 5\)"),
        (dict(attn_mask=np.full((1, 8), np.nan, np.float32)),
         "attn::MultiheadAttention::decode: argument 'bias' contains NaN"),
        (dict(attn_mask=np.zeros((1, 8), np.int32)), r"MultiheadAttention\.decode: 'attn_mask' has dtype int32"),
        (dict(x=x[:, :6]), "capacity 8"),
    ]
    for kw, words in bad:
        args = dict(x=x[:, 3:5], cache=cache)
        args.update(kw)
        with pytest.raises(ValueError, match=words):
            layer.decode(args.pop("x"), args.pop("cache"), **args)
        assert cache.lengths == (3, 3), kw
    with pytest.raises(TypeError, match="attn.KVCache"):
        layer.decode(x[:, 3:4], object())
    double = attn.MultiheadAttention(8, 2, batch_first=True, dtype=np.float64)
    with pytest.raises(ValueError, match="float32 only"):
        double.decode(x[:, :1].astype(np.float64), cache)
    assert cache.lengths == (3, 3)
