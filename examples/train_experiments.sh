#!/usr/bin/env bash
# The experiments of docs/training.md: run from the repository root after a
# Release build; writes logs and per-step CSV curves under $OUT (default
# build/train-experiments/). As in the docs, the headline runs use the default
# threads and the positions and scale runs one thread each; the script runs
# them one after another.
set -euo pipefail
ATTN=${ATTN:-build/apps/attn}
OUT=${OUT:-build/train-experiments}
mkdir -p "$OUT"
run() {  # name, flags...
  local name=$1; shift
  echo "== $name: $ATTN train $*" | tee "$OUT/$name.log"
  "$ATTN" train "$@" --csv "$OUT/$name.csv" >> "$OUT/$name.log" 2>&1
  tail -3 "$OUT/$name.log"
}
case "${1:-all}" in  # headline | recall | positions | scale | all (all but recall)
  headline|all)
    run reverse --task reverse --eval-every 50 --target-accuracy 0.99
    run recall --task recall --eval-every 100 --target-accuracy 0.99
    run recall_multiquery --task recall --queries 0 --curriculum 0 --steps 2000 --eval-every 100 --target-accuracy 0.99
    ;;&
  recall)  # single-query recall over seeds, one thread: curricula from 2, 3, 4 pairs and none
    export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
    for seed in 0 1 2 3 4 5 6 7; do
      for c in 2 3 4; do
        run "recall_c${c}_seed$seed" --task recall --curriculum "$c" --seed "$seed" --eval-every 100 --target-accuracy 0.99
      done
    done
    run recall_nocurriculum --task recall --curriculum 0 --steps 8000 --eval-every 250 --target-accuracy 0.99
    ;;
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
