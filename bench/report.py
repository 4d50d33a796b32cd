#!/usr/bin/env python3
"""Markdown tables and the fused kernel's targets from benchmark JSON files.

    python3 bench/report.py ATTN_BENCH.json [COMPARE_TORCH.json ...] [--threads 2]

ATTN_BENCH.json is what `attn-bench --json` writes; each COMPARE_TORCH.json
is what `bench/compare_torch.py --json` writes (several files are merged;
a later file's row replaces an earlier one for the same shape). Prints the
per-shape table for one thread count, the attn/torch ratios for every
thread count, and each target of the fused kernel with the measured value,
so the figures of docs/performance.md come from the files rather than being copied by
hand.
"""
import argparse
import json
import sys


def key(r):
    return (r["L"], r["mode"], bool(r["causal"]), r["threads"])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("attn_bench")
    ap.add_argument("torch", nargs="*")
    ap.add_argument("--threads", type=int, default=2, help="thread count of the main table")
    args = ap.parse_args()

    with open(args.attn_bench) as f:
        doc = json.load(f)
    fused = {key(r): r for r in doc["results"] if r["backend"] == "fused"}
    ref = {key(r): r for r in doc["results"] if r["backend"] == "reference"}
    torch = {}
    torch_version = None
    for path in args.torch:
        with open(path) as f:
            t = json.load(f)
        torch_version = t.get("torch", torch_version)
        for r in t["results"]:
            torch[key(r)] = r

    peaks = doc.get("fma_peak_gflops", {})
    print(f"attn-bench {doc.get('date', '?')}, cpu {doc.get('cpu', '?')}, SIMD {doc.get('simd_target', '?')}, "
          f"FMA peak " + ", ".join(f"{v:.0f} GFLOP/s ({k} thr)" for k, v in sorted(peaks.items())) +
          (f"; torch {torch_version}" if torch_version else ""))
    print()
    th = args.threads
    print(f"| L=S | mode | causal | fused ms | GFLOP/s | % of FMA peak | % per CPU-s | reference ms (× fused) | attn/torch |")
    print("|---|---|---|---|---|---|---|---|---|")
    for k in sorted(fused):
        if k[3] != th:
            continue
        r = fused[k]
        rr = ref.get(k)
        ref_txt = f"{rr['median_s'] * 1e3:.0f} ({rr['median_s'] / r['median_s']:.0f}×)" if rr else "not timed"
        tr = torch.get(k)
        tr_txt = f"{tr['ratio']:.2f}" if tr else "–"
        print(f"| {k[0]} | {k[1]} | {'yes' if k[2] else 'no'} | {r['median_s'] * 1e3:.1f} | {r['gflops']:.1f} | "
              f"{r['pct_fma_peak']:.0f}% of {r['fma_peak_gflops']:.0f} | {r['pct_core_peak_per_cpu_second']:.0f}% | "
              f"{ref_txt} | {tr_txt} |")

    if torch:
        print()
        threads = sorted({k[3] for k in torch})
        cols = [(m, c, t) for m in ("fwd", "fwdbwd") for c in (False, True) for t in threads]
        print("| L=S | " + " | ".join(f"{m} {'causal' if c else 'full'} {t}t" for m, c, t in cols) + " |")
        print("|---|" + "---|" * len(cols))
        for L in sorted({k[0] for k in torch}):
            cells = []
            for m, c, t in cols:
                r = torch.get((L, m, c, t))
                cells.append("–" if r is None else (f"**{r['ratio']:.2f}**" if r["ratio"] >= 1 else f"{r['ratio']:.2f}"))
            print(f"| {L} | " + " | ".join(cells) + " |")

    print()
    print("Targets (L=S=4096, 2 threads unless said):")
    nc, ca, fb = fused.get((4096, "fwd", False, 2)), fused.get((4096, "fwd", True, 2)), fused.get((4096, "fwdbwd", False, 2))
    if nc:
        v = nc["pct_fma_peak"]
        print(f"- forward non-causal >= 50% of FMA peak (stretch 65%): {v:.1f}% ({nc['gflops']:.1f} of "
              f"{nc['fma_peak_gflops']:.0f} GFLOP/s; {nc['pct_core_peak_per_cpu_second']:.1f}% per CPU-second) "
              f"-> {'met' if v >= 50 else 'MISSED'}{', stretch met' if v >= 65 else ''}")
    if nc and ca:
        q = ca["median_s"] / nc["median_s"]
        print(f"- causal <= 0.6x non-causal time: {ca['median_s'] * 1e3:.1f} / {nc['median_s'] * 1e3:.1f} ms = {q:.2f} "
              f"-> {'met' if q <= 0.6 else 'MISSED'}")
    if fb:
        v = fb["pct_fma_peak"]
        print(f"- forward+backward >= 35% of FMA peak: {v:.1f}% ({fb['gflops']:.1f} GFLOP/s) -> {'met' if v >= 35 else 'MISSED'}")
    if torch:
        worst = max(torch.values(), key=lambda r: r["ratio"])
        slower = [r for r in torch.values() if r["ratio"] >= 1]
        print(f"- faster than torch on every shape: {len(torch) - len(slower)} of {len(torch)} shapes faster; worst ratio "
              f"{worst['ratio']:.3f} at L={worst['L']} {worst['mode']} {'causal' if worst['causal'] else 'full'} "
              f"{worst['threads']} thread(s) -> {'met' if not slower else 'MISSED'}")
        for r in sorted(slower, key=key):
            print(f"    slower: L={r['L']} {r['mode']} {'causal' if r['causal'] else 'full'} {r['threads']}t: {r['ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
