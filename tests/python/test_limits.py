"""Edges of the Python entry points: score factors the float32 kernels cannot
carry, offsets beyond int64, decoding with tensors that require grad, the
half-precision refusal of decode, and the torch drop-in on zero-size inputs
(compared with PyTorch itself)."""

import numpy as np
import pytest

import attn


def _qkv(rng, L=3, S=5, E=8):
    return (rng.standard_normal((1, 2, L, E)).astype(np.float32),
            rng.standard_normal((1, 2, S, E)).astype(np.float32),
            rng.standard_normal((1, 2, S, E)).astype(np.float32))


@pytest.mark.parametrize("kw", [dict(scale=1e38), dict(scale=1e-30), dict(softcap=1e37), dict(softcap=2.4e38),
                                dict(softcap=1e-38)])
def test_score_factors_beyond_float32_are_refused(kw):
    q, k, v = _qkv(np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"\[2\^-64, 2\^64\]"):
        attn.scaled_dot_product_attention(q, k, v, **kw)
    cache = attn.KVCache(1, 2, 8, 8)
    cache.append(k, v)
    with pytest.raises(ValueError, match=r"\[2\^-64, 2\^64\]"):
        attn.decode_attention(q[:, :, :1], cache, **kw)


@pytest.mark.parametrize("backend", ["fused", "auto"])
def test_score_factors_at_the_bounds_match_the_reference(backend):
    rng = np.random.default_rng(1)
    q, k, v = _qkv(rng)
    for kw in (dict(scale=2.0**64), dict(scale=2.0**-64), dict(softcap=2.0**64), dict(softcap=2.0**-64),
               dict(scale=2.0**64, softcap=2.0**-64)):
        s = np.einsum("bhle,bhse->bhls", q.astype(np.float64), k.astype(np.float64))
        s *= kw.get("scale", 1 / np.sqrt(q.shape[-1]))
        if "softcap" in kw:
            s = kw["softcap"] * np.tanh(s / kw["softcap"])
        p = np.exp(s - s.max(-1, keepdims=True))
        want = (p / p.sum(-1, keepdims=True)) @ v.astype(np.float64)
        got = attn.scaled_dot_product_attention(q, k, v, backend=backend, **kw)
        assert np.isfinite(got).all(), kw
        np.testing.assert_allclose(got, want, atol=2e-5, err_msg=str(kw))


def test_unsigned_offsets_beyond_int64_are_named():
    x = np.ones((3, 1, 4), np.float32)
    cu = np.array([0, 2**64 - 1], np.uint64)
    with pytest.raises(ValueError, match=r"'cu_seqlens_q' has value 18446744073709551615 at index 1"):
        attn.varlen_attention(x, x, x, cu, np.array([0, 3]), 3, 3)


def _cache():
    c = attn.KVCache(1, 1, 8, 4)
    c.append(np.ones((1, 1, 2, 4), np.float32), np.ones((1, 1, 2, 4), np.float32))
    return c


def test_decode_refuses_tensors_that_require_grad():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    c = _cache()
    q = torch.ones(1, 1, 1, 4, requires_grad=True)
    with pytest.raises(ValueError, match="'q' requires grad; decoding is inference"):
        attn.decode_attention(q, c)
    sinks = torch.zeros(1, requires_grad=True)
    with pytest.raises(ValueError, match="'sinks' requires grad"):
        attn.decode_attention(q.detach(), c, sinks=sinks)
    with torch.no_grad():
        out = attn.decode_attention(q, c, sinks=sinks)
    w = 2 * np.exp(2.0) / (2 * np.exp(2.0) + 1)  # two keys of score 4 / sqrt(4) and a sink at 0, values 1
    np.testing.assert_allclose(out.numpy(), np.full((1, 1, 1, 4), w), rtol=1e-6)


def test_decode_half_refusal_names_only_float32():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    for dt in (torch.float16, torch.bfloat16):
        with pytest.raises(ValueError, match="expected torch.float32 ") as e:
            attn.decode_attention(torch.ones(1, 1, 1, 4, dtype=dt), _cache())
        assert "float64" not in str(e.value)


@pytest.mark.parametrize("q_shape,kv_shape", [((0, 2, 3, 8), (0, 2, 5, 8)), ((1, 0, 3, 8), (1, 0, 5, 8)),
                                              ((1, 2, 0, 8), (1, 2, 5, 8)), ((1, 2, 3, 8), (1, 2, 0, 8)),
                                              ((2, 0, 8), (2, 0, 8))])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_torch_dropin_zero_size_follows_pytorch(q_shape, kv_shape, requires_grad):
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    import attn.torch as at

    g = torch.Generator().manual_seed(0)
    q = torch.randn(q_shape, generator=g, requires_grad=requires_grad)
    k = torch.randn(kv_shape, generator=g, requires_grad=requires_grad)
    v = torch.randn(kv_shape, generator=g, requires_grad=requires_grad)
    for causal in (False, True):
        got = at.scaled_dot_product_attention(q, k, v, is_causal=causal)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want)
        if requires_grad:
            got.sum().backward()
            assert q.grad is not None and q.grad.shape == q.shape and not q.grad.any()


def test_cache_size_refusal_prints_whole_bytes():
    # 64 sequences of 2^30 tokens, 64 heads of 128: 2^52 bytes (and the tables), refused before allocating.
    with pytest.raises(ValueError, match=r"would need 4503599627\d{6} bytes \(4\.0 PiB\)") as e:
        attn.KVCache(64, 64, 2**30, 128)
    assert ".000000" not in str(e.value)
