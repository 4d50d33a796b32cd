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
    out, lse = attn.decode_attention(q, cache, is_causal=True, return_lse=True)
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
    out = attn.decode_attention(q, cache, is_causal=True)
    np.testing.assert_allclose(out, oracle(q, cache)[0], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="appears earlier"):
        cache.set_block_table(1, [5, 5], 4)


def test_truncate_drops_a_draft_and_copies_a_shared_page():
    """Speculative decoding's rollback: 4 draft tokens appended, 3 rejected;
    the cache then equals one that never saw them, and a sequence that keeps
    part of a shared page writes into a copy of it."""
    rng = np.random.default_rng(12)
    cache = attn.KVCache(2, 2, 32, 8, page_size=4, dtype="bfloat16")
    k = rng.standard_normal((2, 2, 14, 8)).astype(np.float32)
    v = rng.standard_normal((2, 2, 14, 8)).astype(np.float32)
    cache.append(k[:, :, :10], v[:, :, :10])
    cache.append(k[:, :, 10:14], v[:, :, 10:14])  # the draft
    assert (cache.num_pages, cache.free_pages) == (16, 8)  # 2 · 32 / 4 pages, 4 per sequence in use
    assert cache.storage_bytes == 2 * 16 * 2 * 4 * 8 * 2  # K and V: pages · Hkv · page · E · 2 bytes
    cache.truncate(0, 11)
    cache.truncate(1, 11)
    assert cache.lengths == (11, 11)
    assert cache.free_pages == 10
    plain = attn.KVCache(2, 2, 32, 8, page_size=4, dtype="bfloat16")
    plain.append(k[:, :, :11], v[:, :, :11])
    q = rng.standard_normal((2, 4, 1, 8)).astype(np.float32)
    np.testing.assert_array_equal(attn.decode_attention(q, cache), attn.decode_attention(q, plain))
    # Sequence 1 takes sequence 0's two full pages, keeps 6 of their 8 tokens.
    cache.set_block_table(1, cache.block_table(0)[:2], 8)
    assert cache.free_pages == 13  # sequence 1 now only shares sequence 0's pages
    cache.truncate(1, 6)
    assert cache.free_pages == 12  # the copy of the shared page
    assert cache.block_table(1)[0] == cache.block_table(0)[0]
    assert cache.block_table(1)[1] != cache.block_table(0)[1]
    before = cache.read(0)
    cache.append(k[1, :, 6:8], v[1, :, 6:8], seq=1)
    for got, want in zip(cache.read(0), before):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="'length'"):
        cache.truncate(0, 12)


def test_is_causal_defaults_to_false_as_in_sdpa():
    """Without is_causal every new query sees every stored key; one new token
    sees the same keys either way."""
    rng = np.random.default_rng(8)
    cache = attn.KVCache(2, 2, 32, 8, page_size=4)
    fill(cache, [13, 6], rng)
    q = rng.standard_normal((2, 4, 3, 8)).astype(np.float32)
    np.testing.assert_allclose(attn.decode_attention(q, cache), oracle(q, cache, causal=False)[0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(attn.decode_attention(q, cache, is_causal=True), oracle(q, cache)[0], atol=1e-5,
                               rtol=0)
    one = q[:, :, :1]
    np.testing.assert_array_equal(attn.decode_attention(one, cache), attn.decode_attention(one, cache, is_causal=True))


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


def variant_oracle(q, cache, window=(-1, -1), softcap=None, slopes=None, sinks=None, attn_mask=None):
    """float64, written out: scores, soft-cap, ALiBi over positions, the
    window and causal rule as a mask, the sinks as an extra logit with no
    value. Query i of sequence b sits at position length_b - L + i."""
    B, H, L, E = q.shape
    out = np.zeros((B, H, L, cache.value_dim))
    lse = np.zeros((B, H, L))
    for b, S in enumerate(cache.lengths):
        k, v = (np.zeros((cache.kv_heads, 0, d)) for d in (E, cache.value_dim)) if S == 0 else cache.read(b)
        g = H // cache.kv_heads
        k = np.repeat(k.astype(np.float64), g, axis=0)
        v = np.repeat(v.astype(np.float64), g, axis=0)
        s = q[b].astype(np.float64) @ np.swapaxes(k, -1, -2) / np.sqrt(E)  # (H, L, S)
        if softcap:
            s = softcap * np.tanh(s / softcap)
        pos = S - L + np.arange(L)[:, None]
        j = np.arange(S)[None, :]
        if slopes is not None:
            s = s - np.asarray(slopes, np.float64)[:, None, None] * np.abs(pos - j)[None]
        seen = np.broadcast_to(j <= pos, (H, L, S)).copy()
        if window[0] >= 0:
            seen &= (j >= pos - window[0])[None]
        if attn_mask is not None:
            m = np.broadcast_to(np.asarray(attn_mask)[b if attn_mask.shape[0] > 1 else 0], (H, L, cache.capacity))
            if m.dtype == np.bool_:
                seen &= m[..., :S]
            else:
                s = s + m[..., :S]
        s = np.where(seen, s, -np.inf)
        sink = np.full((H, L, 1), -np.inf) if sinks is None else np.broadcast_to(
            np.asarray(sinks, np.float64)[:, None, None], (H, L, 1))
        full = np.concatenate([s, sink], axis=-1)
        m = full.max(axis=-1, keepdims=True)
        m = np.where(np.isneginf(m), 0.0, m)
        e = np.exp(full - m)
        tot = e.sum(axis=-1, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            out[b] = np.where(tot > 0, (e[..., :S] / tot) @ v, 0.0)
            lse[b] = np.where(tot[..., 0] > 0, np.log(tot[..., 0]) + m[..., 0], -np.inf)
    return out, lse


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("page_size", [0, 16])
@pytest.mark.parametrize("L", [1, 4, 40])
def test_decode_variants_match_a_written_out_oracle(dtype, page_size, L):
    rng = np.random.default_rng(hash((dtype, page_size, L, "variants")) % 2**32)
    H, Hkv, E = 8, 2, 16
    lengths = [300, 0, 37]
    cache = attn.KVCache(3, Hkv, 320, E, dtype=dtype, page_size=page_size)
    fill(cache, lengths, rng, pieces=(1, 5, 33))
    q = rng.standard_normal((3, H, L, E)).astype(np.float32)
    slopes = 2.0 ** (-8.0 * np.arange(1, H + 1) / H)  # the standard ALiBi slopes
    sinks = rng.standard_normal(H).astype(np.float32)
    tol = npref.tol(np.float32, 320 + E, factor=40)
    for kw in (dict(window_size=(50, 0)), dict(softcap=2.0), dict(alibi_slopes=slopes), dict(sinks=sinks),
               dict(window_size=(20, 0), softcap=1.5, alibi_slopes=slopes, sinks=sinks)):
        out, lse = attn.decode_attention(q, cache, is_causal=True, return_lse=True, **kw)
        want, want_lse = variant_oracle(q, cache, kw.get("window_size", (-1, -1)), kw.get("softcap"),
                                        kw.get("alibi_slopes"), kw.get("sinks"))
        np.testing.assert_allclose(out, want, atol=tol, rtol=0, err_msg=str(kw))
        np.testing.assert_allclose(lse, want_lse, atol=npref.tol(np.float32, 320 + E, 8.0, factor=40), rtol=0,
                                   err_msg=str(kw))


def test_gpt_oss_style_decode_loop_equals_the_dense_call():
    """A sliding window with sinks, one token at a time, against
    attn.scaled_dot_product_attention over the whole prefix."""
    rng = np.random.default_rng(5)
    B, H, Hkv, E, steps, W = 2, 8, 2, 16, 40, 7
    ks = rng.standard_normal((B, Hkv, steps, E)).astype(np.float32)
    vs = rng.standard_normal((B, Hkv, steps, E)).astype(np.float32)
    qs = rng.standard_normal((B, H, steps, E)).astype(np.float32)
    sinks = rng.standard_normal(H).astype(np.float32)
    cache = attn.KVCache(batch=B, kv_heads=Hkv, capacity=64, head_dim=E, page_size=16)
    outs = []
    for t in range(steps):
        cache.append(ks[:, :, t:t + 1], vs[:, :, t:t + 1])
        outs.append(attn.decode_attention(qs[:, :, t:t + 1], cache, window_size=(W, 0), sinks=sinks))
    got = np.concatenate(outs, axis=2)
    want = attn.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True, window_size=(W, 0),
                                             sinks=sinks, backend="reference")
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_variant_errors_name_the_argument():
    cache = attn.KVCache(1, 2, 8, 4)
    q = np.zeros((1, 4, 1, 4), np.float32)
    with pytest.raises(ValueError, match=r"attn::decode_attention: option 'window\.left' is -2"):
        attn.decode_attention(q, cache, window_size=(-2, 0))
    with pytest.raises(ValueError, match="attn::decode_attention: option 'softcap' is -1"):
        attn.decode_attention(q, cache, softcap=-1.0)
    with pytest.raises(ValueError, match=r"attn::decode_attention: argument 'sinks' has shape \(3,\), expected \(H,\) = \(4,\)"):
        attn.decode_attention(q, cache, sinks=np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="attn::decode_attention: argument 'alibi_slopes' contains NaN"):
        attn.decode_attention(q, cache, alibi_slopes=np.array([0, np.nan, 0, 0], np.float32))


@pytest.mark.parametrize("L", [1, 3, 40])
def test_decode_attn_mask_bool_and_float(L):
    """A tree of draft tokens (speculative decoding): the L new tokens see the
    cache and only their own ancestors among themselves, as a bool mask; and
    a float bias with -inf entries, per head."""
    rng = np.random.default_rng(L)
    H, Hkv, E, C = 8, 2, 16, 200
    lengths = [150, 60]
    cache = attn.KVCache(2, Hkv, C, E, page_size=16)
    fill(cache, lengths, rng, pieces=(3, 17))
    q = rng.standard_normal((2, H, L, E)).astype(np.float32)
    tree = np.ones((2, 1, L, C), bool)
    for b, n in enumerate(lengths):
        for i in range(L):
            for t in range(L):
                tree[b, 0, i, n - L + t] = t <= i and (t % 2 == 0 or t == i)  # odd drafts are siblings
    bias = rng.standard_normal((1, H, 1, C)).astype(np.float32)
    bias[0, :, 0, ::9] = -np.inf
    tol = npref.tol(np.float32, C + E, factor=40)
    for m in (tree, bias):
        out, lse = attn.decode_attention(q, cache, is_causal=True, return_lse=True, attn_mask=m,
                                         sinks=np.zeros(H, np.float32))
        want, want_lse = variant_oracle(q, cache, sinks=np.zeros(H), attn_mask=m)
        np.testing.assert_allclose(out, want, atol=tol, rtol=0)
        np.testing.assert_allclose(lse, want_lse, atol=npref.tol(np.float32, C + E, 8.0, factor=40), rtol=0)
    with pytest.raises(ValueError, match="'mask'"):
        attn.decode_attention(q, cache, attn_mask=np.ones((2, 1, L, C - 1), bool))
    with pytest.raises(ValueError, match="'attn_mask'"):
        attn.decode_attention(q, cache, attn_mask=np.ones((2, L, C), bool))


def test_sizes_that_overflow_are_refused_before_allocating():
    # A page size of 2^63 - 1 once gave a pool of 0 pages and a crash on append.
    with pytest.raises(ValueError, match=r"attn::KVCache.*page_size 9223372036854775807.*bytes"):
        attn.KVCache(1, 1, 9, 4, page_size=2**63 - 1)
    with pytest.raises(ValueError, match=r"attn.KVCache: 'page_size' is 18446744073709551616.*int64"):
        attn.KVCache(1, 1, 9, 4, page_size=2**64)
    with pytest.raises(ValueError, match=r"of memory of this machine"):
        attn.KVCache(1, 8, 2**40, 128)
    # A block table of capacity / page_size = 2^62 entries once wrapped; now the
    # table is as wide as the pool (4 pages), which bounds each sequence.
    cache = attn.KVCache(4, 1, 2**62, 4, page_size=1, num_pages=4)
    kv = np.arange(16, dtype=np.float32).reshape(1, 4, 4)
    cache.append(kv, kv, seq=0)
    k, v = cache.read(0)
    assert np.array_equal(k, kv) and np.array_equal(v, kv)
    with pytest.raises(ValueError, match="more pages than the pool"):
        cache.append(kv[:, :1], kv[:, :1], seq=0)
    with pytest.raises(ValueError, match="exhausted"):
        cache.append(kv[:, :1], kv[:, :1], seq=1)
    assert cache.lengths == (4, 0, 0, 0) and cache.free_pages == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("page_size", [0, 16])
def test_step_appends_then_attends_bitwise(dtype, page_size):
    """decode_attention(q, cache, k=k, v=v), one call for a decoding step,
    gives the bits of cache.append(k, v) followed by decode_attention(q,
    cache), and stores the same tokens; k and v in a projection's
    (B, n, Hkv, E) layout seen as (B, Hkv, n, E) (strided), steps of 1 and of
    3 causal rows."""
    rng = np.random.default_rng(30)
    B, H, Hkv, E, Ev = 2, 6, 2, 24, 20
    one, two = (attn.KVCache(B, Hkv, 80, E, value_dim=Ev, dtype=dtype, page_size=page_size) for _ in range(2))
    k0 = rng.standard_normal((B, Hkv, 70, E)).astype(np.float32)
    v0 = rng.standard_normal((B, Hkv, 70, Ev)).astype(np.float32)
    one.append(k0, v0)
    two.append(k0, v0)
    for n in (1, 3, 1):
        q = rng.standard_normal((B, H, n, E)).astype(np.float32)
        k = rng.standard_normal((B, n, Hkv, E)).astype(np.float32).transpose(0, 2, 1, 3)
        v = rng.standard_normal((B, n, Hkv, Ev)).astype(np.float32).transpose(0, 2, 1, 3)
        got, got_lse = attn.decode_attention(q, one, is_causal=True, return_lse=True, k=k, v=v)
        two.append(k, v)
        want, want_lse = attn.decode_attention(q, two, is_causal=True, return_lse=True)
        assert np.array_equal(got, want) and np.array_equal(got_lse, want_lse)
    assert one.lengths == two.lengths == (75, 75)
    for b in range(B):
        for x, y in zip(one.read(b), two.read(b)):
            assert np.array_equal(x, y)
    # and against the oracle on the stored values
    out, lse = oracle(q.astype(np.float64), one)
    np.testing.assert_allclose(got, out, atol=2e-5, rtol=0)


def test_step_errors_name_the_argument_and_leave_the_cache():
    cache = attn.KVCache(1, 2, 4, 4)
    q = np.zeros((1, 4, 1, 4), np.float32)
    k = np.ones((1, 2, 1, 4), np.float32)
    with pytest.raises(ValueError, match="argument 'k' has shape"):
        attn.decode_attention(q, cache, k=np.ones((1, 2, 1, 5), np.float32), v=k)
    with pytest.raises(ValueError, match="argument 'v' has shape"):
        attn.decode_attention(q, cache, k=k, v=np.ones((1, 2, 2, 4), np.float32))
    with pytest.raises(ValueError, match="'v' is required"):
        attn.decode_attention(q, cache, k=k)
    with pytest.raises(ValueError, match="'k' has dtype float64"):
        attn.decode_attention(q, cache, k=k.astype(np.float64), v=k)
    with pytest.raises(ValueError, match="'q'"):
        attn.decode_attention(np.zeros((1, 3, 1, 4), np.float32), cache, k=k, v=k)
    with pytest.raises(ValueError, match="'cache' cannot take the 5 new tokens"):
        attn.decode_attention(q, cache, k=np.ones((1, 2, 5, 4), np.float32), v=np.ones((1, 2, 5, 4), np.float32))
    assert cache.lengths == (0,)
    out = attn.decode_attention(q, cache, k=k, v=2 * k)
    assert cache.lengths == (1,) and np.array_equal(out, np.full((1, 4, 1, 4), 2.0, np.float32))
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="'k' requires grad"):
        attn.decode_attention(q, cache, k=torch.ones(1, 2, 1, 4, requires_grad=True), v=torch.ones(1, 2, 1, 4))
    assert cache.lengths == (1,)
