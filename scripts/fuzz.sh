#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/: the file parsers, the KV cache) with clang and runs
# each for a bounded time: `make fuzz` (FUZZ_SECONDS per target, default 60).
# Needs clang and its libFuzzer runtime: `bash scripts/install-fuzz-deps.sh`.
# Exits non-zero when a target finds a crash; the reproducer is left in
# build-fuzz/ (crash-*), and fuzz/corpus/ seeds every run.
set -euo pipefail
seconds="${1:-${FUZZ_SECONDS:-60}}"
root="$(cd "$(dirname "$0")/.." && pwd)"
out="$root/build-fuzz"
CXX_FUZZ="${CXX_FUZZ:-}"
if [ -z "$CXX_FUZZ" ]; then
  for c in clang++ clang++-19 clang++-18 clang++-17 clang++-16 clang++-15 clang++-14; do
    if command -v "$c" >/dev/null 2>&1; then CXX_FUZZ="$c"; break; fi
  done
fi
if [ -z "$CXX_FUZZ" ]; then
  echo "fuzz: no clang++ found; run: bash scripts/install-fuzz-deps.sh" >&2
  exit 2
fi
mkdir -p "$out"
flags=(-std=c++20 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all
       -I"$root/include" -I"$root/src")
if ! echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' |
     "$CXX_FUZZ" -x c++ -fsanitize=fuzzer - -o "$out/.probe" 2>/dev/null; then
  echo "fuzz: $CXX_FUZZ cannot link libFuzzer; run: bash scripts/install-fuzz-deps.sh" >&2
  exit 2
fi
# The parsers and what they link of the core: the boundary's Checker
# (src/validate.cpp, which asks OpenMP for the thread count: -lgomp) and the
# half types' scalar conversions (src/half.cpp, plain C++), for float16 .npy files.
io_sources=("$root/src/io/file.cpp" "$root/src/io/npy.cpp" "$root/src/io/safetensors.cpp" "$root/src/validate.cpp"
            "$root/src/half.cpp")
# The KV cache's configurations and operations: the cache and what it links
# of the core (the Checker, the half types' conversions, the size checks).
kv_sources=("$root/src/kv_cache.cpp" "$root/src/validate.cpp" "$root/src/half.cpp" "$root/src/memory.cpp")
status=0
for target in npy safetensors kv_cache; do
  echo "fuzz: building fuzz_$target with $CXX_FUZZ"
  if [ "$target" = kv_cache ]; then sources=("${kv_sources[@]}"); else sources=("${io_sources[@]}"); fi
  "$CXX_FUZZ" "${flags[@]}" "$root/fuzz/fuzz_$target.cpp" "${sources[@]}" -lgomp -o "$out/fuzz_$target"
  mkdir -p "$out/corpus_$target"
  echo "fuzz: running fuzz_$target for ${seconds}s"
  (cd "$out" && ./"fuzz_$target" -max_total_time="$seconds" -max_len=8192 -rss_limit_mb=2048 -print_final_stats=1 \
       "corpus_$target" "$root/fuzz/corpus/$target") || status=1
done
exit $status
