#!/usr/bin/env python3
"""attn's fused backend against PyTorch's CPU scaled_dot_product_attention.

Same shapes as attn-bench (B=1, H=8, E=Ev=64, float32), same run: for each
shape, PyTorch is timed, then attn (through `attn-bench --json -`, which
validates the fused backend against the reference first), then PyTorch
again, so a change in machine load hits both. Prints the medians and the
ratio attn/torch (below 1 means attn is faster).

    python3 bench/compare_torch.py [--attn-bench build/bench/attn-bench]
                                   [--lengths 512,1024] [--threads 1,2] [--json out.json]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def parse_list(text, kind=int):
    return [kind(x) for x in text.split(",") if x]


def time_torch(torch, L, causal, mode, threads, reps, heads=8, dim=64):
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, heads, L, dim, generator=g) for _ in range(4))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    times = []
    for _ in range(reps + 1):  # the first run is a warm-up
        if mode == "fwd":
            t0 = time.perf_counter()
            with torch.no_grad():
                sdpa(q, k, v, is_causal=causal)
            dt = time.perf_counter() - t0
        else:
            qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
            t0 = time.perf_counter()
            out = sdpa(qq, kk, vv, is_causal=causal)
            out.backward(dout)
            dt = time.perf_counter() - t0
        times.append(dt)
    return statistics.median(times[1:])


def time_attn(binary, L, causal, mode, threads):
    cmd = [binary, "--json", "-", "--lengths", str(L), "--causal", str(int(causal)), "--modes", mode,
           "--threads", str(threads), "--backends", "fused", "--full-check-len", "0"]
    res = subprocess.run(cmd, check=True, capture_output=True, text=True)
    doc = json.loads(res.stdout)
    row = doc["results"][0]
    return row["median_s"], row["validation"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attn-bench", default=os.path.join("build", "bench", "attn-bench"))
    ap.add_argument("--lengths", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--causal", default="0,1")
    ap.add_argument("--modes", default="fwd,fwdbwd")
    ap.add_argument("--reps", type=int, default=3, help="torch repetitions per shape (attn-bench picks its own)")
    ap.add_argument("--json", default="", help="write the results here too")
    args, _ = ap.parse_known_args()

    try:
        import torch
    except Exception as e:  # ImportError, or a broken install (e.g. missing CUDA libraries)
        print(f"compare_torch: PyTorch is not installed or cannot be imported ({e}); nothing to compare.\n"
              "Install it (e.g. `pip install torch`) and run again.")
        return 0
    if not os.path.exists(args.attn_bench):
        print(f"compare_torch: {args.attn_bench} not found; build first (`make build`).")
        return 1

    print(f"torch {torch.__version__} (CPU capability {torch.backends.cpu.get_cpu_capability()}), "
          f"attn-bench {args.attn_bench}")
    print(f"{'L=S':>6} {'mask':6} {'mode':7} {'th':>2} {'torch ms':>10} {'attn ms':>10} {'attn/torch':>10}  validation")
    rows = []
    for L in parse_list(args.lengths):
        for mode in args.modes.split(","):
            for causal in parse_list(args.causal):
                for threads in parse_list(args.threads):
                    t1 = time_torch(torch, L, bool(causal), mode, threads, args.reps)
                    a, check = time_attn(args.attn_bench, L, bool(causal), mode, threads)
                    t2 = time_torch(torch, L, bool(causal), mode, threads, args.reps)
                    t = statistics.median([t1, t2])
                    rows.append(dict(L=L, causal=bool(causal), mode=mode, threads=threads, torch_s=t, attn_s=a,
                                     ratio=a / t, validation=check))
                    print(f"{L:6d} {'causal' if causal else 'full':6} {mode:7} {threads:2d} {t * 1e3:10.2f} "
                          f"{a * 1e3:10.2f} {a / t:10.3f}  {check}", flush=True)
    worst = max(rows, key=lambda r: r["ratio"])
    print(f"\nslowest relative to torch: L={worst['L']} {worst['mode']} causal={worst['causal']} "
          f"threads={worst['threads']}: attn/torch = {worst['ratio']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(torch=torch.__version__, results=rows), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
