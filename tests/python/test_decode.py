"""attn.KVCache and attn.decode_attention against the NumPy oracle on the
values the cache holds: contiguous and paged caches, float32/float16/bfloat16
storage, grouped heads, sequences of different lengths (and empty ones),
shared prefix pages, the README's decode loop, torch tensors, errors."""

import numpy as np
import pytest

import attn
import npref


def bottom_right_mask(L, S):
    return np.arange(S)[None, :] <= (S - L + np.arange(L))[:, None]


def oracle(q, cache, causal=True):
    """Per sequence: npref on the stored (rounded) keys and values."""
    B, H, L, _ = q.shape
    out = np.zeros((B, H, L, cache.value_dim))
    lse = np.full((B, H, L), -np.inf)
    for b, S in enumerate(cache.lengths):
        if S == 0:
            continue
        k, v = cache.read(b)
        mask = bottom_right_mask(L, S) if causal else None
        out[b], lse[b], _ = npref.sdpa(q[b], k, v, mask, False, None, True)
    return out, lse


def fill(cache, lengths, rng, pieces=(1, 4, 9)):
    """Appends random tokens to each sequence in pieces (crossing pages)."""
    for b, n in enumerate(lengths):
        t = 0
        while t < n:
            m = min(int(rng.choice(pieces)), n - t)
            k = rng.standard_normal((cache.kv_heads, m, cache.head_dim)).astype(np.float32)
            v = rng.standard_normal((cache.kv_heads, m, cache.value_dim)).astype(np.float32)
            cache.append(k, v, seq=b)
            t += m


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("page_size", [0, 7, 16])
@pytest.mark.parametrize("H,Hkv,L", [(4, 4, 1), (8, 2, 3), (8, 1, 5), (6, 3, 17)])
def test_decode_matches_the_oracle_on_the_stored_values(dtype, page_size, H, Hkv, L):
    rng = np.random.default_rng(hash((dtype, page_size, H, L)) % 2**32)
    lengths = [40, 0, 23]
    cache = attn.KVCache(3, Hkv, 64, 16, value_dim=12, dtype=dtype, page_size=page_size)
    fill(cache, lengths, rng)
    assert cache.lengths == tuple(lengths)
    q = rng.standard_normal((3, H, L, 16)).astype(np.float32)
    out, lse = attn.decode_attention(q, cache, return_lse=True)
    want, want_lse = oracle(q, cache)
    tol = npref.tol(np.float32, 64 + 16, factor=40)
    np.testing.assert_allclose(out, want, atol=tol, rtol=0)
    assert np.all(out[1] == 0) and np.all(np.isneginf(lse[1]))  # the empty sequence
    np.testing.assert_allclose(lse, want_lse, atol=npref.tol(np.float32, 64 + 16, 8.0, factor=40), rtol=0)


def test_half_storage_rounds_to_nearest_even():
    x = np.array([1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 1e-7, 65504.0], np.float32)  # ties, a subnormal, max
    cache = attn.KVCache(1, 1, 1, 4, dtype="float16")
    cache.append(x.reshape(1, 1, 4), x.reshape(1, 1, 4), seq=0)
    k, _ = cache.read(0)
    np.testing.assert_array_equal(k.ravel(), x.astype(np.float16).astype(np.float32))


def test_shared_prefix_pages():
    rng = np.random.default_rng(3)
    cache = attn.KVCache(2, 2, 32, 8, page_size=4)
    k = rng.standard_normal((2, 14, 8)).astype(np.float32)
    v = rng.standard_normal((2, 14, 8)).astype(np.float32)
    cache.append(k[:, :10], v[:, :10], seq=0)
    table = cache.block_table(0)
    cache.set_block_table(1, table[:2], 8)  # the two full pages
    cache.append(k[:, 8:14], v[:, 8:14], seq=1)
    assert cache.block_table(1)[:2] == table[:2]
    k1, v1 = cache.read(1)
    np.testing.assert_array_equal(k1, k[:, :14])
    q = rng.standard_normal((2, 4, 2, 8)).astype(np.float32)
    out = attn.decode_attention(q, cache)
    np.testing.assert_allclose(out, oracle(q, cache)[0], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="appears earlier"):
        cache.set_block_table(1, [5, 5], 4)


def test_readme_decode_loop_equals_attention_over_the_whole_prefix():
    rng = np.random.default_rng(4)
    B, H, Hkv, E, steps = 2, 8, 2, 16, 6
    ks = rng.standard_normal((B, Hkv, steps, E)).astype(np.float32)
    vs = rng.standard_normal((B, Hkv, steps, E)).astype(np.float32)
    qs = rng.standard_normal((B, H, steps, E)).astype(np.float32)
    cache = attn.KVCache(batch=B, kv_heads=Hkv, capacity=128, head_dim=E, dtype="float32", page_size=16)
    outs = []
    for t in range(steps):  # one new token per sequence per step
        cache.append(ks[:, :, t:t + 1], vs[:, :, t:t + 1])
        outs.append(attn.decode_attention(qs[:, :, t:t + 1], cache))
    got = np.concatenate(outs, axis=2)
    want = attn.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True, backend="reference")
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_torch_tensors_in_and_out():
    torch = pytest.importorskip("torch")
    cache = attn.KVCache(1, 2, 8, 4)
    cache.append(torch.ones(1, 2, 3, 4), torch.arange(24, dtype=torch.float32).reshape(1, 2, 3, 4))
    out = attn.decode_attention(torch.zeros(1, 4, 1, 4), cache)
    assert isinstance(out, torch.Tensor) and out.shape == (1, 4, 1, 4)
    # equal scores: the mean of the three values of each kv head
    assert torch.allclose(out[0, 0, 0], torch.tensor([4.0, 5.0, 6.0, 7.0]))


def test_errors_name_the_argument():
    cache = attn.KVCache(1, 2, 8, 4)
    with pytest.raises(ValueError, match="expected float32"):
        cache.append(np.zeros((1, 2, 1, 4)), np.zeros((1, 2, 1, 4)))
    with pytest.raises(ValueError, match="'q'"):
        attn.decode_attention(np.zeros((1, 3, 1, 4), np.float32), cache)
    with pytest.raises(ValueError, match="capacity"):
        cache.append(np.zeros((1, 2, 9, 4), np.float32), np.zeros((1, 2, 9, 4), np.float32))
    with pytest.raises(ValueError, match="fp8"):
        attn.KVCache(1, 1, 1, 1, dtype="fp8")
