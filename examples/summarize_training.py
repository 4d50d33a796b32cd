#!/usr/bin/env python3
"""Summarises the CSV curves and logs of examples/train_experiments.sh as
markdown tables (standard library only). Usage: summarize_training.py DIR"""
import csv, glob, os, re, statistics, sys

d = sys.argv[1] if len(sys.argv) > 1 else "build/train-experiments"

def curve(name):
    with open(os.path.join(d, name + ".csv")) as f:
        return [{k: float(v) for k, v in r.items()} for r in csv.DictReader(f)]

def log_value(name, pattern):
    with open(os.path.join(d, name + ".log")) as f:
        m = re.search(pattern, f.read())
    return m.groups() if m else None

def first_step_reaching(rows, acc):
    for r in rows:
        if r["eval_token_acc"] >= acc:
            return int(r["step"]) + 1, r["elapsed_s"]
    return None, None

names = sorted(os.path.basename(p)[:-4] for p in glob.glob(os.path.join(d, "*.csv")))
print("| run | steps | seconds | tokens/s | held-out token acc | held-out seq acc | first eval >= 0.99 (step, s) |")
print("|---|---|---|---|---|---|---|")
for n in names:
    rows = curve(n)
    last = rows[-1]
    held = log_value(n, r"token accuracy ([0-9.]+), exact-sequence accuracy ([0-9.]+)")
    s, t = first_step_reaching(rows, 0.99)
    print(f"| {n} | {int(last['step']) + 1} | {last['elapsed_s']:.1f} | {last['tokens_per_s']:.0f} | "
          f"{held[0] if held else '?'} | {held[1] if held else '?'} | "
          f"{'-' if s is None else f'{s}, {t:.1f}'} |")

scale = [n for n in names if n.startswith("scale_")]
if scale:
    print()
    print("| run | score std at init | mean top weight at init | mean ‖dL/dW_Q‖ steps 1-10 | mean ‖dL/dW_K‖ steps 1-10 | loss @1 | loss @50 | loss @100 | loss @300 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in scale:
        rows = curve(n)
        init = log_value(n, r"score std ([0-9.]+), mean top attention weight ([0-9.]+)")
        q = statistics.mean(r["grad_norm_q"] for r in rows[:10])
        k = statistics.mean(r["grad_norm_k"] for r in rows[:10])
        at = lambda s: f"{rows[s - 1]['loss']:.4f}" if len(rows) >= s else "-"
        print(f"| {n} | {init[0]} | {init[1]} | {q:.3g} | {k:.3g} | {at(1)} | {at(50)} | {at(100)} | {at(300)} |")
