#!/usr/bin/env bash
# The measurements of docs/distributed.md: the ring (and Ulysses) on P = 1, 2
# processes with one thread each against the single-process fused kernel on
# one and on two threads, at N = 16384, H = 8, E = 64 (override with N=, H=,
# E=, REPS=, CAUSAL="--causal" or ""). Writes one JSON line per run to
# $OUT (default build/ring_bench.jsonl) and prints a summary.
#   bash bench/ring_bench.sh [build-dir]
set -euo pipefail
build=${1:-build}
bin="$build/ring-bench"
[ -x "$bin" ] || { echo "ring_bench.sh: $bin not built (cmake --build $build --target ring-bench)" >&2; exit 4; }
N=${N:-16384} H=${H:-8} E=${E:-64} REPS=${REPS:-3}
CAUSAL=${CAUSAL---causal}
OUT=${OUT:-$build/ring_bench.jsonl}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpi="mpirun --oversubscribe --bind-to none"
common="--N $N --H $H --E $E --reps $REPS $CAUSAL"
: > "$OUT"
echo "# uptime before: $(uptime)" >&2
$mpi -np 1 "$bin" $common --threads 1 --mode single | tee -a "$OUT"
$mpi -np 1 "$bin" $common --threads 1 --mode ring | tee -a "$OUT"
$mpi -np 2 "$bin" $common --threads 1 --mode ring | tee -a "$OUT"
$mpi -np 1 "$bin" $common --threads 2 --mode single | tee -a "$OUT"
$mpi -np 2 "$bin" $common --threads 1 --mode ulysses | tee -a "$OUT"
echo "# uptime after: $(uptime)" >&2
python3 - "$OUT" <<'PY'
import json, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
def find(mode, P, t):
    return next(r for r in runs if r["mode"] == mode and r["P"] == P and r["threads"] == t)
s1, s2, r2 = find("single", 1, 1), find("single", 1, 2), find("ring", 2, 1)
r1, u2 = find("ring", 1, 1), find("ulysses", 2, 1)
for key, name in (("forward_s", "forward"), ("fwd_bwd_s", "forward+backward")):
    print(f"{name}: single 1x1 {s1[key]:.3f} s, ring P=1 {r1[key]:.3f} s, ring P=2x1 {r2[key]:.3f} s, "
          f"single 1x2 {s2[key]:.3f} s, ulysses P=2x1 {u2[key]:.3f} s")
    print(f"  ring P=2x1 / single 1x2 = {r2[key] / s2[key]:.3f}   (target <= 1.15)")
    print(f"  ring efficiency vs single 1x1: {s1[key] / (2 * r2[key]):.3f}   ulysses/single 1x2 = {u2[key] / s2[key]:.3f}")
for pre in ("forward", "fwd_bwd"):
    alone, wait = r2[pre + "_transfers_alone_s"], r2[pre + "_wait_s"]
    hidden = 1 - wait / alone if alone > 0 else float("nan")
    print(f"{pre}: transfers alone {alone:.4f} s, waiting with compute {wait:.4f} s, hidden {hidden:.0%}")
PY
