#!/usr/bin/env bash
# Threads on a busy machine: a small `attn train` on 1 and on 2 OpenMP threads,
# first as the machine is, then with one busy-loop process per core competing
# for the CPUs, under each OpenMP wait policy. On an oversubscribed machine two
# threads may be somewhat slower than one (they wait for each other at every
# barrier), but not by an order of magnitude.
#
#   bench/oversubscribed.sh [path/to/attn]        (default build/apps/attn)
#   BUSY=4 REPS=3 POLICIES="default passive spin=10000" STEPS=40 bench/oversubscribed.sh
#   NO_BUSY=1 bench/oversubscribed.sh             (only the machine as it is)
#
# Prints one line per (load, policy, threads): the median wall time of REPS
# runs and the ratio of 2 threads to 1, with the load average at the start.
# Policies: "default" runs with neither variable set (the attn tool then
# chooses, see apps/passive_wait/passive_wait.cpp); "passive" and "active" set
# OMP_WAIT_POLICY; "spin=N" sets GOMP_SPINCOUNT=N (libgomp's spin before a
# thread sleeps).
set -euo pipefail
ATTN=${1:-build/apps/attn}
BUSY=${BUSY:-$(nproc)}
REPS=${REPS:-3}
STEPS=${STEPS:-40}
POLICIES=${POLICIES:-default passive active spin=10000}
[ -x "$ATTN" ] || { echo "oversubscribed.sh: $ATTN is not built (make demo builds it)" >&2; exit 2; }
scratch=$(mktemp -d)
busy_pids=()
stop_busy() {
  for p in "${busy_pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${busy_pids[@]}"; do wait "$p" 2>/dev/null || true; done
  busy_pids=()
}
trap 'stop_busy; rm -rf "$scratch"' EXIT

# One run: seconds of wall time (the training itself, as `attn train` reports it).
one_run() {  # threads policy
  local env=(OMP_NUM_THREADS="$1")
  case $2 in
    default) ;;
    spin=*) env+=(GOMP_SPINCOUNT="${2#spin=}") ;;
    *) env+=(OMP_WAIT_POLICY="$2") ;;
  esac
  env -u OMP_WAIT_POLICY -u GOMP_SPINCOUNT "${env[@]}" "$ATTN" train --task reverse --steps "$STEPS" \
    --log-every 100000 --eval-examples 16 --seed 1 > "$scratch/out.txt"
  sed -n 's/.* in \([0-9.]*\) s$/\1/p' "$scratch/out.txt"
}
median() { sort -g | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}'; }

measure() {  # label
  local label=$1 policy threads t1 t
  for policy in $POLICIES; do
    t1=
    for threads in 1 2; do
      t=$(for _ in $(seq "$REPS"); do one_run "$threads" "$policy"; done | median)
      if [ "$threads" = 1 ]; then
        t1=$t
        printf '%-18s %-8s threads 1: %7.2f s\n' "$label" "$policy" "$t"
      else
        printf '%-18s %-8s threads 2: %7.2f s   2 threads / 1 thread = %.2f\n' "$label" "$policy" "$t" \
          "$(echo "$t / $t1" | bc -l)"
      fi
    done
  done
}

echo "attn train --task reverse --steps $STEPS, median of $REPS; $(nproc) CPUs"
echo "load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
measure "as is"
[ -z "${NO_BUSY:-}" ] || exit 0
for _ in $(seq "$BUSY"); do
  sh -c 'while :; do :; done' &
  busy_pids+=($!)
done
sleep 1
echo "with $BUSY busy processes; load average: $(cut -d' ' -f1-3 /proc/loadavg)"
measure "+$BUSY busy"
stop_busy
