# The cost of chunked attention against full causal attention at S = 16384,
# chunk 2048 (the fused forward, float32, the build-py package): the time
# ratio against the visible fraction (C + 1) / (S + 1). Run with the
# package installed: build-py/venv/bin/python bench/chunk_cost.py
import time, numpy as np, attn
S, E, H, C = 16384, 64, 1, 2048
rng = np.random.default_rng(0)
q = rng.standard_normal((1, H, S, E), np.float32); k = rng.standard_normal((1, H, S, E), np.float32); v = rng.standard_normal((1, H, S, E), np.float32)
def t(**kw):
    attn.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
    best = []
    for _ in range(3):
        t0 = time.perf_counter(); attn.scaled_dot_product_attention(q, k, v, is_causal=True, **kw); best.append(time.perf_counter() - t0)
    return min(best), float(np.median(best))
full = t(); ch = t(chunk_size=C)
vis = (C + 1) / (S + 1)
pairs_full, pairs_chunk = S * (S + 1) / 2, (S // C) * C * (C + 1) / 2  # visible scores (S a multiple of C)
gf = lambda pairs, t: 4.0 * E * H * pairs / t / 1e9  # noqa: E731  (QK^T and PV: 2 flops each per pair and feature)
print(f"S={S} E={E} H={H} chunk={C}: causal {full[1]*1e3:.1f} ms (min {full[0]*1e3:.1f}), causal+chunk {ch[1]*1e3:.1f} ms (min {ch[0]*1e3:.1f})")
print(f"time ratio {ch[1]/full[1]:.3f}, visible fraction {vis:.3f}, ratio / visible {ch[1]/full[1]/vis:.2f} (target <= 1.3)")
print(f"GFLOP/s on the visible scores: causal {gf(pairs_full, full[1]):.1f}, causal+chunk {gf(pairs_chunk, ch[1]):.1f}")
