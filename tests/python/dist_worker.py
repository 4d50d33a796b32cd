"""Run under mpirun by test_dist.py: every rank builds the same full inputs,
computes the single-process attn result (the oracle), runs attn.dist on its
shards with the mpi4py communicator, and compares its rows of the outputs and
gradients. Exits 1 on every rank when any rank saw a mismatch."""

import sys

import numpy as np
from mpi4py import MPI

import attn
import attn.dist as dist

comm = MPI.COMM_WORLD
P, r = comm.Get_size(), comm.Get_rank()


def close(name, got, want, case):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    tol = 2e-4 * max(1.0, float(np.nanmax(np.abs(want[np.isfinite(want)]))) if np.isfinite(want).any() else 1.0)
    same_inf = np.array_equal(np.isinf(got), np.isinf(want)) and np.array_equal(np.isnan(got), np.isnan(want))
    fin = np.isfinite(want)
    err = float(np.abs(got[fin] - want[fin]).max()) if fin.any() else 0.0
    if not same_inf or err > tol:
        print(f"[rank {r}] {case}: {name} differs by {err:.3g} (tolerance {tol:.3g}, inf/nan pattern "
              f"{'same' if same_inf else 'differs'})", flush=True)
        return False
    return True


def run(strategy, B=1, H=4, Hkv=2, L=37, S=37, E=16, Ev=12, causal=False, window=None, alibi=False,
        sinks=False, softcap=None, position_offset=None, key_lengths=None, layout="zigzag", saved=True, chunk=0):
    case = (f"{strategy} P{P} B{B} H{H} Hkv{Hkv} L{L} S{S} causal={causal} window={window} alibi={alibi} "
            f"sinks={sinks} softcap={softcap} offset={position_offset} kl={key_lengths} chunk={chunk} {layout}")
    rng = np.random.default_rng(7)
    q = rng.standard_normal((B, H, L, E), dtype=np.float32)
    k = rng.standard_normal((B, Hkv, S, E), dtype=np.float32)
    v = rng.standard_normal((B, Hkv, S, Ev), dtype=np.float32)
    dy = rng.standard_normal((B, H, L, Ev), dtype=np.float32)
    slopes = (2.0 ** (-8.0 * np.arange(1, H + 1) / H)).astype(np.float32) if alibi else None
    sk = np.linspace(-1.0, 1.5, H).astype(np.float32) if sinks else None
    var = dict(window_size=window, alibi_slopes=slopes, sinks=sk, softcap=softcap, position_offset=position_offset,
               chunk_size=chunk)
    # The oracle: key padding as a boolean mask, causal as the window's right side 0.
    ref_var = dict(var)
    mask = None
    if key_lengths is not None:
        mask = (np.arange(S)[None, :] < np.asarray(key_lengths)[:, None])[:, None, None, :]
    if causal:
        left = -1 if window is None else window[0]
        ref_var["window_size"] = (left, 0)
    out, lse = attn.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True, backend="fused",
                                                 return_lse=True, **ref_var)
    grads = attn.scaled_dot_product_attention_backward(dy, q, k, v, mask, enable_gqa=True, backend="fused",
                                                       **ref_var)
    sh = lambda x: dist.shard(x, P, r, layout)  # noqa: E731
    fwd = dist.ring_attention if strategy == "ring" else dist.ulysses_attention
    bwd = dist.ring_attention_backward if strategy == "ring" else dist.ulysses_attention_backward
    kw = dict(is_causal=causal, layout=layout, key_lengths=key_lengths, **var)
    o, l = fwd(sh(q), sh(k), sh(v), comm, return_lse=True, **kw)
    g = bwd(sh(dy), sh(q), sh(k), sh(v), comm, output=o if saved else None, lse=l if saved else None, **kw)
    ok = close("out", o, sh(out), case) & close("lse", l, sh(lse[..., None])[..., 0], case)
    for name, got, want in zip(("dq", "dk", "dv"), g[:3], grads[:3]):
        ok &= close(name, got, sh(want), case)
    if sinks:
        ok &= len(g) == 4 and close("dsinks", g[3], grads[-1], case)
    return ok


ok = True
ok &= run("ring")
ok &= run("ring", causal=True, L=53, S=53, window=(5, -1), alibi=True, sinks=True, softcap=3.0)
ok &= run("ring", causal=True, L=19, S=45, position_offset=10, B=2, key_lengths=[45, 20], layout="contiguous")
ok &= run("ring", window=(4, 6), L=29, S=29, sinks=True, saved=False)
ok &= run("ring", causal=True, L=41, S=41, chunk=6, alibi=True)  # chunk boundaries inside the shards
ok &= run("ring", L=23, S=37, chunk=9, position_offset=5, layout="contiguous")
if 6 % P == 0:
    ok &= run("ulysses", H=6, Hkv=6, causal=True, L=41, S=41, sinks=True, window=(9, -1), alibi=True)
    ok &= run("ulysses", H=12, Hkv=6, L=23, S=31, position_offset=4, window=(3, 3))
    ok &= run("ulysses", H=6, Hkv=6, causal=True, L=41, S=41, chunk=7)
# Bad arguments raise ValueError on every rank (none waits).
try:
    dist.ring_attention(np.zeros((1, 2, 3, 4)), np.zeros((1, 2, 3, 4)), np.zeros((1, 2, 3, 4)), comm)
    print(f"[rank {r}] float64 input was not refused", flush=True)
    ok = False
except ValueError as e:
    ok &= "float32" in str(e)
bad = comm.allreduce(0 if ok else 1, op=MPI.SUM)
if r == 0:
    print(f"attn.dist python: {'all passed' if bad == 0 else 'FAILED'} on {P} rank(s)", flush=True)
sys.exit(0 if bad == 0 else 1)
