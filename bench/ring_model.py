#!/usr/bin/env python3
"""Time-per-layer model of context-parallel attention (docs/distributed.md).

    python3 bench/ring_model.py [build/ring_bench.jsonl]

Parameters: R, the attention rate of one rank (flop/s of the fused kernel,
forward; the backward runs at the same rate on 2.5x the flops), the link
bandwidth beta (bytes/s, per rank, each direction) and latency alpha (s).

Ring, P ranks, n = N / P rows per rank, float32:
  compute per step   Tc  = f_step / R, f_step = 4 B H n^2 E (causal zig-zag:
                     half; every step has the same work, see the doc)
  bytes per step     m   = 4 B Hkv n (E + Ev)            (K and V)
  transfer per step  Tm  = alpha + m / beta
  forward            P Tc + (P - 1) max(0, Tm - Tc)
  backward           P Tcb + (P - 1) max(0, 2 Tm - Tcb) + Tm   (Tcb = 2.5 Tc;
                     K, V and the dK/dV accumulators travel; the last hop of
                     the accumulators cannot hide)
Ulysses: two all-to-alls around one ordinary call on H / P heads,
  forward  F / (P R) + 2 (P - 1) alpha + 4 B n (P - 1)/P (H E + 2 Hkv E + H Ev) / beta
  backward 2.5 F / (P R) + 2 (P - 1) alpha + 4 B n (P - 1)/P (2 H E + 2 Hkv E + 3 H Ev + H) / beta
  needs H and Hkv divisible by P.
Communication is hidden in the ring when Tc >= Tm, i.e. (ignoring alpha)
  n >= 2 (Hkv / H) ((E + Ev) / (2 E)) R / beta   (times 2 for causal).

With a measured run file, the model's R and beta come from this machine's
single-process and transfers-alone figures and its P = 2 predictions are
printed next to the measured times; the cluster table uses a stated node.
"""
import json
import math
import sys


def ring_times(N, P, B, H, Hkv, E, Ev, causal, R, beta, alpha, kb=2.5):
    n = N / P
    f_step = 4 * B * H * n * n * E * (0.5 if causal else 1.0)
    Tc = f_step / R
    m = 4 * B * Hkv * n * (E + Ev)
    Tm = alpha + m / beta
    fwd = P * Tc + (P - 1) * max(0.0, Tm - Tc)
    Tcb = kb * Tc
    bwd = P * Tcb + (P - 1) * max(0.0, 2 * Tm - Tcb) + (Tm if P > 1 else 0.0)
    return fwd, fwd + bwd, Tc, Tm


def ulysses_times(N, P, B, H, Hkv, E, Ev, causal, R, beta, alpha):
    if H % P or Hkv % P:
        return None
    n = N / P
    F = 4 * B * H * N * N * E * (0.5 if causal else 1.0)
    frac = (P - 1) / P
    fwd = F / (P * R) + 2 * (P - 1) * alpha + 4 * B * n * frac * (H * E + 2 * Hkv * E + H * Ev) / beta
    bwd = 2.5 * F / (P * R) + 2 * (P - 1) * alpha + 4 * B * n * frac * (2 * H * E + 2 * Hkv * E + 3 * H * Ev + H) / beta
    return fwd, fwd + bwd


def hidden_rows(H, Hkv, E, Ev, causal, R, beta):
    return 2 * (Hkv / H) * ((E + Ev) / (2 * E)) * R / beta * (2 if causal else 1)


def fmt_s(t):
    if t is None:
        return "n/a"
    if t >= 3600:
        return f"{t / 3600:.1f} h"
    if t >= 1:
        return f"{t:.1f} s"
    return f"{t * 1e3:.1f} ms"


def validate(path):
    """The model against the measured P = 2 ring. Its parameters come from the
    same run file: R from the single-process run on as many threads as the
    ring has ranks (the throughput this machine gives that many workers while
    it is shared), kb from that run's backward/forward ratio, beta from the
    transfers alone."""
    runs = [json.loads(l) for l in open(path) if l.startswith("{")]
    get = lambda m, P, t: next(r for r in runs if r["mode"] == m and r["P"] == P and r["threads"] == t)
    s2, r2 = get("single", 1, 2), get("ring", 2, 1)
    B, H, Hkv, N, E = s2["B"], s2["H"], s2["Hkv"], s2["N"], s2["E"]
    causal = s2["causal"]
    F = 4 * B * H * N * N * E * (0.5 if causal else 1.0)
    R = F / s2["forward_s"] / 2  # per rank: two workers share the measured rate
    kb = (s2["fwd_bwd_s"] - s2["forward_s"]) / s2["forward_s"]
    m = 4 * B * Hkv * (N / 2) * (2 * E)  # one K/V shard, the forward's one shift
    beta = m / r2["forward_transfers_alone_s"] if r2["forward_transfers_alone_s"] > 0 else float("inf")
    print(f"parameters measured here: R = {R / 1e9:.2f} GFLOP/s per rank, backward/forward = {kb:.2f}, "
          f"beta = {beta / 1e9:.2f} GB/s (shared memory, transfers alone)")
    fwd, fb, Tc, Tm = ring_times(N, 2, B, H, Hkv, E, E, causal, R, beta, 0.0, kb)
    print(f"  P = 2 ring forward:          predicted {fwd:.2f} s, measured {r2['forward_s']:.2f} s "
          f"({(r2['forward_s'] / fwd - 1) * 100:+.1f}%; Tc {Tc:.2f} s per step, Tm {Tm * 1e3:.0f} ms)")
    print(f"  P = 2 ring forward+backward: predicted {fb:.2f} s, measured {r2['fwd_bwd_s']:.2f} s "
          f"({(r2['fwd_bwd_s'] / fb - 1) * 100:+.1f}%)")
    return R, beta


def cluster_table(B, H, Hkv, E, causal, R, beta, alpha, label):
    print(f"\n{label}: B={B} H={H} Hkv={Hkv} E=Ev={E} {'causal' if causal else 'non-causal'}, "
          f"R = {R / 1e12:.2f} TFLOP/s per rank, {beta * 8 / 1e9:.0f} Gb/s, alpha = {alpha * 1e6:.0f} us")
    print(f"  communication hidden in the ring for n = N/P >= {hidden_rows(H, Hkv, E, E, causal, R, beta):.0f} rows per rank")
    print("  | N | P | rows/rank | ring fwd | ring fwd+bwd | comm hidden | ulysses fwd | ulysses fwd+bwd |")
    print("  |---|---|---|---|---|---|---|---|")
    for N in (10**6, 10**7):
        for P in (8, 16, 64, 256, 1024):
            f, fb, Tc, Tm = ring_times(N, P, B, H, Hkv, E, E, causal, R, beta, alpha)
            u = ulysses_times(N, P, B, H, Hkv, E, E, causal, R, beta, alpha)
            print(f"  | {N:.0e} | {P} | {N // P} | {fmt_s(f)} | {fmt_s(fb)} | {'yes' if Tc >= Tm else 'no'} | "
                  f"{fmt_s(u[0]) if u else cannot(H, Hkv, P)} | {fmt_s(u[1]) if u else '-'} |")
    print("  where Ulysses beats the ring (P = 8, shorter sequences):")
    print("  | N | rows/rank | ring fwd+bwd | ulysses fwd+bwd | faster |")
    print("  |---|---|---|---|---|")
    for N in (2048, 8192, 32768, 131072):
        _, fb, _, _ = ring_times(N, 8, B, H, Hkv, E, E, causal, R, beta, alpha)
        u = ulysses_times(N, 8, B, H, Hkv, E, E, causal, R, beta, alpha)
        print(f"  | {N} | {N // 8} | {fmt_s(fb)} | {fmt_s(u[1]) if u else cannot(H, Hkv, 8)} | "
              f"{'-' if not u else 'ulysses' if u[1] < fb else 'ring'} |")


def cannot(H, Hkv, P):
    if H < P:
        return "cannot (H < P)"
    if Hkv < P:
        return "cannot (Hkv < P)"
    return "cannot (P does not divide H, Hkv)"


if __name__ == "__main__":
    if len(sys.argv) > 1:
        validate(sys.argv[1])
    # The stated cluster: one rank per node of 64 cores, the fused kernel at
    # 150 GFLOP/s per core (assumed; a Zen 3 VM's two threads run the fused
    # forward at 157, docs/performance.md) and 75% parallel efficiency; 100 Gb/s
    # links with 2 us latency.
    R_node = 64 * 150e9 * 0.75
    beta, alpha = 100e9 / 8, 2e-6
    cluster_table(1, 8, 8, 64, True, R_node, beta, alpha, "issue shape")
    cluster_table(1, 32, 8, 128, True, R_node, beta, alpha, "Llama-like layer (GQA)")
