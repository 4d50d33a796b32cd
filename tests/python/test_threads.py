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
