#!/usr/bin/env bash
# Every performance target in one run (docs/performance.md): decoding against
# the measured read bandwidth, the variants' overheads, window and varlen, the
# variants and decoding against PyTorch and ggml, the multi-head layer against
# torch.nn.MultiheadAttention and the base table (fused SDPA) against torch.
#
#   bash bench/suite.sh TAG [SECTION ...]
#
# SECTION: decode, decode-paged, compare-decode, decode-window, variants,
# compare-variants, layer, gemm, base, bf16 (default: all of them, in that
# order).
# decode-paged is the decode section on paged caches (pages of 256 tokens, as
# FlashAttention's block_table wants, and of 16, vLLM's default). decode-window is
# sliding-window decoding (a 4096-key window over caches of up to 131072
# tokens) in attn-decode-bench and against torch and ggml. bf16 is the table
# of bfloat16 compute in one file: the forward (every instruction path the CPU
# has, forced in turn) and forward+backward against PyTorch's bfloat16 and
# float32 SDPA and attn's float32, the layer's GEMMs against oneDNN's, the
# multi-head layer in float32 and bfloat16, and decoding with bfloat16
# products, each beside the peaks it is a fraction of. Raw outputs go to
# docs/bench/<section>-<date>-TAG.txt, each headed by the machine (CPU model,
# SIMD target the kernels run, load average), the commit and the command.
#
# Environment:
#   BUILD          the Release build folder (default build; `make build` first)
#   TORCH_PYTHON   an interpreter with torch (default build-py/venv/bin/python);
#                  the torch sections are skipped, saying so, when it has none
#   GGML_DRIVER    the ggml flash_attn_ext driver of docs/decode.md (optional;
#                  built outside this repository)
#   THREADS        threads (default 2)
set -euo pipefail
cd "$(dirname "$0")/.."

tag=${1:?usage: bash bench/suite.sh TAG [SECTION ...]}
shift
sections=("$@")
[ ${#sections[@]} -gt 0 ] ||
  sections=(decode decode-paged compare-decode decode-window variants compare-variants layer gemm base bf16)
BUILD=${BUILD:-build}
TORCH_PYTHON=${TORCH_PYTHON:-build-py/venv/bin/python}
GGML_DRIVER=${GGML_DRIVER:-}
THREADS=${THREADS:-2}
day=$(date -u +%Y-%m-%d)
out_dir=docs/bench
decode_shapes='1,32,8,1,4096,128;1,32,8,1,32768,128;1,8,8,1,16384,64;4,32,8,1,8192,128;1,32,8,1,131072,128'
window_shapes='1,32,8,1,32768,128;1,32,8,1,131072,128;4,32,8,1,8192,128;1,32,8,16,131072,128'

for tool in attn-decode-bench attn-bench-variants attn-bench attn-gemm-bench; do
  [ -x "$BUILD/bench/$tool" ] || { echo "suite.sh: $BUILD/bench/$tool is missing (make build)" >&2; exit 2; }
done
have_torch=0
if [ -x "$TORCH_PYTHON" ] && "$TORCH_PYTHON" -c 'import torch' 2>/dev/null; then have_torch=1; fi

header() {  # the machine, the commit and the load, at the top of every raw output
  echo "# $(date -u '+%Y-%m-%d %H:%M:%S UTC'), commit $(git rev-parse --short HEAD)$(git diff --quiet || echo '+changes')"
  echo "# cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), $(nproc) cpus;" \
       "avx512f: $(grep -qw avx512f /proc/cpuinfo && echo yes || echo no)," \
       "avx512_bf16: $(grep -qw avx512_bf16 /proc/cpuinfo && echo yes || echo no)," \
       "amx: $(grep -qw amx_tile /proc/cpuinfo && echo yes || echo no)"
  local wait
  wait=$(env | grep -E '^(OMP_WAIT_POLICY|GOMP_SPINCOUNT)=' | tr '\n' ' ' || true)
  echo "# OpenMP wait policy from the environment: ${wait:-none, each program chooses (apps/passive_wait)}"
  echo "# transparent huge pages: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null || echo unknown)"
  [ $have_torch -eq 1 ] && echo "# torch $("$TORCH_PYTHON" -c 'import torch; print(torch.__version__, torch.backends.cpu.get_cpu_capability())')"
  echo "# load before: $(cut -d' ' -f1-3 /proc/loadavg)"
}

run() {  # run SECTION COMMAND...: the command's output, headed, into docs/bench
  local section=$1; shift
  local file="$out_dir/$section-$day-$tag.txt"
  { header; echo "# $*"; } > "$file.part"
  echo "== $section -> $file"
  "$@" 2>&1 | tee -a "$file.part"
  echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)" >> "$file.part"
  mv "$file.part" "$file"
}

torch_or_skip() {  # the torch sections need an interpreter with torch
  if [ $have_torch -eq 0 ]; then
    echo "== $1 skipped: $TORCH_PYTHON has no torch (make bench-torch installs it, or set TORCH_PYTHON)"
    return 1
  fi
}

for s in "${sections[@]}"; do
  case $s in
    decode)
      run decode "$BUILD/bench/attn-decode-bench" --threads "$THREADS" \
        --shapes "$decode_shapes;1,32,8,512,8192,128" \
        --dtypes float32,float16,bfloat16 --min-seconds 0.3 ;;
    decode-paged)
      for page in 256 16; do
        run decode-paged$page "$BUILD/bench/attn-decode-bench" --threads "$THREADS" --page $page --no-dense \
          --shapes "$decode_shapes;1,32,8,512,8192,128" --dtypes float32,float16,bfloat16 --min-seconds 0.3
      done ;;
    compare-decode)
      torch_or_skip $s || continue
      run compare-decode "$TORCH_PYTHON" bench/compare_torch.py --decode \
        --attn-decode-bench "$BUILD/bench/attn-decode-bench" --shapes "$decode_shapes" \
        --threads "$THREADS" --reps 3 ${GGML_DRIVER:+--ggml-driver "$GGML_DRIVER"} ;;
    decode-window)
      run decode-window "$BUILD/bench/attn-decode-bench" --threads "$THREADS" --window 4096 \
        --shapes "$window_shapes" --dtypes float32,float16,bfloat16 --min-seconds 0.3
      torch_or_skip $s || continue
      run compare-decode-window "$TORCH_PYTHON" bench/compare_torch.py --decode --decode-window 4096 \
        --attn-decode-bench "$BUILD/bench/attn-decode-bench" --shapes "$window_shapes" \
        --threads "$THREADS" --reps 3 ${GGML_DRIVER:+--ggml-driver "$GGML_DRIVER"} ;;
    variants)
      run variants "$BUILD/bench/attn-bench-variants" --threads "$THREADS" \
        --sections window overhead varlen --modes fwd fwdbwd
      run variants-paired "$BUILD/bench/attn-bench-variants" --threads "$THREADS" \
        --sections window overhead varlen --modes fwd fwdbwd --reps 7 --stat paired
      run variants-softcap1 "$BUILD/bench/attn-bench-variants" --threads "$THREADS" \
        --sections overhead --modes fwd fwdbwd --softcap 1 ;;
    compare-variants)
      torch_or_skip $s || continue
      run compare-variants "$TORCH_PYTHON" bench/compare_torch.py --variants \
        --attn-bench-variants "$BUILD/bench/attn-bench-variants" --threads "$THREADS" ;;
    layer)
      torch_or_skip $s || continue
      run compare-layer "$TORCH_PYTHON" bench/compare_torch.py --layer --threads "$THREADS" ;;
    gemm)
      torch_or_skip $s || continue
      run compare-gemm "$TORCH_PYTHON" bench/compare_torch.py --gemm \
        --attn-gemm-bench "$BUILD/bench/attn-gemm-bench" --threads "$THREADS" ;;
    base)
      torch_or_skip $s || continue
      run compare-torch "$TORCH_PYTHON" bench/compare_torch.py --attn-bench "$BUILD/bench/attn-bench" \
        --lengths 512,1024,2048,4096 --threads 1,2 --reps 3 ;;
    bf16)
      torch_or_skip $s || continue
      # The paths this CPU runs, and on AMX the long sequence of the targets too.
      paths=portable lengths=4096
      grep -qw avx512_bf16 /proc/cpuinfo && paths="avx512,$paths"
      grep -qw amx_tile /proc/cpuinfo && paths="amx,$paths" lengths=4096,16384
      run bf16 bash -c "set -e
        for dim in 128 64; do
          '$TORCH_PYTHON' bench/compare_torch.py --attn-bench '$BUILD/bench/attn-bench' --dtype bfloat16 \\
            --lengths $lengths --threads $THREADS --causal 0,1 --dim \$dim --reps 3 --bf16-paths $paths
        done
        '$BUILD/bench/attn-gemm-bench' --embed 256 --rows 1024 --candidates attn,dnnl,attn-bf16,dnnl-bf16 \\
          --threads $THREADS --reps 9
        '$BUILD/bench/attn-gemm-bench' --embed 512,768 --rows 2048 --candidates attn,dnnl,attn-bf16,dnnl-bf16 \\
          --threads $THREADS --reps 9
        for dtype in float32 bfloat16 bfloat16-params; do
          '$TORCH_PYTHON' bench/compare_torch.py --layer --layer-dtype \$dtype --threads $THREADS --reps 7
        done
        '$BUILD/bench/attn-decode-bench' --threads $THREADS --no-dense --bf16-compute --shapes '$decode_shapes'" ;;
    *) echo "suite.sh: unknown section '$s' (decode, decode-paged, compare-decode, decode-window," \
         "variants, compare-variants, layer, gemm, base, bf16)" >&2; exit 2 ;;
  esac
done
