"""chunk_size (chunked attention, Llama 4's local layers) from Python, against
an independent formulation: the rule as a boolean mask, query i at position
p = i + offset sees key j when p // C == j // C (and j <= p with is_causal),
handed to the float64 NumPy oracle (npref). Every entry point that takes
chunk_size: the dense call and its backward, varlen, decode over a KV cache,
MultiheadAttention forward and decode, and attn.torch (where torch is
installed). Lengths are not multiples of the chunk, and rows before the
first key (a negative offset) see nothing."""

import numpy as np
import pytest

import attn
import npref


def chunk_mask(L, S, C, offset=0, causal=False, window=None):
    """(L, S) bool, True where query i (position i + offset) sees key j."""
    pos = np.arange(L)[:, None] + offset
    j = np.arange(S)[None, :]
    see = pos // C == j // C
    return see & npref.band_mask(L, S, causal, window, offset)


def draw(rng, dtype, B=2, H=4, Hkv=2, L=13, S=13, E=8, Ev=6):
    q = rng.standard_normal((B, H, L, E)).astype(dtype)
    k = rng.standard_normal((B, Hkv, S, E)).astype(dtype)
    v = rng.standard_normal((B, Hkv, S, Ev)).astype(dtype)
    dout = rng.standard_normal((B, H, L, Ev)).astype(dtype)
    return q, k, v, dout


BACKENDS = [("reference", np.float64, 1e-12), ("reference", np.float32, 2e-5), ("fused", np.float32, 2e-5)]
CASES = {
    "chunk4": dict(C=4),
    "chunk4_causal": dict(C=4, causal=True),
    "chunk1_causal": dict(C=1, causal=True),  # each query sees itself only
    "chunk5_causal_L_ne_S": dict(C=5, causal=True, L=7, S=19, offset=12),
    "chunk3_offset_negative": dict(C=3, offset=-4),  # rows 0..3 sit before key 0
    "chunk6_window": dict(C=6, causal=True, window=(2, 0)),
    "chunk_longer_than_S": dict(C=64, causal=True),  # one chunk: plain causal attention
}


@pytest.mark.parametrize("backend,dtype,tol", BACKENDS, ids=[f"{b}-{np.dtype(d).name}" for b, d, _ in BACKENDS])
@pytest.mark.parametrize("case", sorted(CASES))
def test_dense_forward_backward_equal_the_mask(case, backend, dtype, tol):
    c = CASES[case]
    rng = np.random.default_rng(npref.seed_of("chunk", case))
    L, S = c.get("L", 13), c.get("S", 13)
    q, k, v, dout = draw(rng, dtype, L=L, S=S)
    kw = dict(enable_gqa=True, backend=backend, is_causal=c.get("causal", False), chunk_size=c["C"],
              window_size=c.get("window"), position_offset=c.get("offset"))
    out, lse = attn.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
    mask = chunk_mask(L, S, c["C"], c.get("offset", 0), c.get("causal", False), c.get("window"))
    want, want_lse, _ = npref.sdpa(q, k, v, mask, gqa=True)
    np.testing.assert_allclose(out, want, atol=tol, rtol=tol)
    seen = mask.any(-1)
    np.testing.assert_allclose(lse[..., seen], want_lse[..., seen], atol=tol, rtol=tol)
    assert np.all(out[..., ~seen, :] == 0)
    grads = attn.scaled_dot_product_attention_backward(dout, q, k, v, **kw)
    want_grads = npref.sdpa_backward(dout, q, k, v, mask, gqa=True)
    for name, g, w in zip(("dq", "dk", "dv"), grads, want_grads):
        np.testing.assert_allclose(g, w, atol=10 * tol, rtol=10 * tol, err_msg=name)


def test_zero_is_off_and_bad_values_are_named():
    q, k, v, dout = draw(np.random.default_rng(1), np.float32)
    np.testing.assert_array_equal(attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, chunk_size=0),
                                  attn.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    with pytest.raises(ValueError, match="attn::scaled_dot_product_attention: option 'chunk_size' is -2"):
        attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, chunk_size=-2)
    with pytest.raises(ValueError, match="attn.scaled_dot_product_attention: 'chunk_size' is 1.5"):
        attn.scaled_dot_product_attention(q, k, v, enable_gqa=True, chunk_size=1.5)


def test_resolve_backend_takes_chunk_size():
    q, k, v, dout = draw(np.random.default_rng(2), np.float32)
    assert attn.resolve_backend(q, k, v, enable_gqa=True, chunk_size=4) in ("reference", "fused")


@pytest.mark.parametrize("backend,dtype,tol", BACKENDS, ids=[f"{b}-{np.dtype(d).name}" for b, d, _ in BACKENDS])
def test_varlen_chunks_start_at_each_sequence(backend, dtype, tol):
    rng = np.random.default_rng(3)
    lens_q, lens_k = [5, 0, 11, 3], [9, 2, 11, 7]
    H, Hkv, E, Ev, C = 4, 2, 8, 6, 3
    q = rng.standard_normal((sum(lens_q), H, E)).astype(dtype)
    k = rng.standard_normal((sum(lens_k), Hkv, E)).astype(dtype)
    v = rng.standard_normal((sum(lens_k), Hkv, Ev)).astype(dtype)
    dout = rng.standard_normal((sum(lens_q), H, Ev)).astype(dtype)
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int64)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int64)
    kw = dict(is_causal=True, chunk_size=C, position_offset=2, backend=backend)
    out = attn.varlen_attention(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), **kw)
    dq, dk, dv = attn.varlen_attention_backward(dout, q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), **kw)
    dense = lambda x: np.swapaxes(x, 0, 1)[None]  # noqa: E731  (N, H, d) -> (1, H, N, d)
    for b in range(len(lens_q)):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if lens_q[b] == 0:
            continue
        mask = chunk_mask(lens_q[b], lens_k[b], C, 2, causal=True)
        w, _, _ = npref.sdpa(dense(q[sq]), dense(k[sk]), dense(v[sk]), mask, gqa=True)
        np.testing.assert_allclose(out[sq], w[0].swapaxes(0, 1), atol=tol, rtol=tol)
        g = npref.sdpa_backward(dense(dout[sq]), dense(q[sq]), dense(k[sk]), dense(v[sk]), mask, gqa=True)
        for name, got, want in zip(("dq", "dk", "dv"), (dq[sq], dk[sk], dv[sk]), g):
            np.testing.assert_allclose(got, want[0].swapaxes(0, 1), atol=10 * tol, rtol=10 * tol, err_msg=name)


@pytest.mark.parametrize("page_size", [0, 5])
@pytest.mark.parametrize("L", [1, 4, 9])
def test_decode_chunks_over_cache_positions(page_size, L):
    """Query i of sequence b sits at position length_b - L + i and sees the
    keys of its own chunk (up to itself with is_causal)."""
    rng = np.random.default_rng(npref.seed_of("chunk-decode", page_size, L))
    H, Hkv, E, C = 4, 2, 8, 6
    lengths = [23, 9, 12]
    cache = attn.KVCache(3, Hkv, 32, E, page_size=page_size)
    for b, n in enumerate(lengths):
        cache.append(rng.standard_normal((Hkv, n, E)).astype(np.float32),
                     rng.standard_normal((Hkv, n, E)).astype(np.float32), seq=b)
    q = rng.standard_normal((3, H, L, E)).astype(np.float32)
    for causal in (False, True):
        out, lse = attn.decode_attention(q, cache, is_causal=causal, chunk_size=C, return_lse=True)
        for b, n in enumerate(lengths):
            k, v = cache.read(b)
            mask = chunk_mask(L, n, C, n - L, causal)
            want, want_lse, _ = npref.sdpa(q[b], k, v, mask, gqa=True)
            np.testing.assert_allclose(out[b], want, atol=2e-5, rtol=0, err_msg=f"b={b} causal={causal}")
            np.testing.assert_allclose(lse[b], want_lse, atol=2e-5, rtol=0)


def test_multihead_forward_and_decode():
    """forward(chunk_size=C) equals forward with the rule as PyTorch's bool
    attn_mask (True = not allowed); decode step by step equals the forward
    over the prefix."""
    rng = np.random.default_rng(6)
    D, H, N, C = 12, 3, 11, 4
    layer = attn.MultiheadAttention(D, H, batch_first=True, seed=2)
    x = rng.standard_normal((2, N, D)).astype(np.float32)
    out, w = layer(x, x, x, is_causal=True, chunk_size=C, average_attn_weights=False)
    want, want_w = layer(x, x, x, attn_mask=~chunk_mask(N, N, C, causal=True), average_attn_weights=False)
    np.testing.assert_allclose(out, want, atol=1e-5, rtol=0)
    np.testing.assert_allclose(w, want_w, atol=1e-6, rtol=0)
    cache = attn.KVCache(2, H, 16, D // H)
    n0 = 0
    for n in (3, 1, 5, 2):
        got = layer.decode(x[:, n0:n0 + n], cache, is_causal=True, chunk_size=C)
        n0 += n
        np.testing.assert_allclose(got, out[:, n0 - n:n0], atol=1e-5, rtol=0)


def test_torch_gradients_equal_the_mask():
    torch = pytest.importorskip("torch")
    import attn.torch as at

    rng = np.random.default_rng(7)
    q, k, v, dout = draw(rng, np.float64)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    out = at.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=True, chunk_size=5)
    out.backward(torch.tensor(dout))
    mask = chunk_mask(13, 13, 5, causal=True)
    want, _, _ = npref.sdpa(q, k, v, mask, gqa=True)
    np.testing.assert_allclose(out.detach().numpy(), want, atol=1e-12)
    for name, g, w in zip(("dq", "dk", "dv"), (tq.grad, tk.grad, tv.grad),
                          npref.sdpa_backward(dout, q, k, v, mask, gqa=True)):
        np.testing.assert_allclose(g.numpy(), w, atol=1e-11, err_msg=name)
    # varlen through its autograd Function: one sequence is the dense call
    pq, pk, pv = (torch.tensor(x[0].transpose(1, 0, 2).copy(), requires_grad=True) for x in (q, k, v))
    cu = torch.tensor([0, 13])
    y = at.varlen_attention(pq, pk, pv, cu, cu, 13, 13, is_causal=True, chunk_size=5)
    np.testing.assert_allclose(y.detach().numpy(), want[0].transpose(1, 0, 2), atol=1e-12)
