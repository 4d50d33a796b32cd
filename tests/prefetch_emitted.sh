#!/usr/bin/env bash
# The kernels' software prefetches must reach the machine code: GCC deletes
# loops of __builtin_prefetch (src/kernels/prefetch.hpp says why they are
# asm statements). Every object of the library whose source loops over rows
# with Prefetch/PrefetchRows must hold prefetch instructions.
# Usage: prefetch_emitted.sh OBJECT...   (exit 77: not checkable here)
set -euo pipefail
case "$(uname -m)" in x86_64 | i?86) ;; *) echo "not x86: nothing to check"; exit 77 ;; esac
command -v objdump > /dev/null || { echo "objdump not found"; exit 77; }
checked=0
for obj in "$@"; do
  case "$obj" in
    */kernels/decode/decode.cpp.o | */kernels/decode/bf16_native.cpp.o | */kernels/fused/fused.cpp.o) ;;
    *) continue ;;
  esac
  # Prefetch instructions per function, then those of the row loops.
  counts=$(objdump -d -C --no-show-raw-insn "$obj" |
    awk '/>:$/ { f = $0 } /[ \t]prefetch(t0|t1|t2|nta)[ \t]/ { n[f]++ } END { for (k in n) print n[k] "\t" k }')
  case "$obj" in
    */decode.cpp.o) loops='ScoreTile<|ValueTile<' ;;  # the score and value loops over a tile's rows
    */bf16_native.cpp.o) loops='decode_bf16_(scores|values)' ;;
    */fused.cpp.o) loops='PackRows' ;;
  esac
  n=$(printf '%s\n' "$counts" | awk -F'\t' -v re="$loops" '$2 ~ re { s += $1 } END { print s + 0 }')
  echo "$(basename "$obj"): $n prefetch instructions in the functions matching '$loops'"
  [ "$n" -gt 0 ] || { echo "FAIL: $obj: no prefetch instruction in its row loops"; exit 1; }
  checked=$((checked + 1))
done
[ "$checked" -eq 3 ] || { echo "FAIL: expected the 3 objects, found $checked"; exit 1; }
