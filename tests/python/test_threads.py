"""Several Python threads calling attn at once get exactly the results of
serial calls (the extension releases the GIL while it computes, so the calls
really overlap)."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import attn


def problems(dtype):
    rng = np.random.default_rng(11)
    out = []
    for i in range(12):
        B, H, L, S, E = 2, 1 + i % 3, 16 + i, 24 + 2 * i, 8 + i % 5
        q = rng.standard_normal((B, H, L, E)).astype(dtype)
        k = rng.standard_normal((B, H, S, E)).astype(dtype)
        v = rng.standard_normal((B, H, S, E)).astype(dtype)
        dout = rng.standard_normal((B, H, L, E)).astype(dtype)
        out.append((q, k, v, dout, i % 2 == 1))
    return out


def run(p, backend):
    q, k, v, dout, causal = p
    y = attn.scaled_dot_product_attention(q, k, v, is_causal=causal, backend=backend)
    g = attn.scaled_dot_product_attention_backward(dout, q, k, v, is_causal=causal, backend=backend)
    return (y,) + tuple(g)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_threads_match_serial(dtype, backend):
    ps = problems(dtype)
    serial = [run(p, backend) for p in ps]
    with ThreadPoolExecutor(max_workers=4) as pool:
        concurrent = list(pool.map(lambda p: run(p, backend), ps * 3))
    for i, got in enumerate(concurrent):
        for a, b in zip(got, serial[i % len(ps)]):
            np.testing.assert_array_equal(a, b, err_msg=f"problem {i % len(ps)}")


# One attn.KVCache shared by threads (the contract of docs/decode.md): each
# writer thread owns a sequence of a paged pool and appends, truncates and
# resets it while other threads decode the whole batch. Every key and value
# of sequence b is b + 1, so a decode that reads only b's own tokens gives
# b + 1 (0 when b is empty); a page taken twice or read mid-write shows.
def _writer(cache, b, rounds):
    Hkv, E = cache.kv_heads, cache.head_dim
    for r in range(rounds):
        for n in (1, 3, 2, 5, 1):
            if cache.lengths[b] + n > cache.capacity:
                break
            kv = np.full((Hkv, n, E), b + 1, np.float32)
            cache.append(kv, kv, seq=b)
        if r % 3 == 1:
            cache.truncate(b, cache.lengths[b] // 2)
        elif r % 3 == 2:
            cache.reset(b)


def _decoder(cache, rounds):
    B, H, E = cache.batch, 2 * cache.kv_heads, cache.head_dim
    q = np.linspace(-1, 1, B * H * E, dtype=np.float32).reshape(B, H, 1, E)
    worst = 0.0
    for _ in range(rounds):
        out, lse = attn.decode_attention(q, cache, return_lse=True, num_threads=1)
        want = np.where(np.isinf(lse), 0.0, np.arange(1, B + 1)[:, None, None])[..., None]
        worst = max(worst, float(np.nan_to_num(np.abs(out - want), nan=np.inf).max()))
    return worst


@pytest.mark.parametrize("num_pages", [0, 10])
def test_kv_cache_shared_by_writer_and_decoder_threads(num_pages):
    B, page = 4, 4
    cache = attn.KVCache(B, 2, 24, 8, page_size=page, num_pages=num_pages)
    errors = []

    def write(b):
        try:
            _writer(cache, b, 150)
        except ValueError as e:  # only a short pool may refuse an append
            if num_pages == 0 or "exhausted" not in str(e):
                errors.append(e)

    with ThreadPoolExecutor(max_workers=B + 2) as pool:
        decodes = [pool.submit(_decoder, cache, 150) for _ in range(2)]
        writes = [pool.submit(write, b) for b in range(B)]
        for w in writes:
            w.result()
        worst = max(d.result() for d in decodes)
    assert not errors, errors
    assert worst <= 1e-5
    used = [p for b in range(B) for p in cache.block_table(b)]
    assert len(used) == len(set(used)), "a page is in two tables"
    assert cache.free_pages == cache.num_pages - len(used)
    for b in range(B):
        k, v = cache.read(b)
        assert k.shape[1] == cache.lengths[b] and np.all(k == b + 1) and np.all(v == b + 1)
