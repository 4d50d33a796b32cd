#!/usr/bin/env bash
# The experiments of docs/training.md: run from the repository root after a
# Release build; writes logs and per-step CSV curves under $OUT (default
# build/train-experiments/). As in the docs, the headline runs use the default
# threads and the positions and scale runs one thread each; the script runs
# them one after another.
set -euo pipefail
BIN=${BIN:-build/examples/train}
OUT=${OUT:-build/train-experiments}
mkdir -p "$OUT"
run() {  # name, flags...
  local name=$1; shift
  echo "== $name: $BIN $*" | tee "$OUT/$name.log"
  "$BIN" "$@" --csv "$OUT/$name.csv" >> "$OUT/$name.log" 2>&1
  tail -3 "$OUT/$name.log"
}
case "${1:-all}" in
  headline|all)
    run reverse --task reverse --eval-every 50 --target-accuracy 0.99
    run recall --task recall --eval-every 100 --target-accuracy 0.99
    ;;&
  positions|all)
    export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
    for p in none sinusoidal learned rope; do
      run "positions_$p" --task reverse --positions "$p" --steps 600 --eval-every 200
    done
    ;;&
  scale|all)
    export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
    for seed in 0 1 2; do
      for s in default none; do
        run "scale_${s}_seed$seed" --task reverse --positions sinusoidal --dim 256 --heads 1 --layers 2 --steps 300 --warmup 30 \
          --seed "$seed" --scale "$s" --eval-every 100 --log-every 10
      done
    done
    ;;
esac
