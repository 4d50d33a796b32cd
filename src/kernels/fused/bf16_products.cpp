// The instruction paths of the bfloat16 products (bf16.hpp) and the choice
// among them. Compiled once with the baseline flags: the AVX512_BF16 and
// AMX code sits in `#pragma GCC target` regions and runs only where
// bf16_path_available says the CPU (and the OS) allow it.
//
// The AMX emulation (EmulatedTiles) is the tests' way to run the AMX block
// product on every machine. It follows the documented semantics of the
// instructions (Intel SDM, TILELOADD/TILESTORED/TILEZERO/TDPBF16PS):
// for every row m and column n of C, over k in order,
//   c = c + A[m][2k]·B[k][2n];  c = c + A[m][2k+1]·B[k][2n+1]
// each a float32 fused multiply-add rounded to nearest even (a product of
// two bfloat16 is exact in float32, so these are fmaf), with subnormal
// inputs read as zero and subnormal results flushed to zero; MXCSR is not
// consulted. The operands of attn's products are never subnormal (bf16.hpp,
// "Rounding"), so only the flush of results matters. The hardware does not
// round as the pseudocode says: on an Emerald Rapids, one pair per
// instruction gave fl(c + fl(a0·b0 + a1·b1)) (one rounding of the exact
// pair sum, then the add), and over 16 pairs it kept more than float32's
// precision inside the instruction (its result equals the pseudocode's in
// 57% of elements, one rounding of the exact sum in 79%). So the emulation
// runs the AMX code's structure and order, not its last bits: the tests hold
// the native tiles to it within float32's accumulation bound.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/fused/bf16.hpp"
#include "kernels/fused/blocking.hpp"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define ATTN_BF16_X86 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define ATTN_BF16_X86 0
#endif

namespace attn::detail {
namespace {

// ---- the AMX block product on emulated tiles ------------------------------

namespace emulated {
#include "kernels/fused/amx-inl.h"

// A float32 result as TDPBF16PS leaves it: a subnormal becomes a signed zero.
float flush(float x) { return std::fabs(x) < 0x1p-126f ? std::copysign(0.0f, x) : x; }
float widen(uint16_t b) { return flush(bf16_value(b)); }  // a subnormal input reads as zero

struct Tiles {
  struct State {
    uint8_t rows[8] = {};
    uint16_t colsb[8] = {};
    alignas(64) uint8_t data[8][16][64] = {};
  };
  static State& state() {
    thread_local State s;
    return s;
  }
  static void config(const TileConfig& c) {
    State& s = state();
    for (int t = 0; t < 8; ++t) s.rows[t] = c.rows[t], s.colsb[t] = c.colsb[t];
    std::memset(s.data, 0, sizeof s.data);
  }
  static void release() { state() = State{}; }
  template <int t>
  static void load(const void* p, int64_t stride) {
    State& s = state();
    std::memset(s.data[t], 0, sizeof s.data[t]);
    for (int r = 0; r < s.rows[t]; ++r) std::memcpy(s.data[t][r], static_cast<const char*>(p) + r * stride, s.colsb[t]);
  }
  template <int t>
  static void store(void* p, int64_t stride) {
    const State& s = state();
    for (int r = 0; r < s.rows[t]; ++r) std::memcpy(static_cast<char*>(p) + r * stride, s.data[t][r], s.colsb[t]);
  }
  template <int t>
  static void zero() {
    std::memset(state().data[t], 0, sizeof state().data[t]);
  }
  template <int c, int a, int b>
  static void dp() {
    State& s = state();
    for (int m = 0; m < s.rows[c]; ++m)
      for (int n = 0; n < s.colsb[c] / 4; ++n) {
        float acc;
        std::memcpy(&acc, s.data[c][m] + 4 * n, 4);
        for (int k = 0; k < s.colsb[a] / 4; ++k) {
          uint16_t a2[2], b2[2];
          std::memcpy(a2, s.data[a][m] + 4 * k, 4);
          std::memcpy(b2, s.data[b][k] + 4 * n, 4);
          acc = flush(std::fma(widen(a2[0]), widen(b2[0]), acc));
          acc = flush(std::fma(widen(a2[1]), widen(b2[1]), acc));
        }
        std::memcpy(s.data[c][m] + 4 * n, &acc, 4);
      }
  }
};
}  // namespace emulated

#if ATTN_BF16_X86

// ---- what the CPU runs ------------------------------------------------------

uint64_t xcr0() {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (uint64_t(hi) << 32) | lo;
}

// AVX-512 F/BW/VL and BF16, with the OS saving the vector state.
bool cpu_avx512_bf16() {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return false;  // OSXSAVE
  if ((xcr0() & 0xE6) != 0xE6) return false;  // SSE, AVX, opmask, ZMM state
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!(b & (1u << 16)) || !(b & (1u << 30)) || !(b & (1u << 31))) return false;  // F, BW, VL
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
  return a & (1u << 5);  // AVX512_BF16
}

// AMX-TILE and AMX-BF16, the OS's tile state, and Linux's permission to use
// it (requested once per process; refused: the other paths).
bool cpu_amx() {
  unsigned a, b, c, d;
  if (!cpu_avx512_bf16() || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!(d & (1u << 24)) || !(d & (1u << 22))) return false;  // AMX-TILE, AMX-BF16
  if ((xcr0() & (3u << 17)) != (3u << 17)) return false;   // XTILECFG, XTILEDATA
#ifdef SYS_arch_prctl
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,amx-tile,amx-bf16")

// ---- AVX512_BF16: VDPBF16PS -------------------------------------------------

namespace dp {

constexpr int kMR = 8, kNV = 3;  // 24 accumulators, 3 vectors of B, one broadcast: 28 of 32 registers

template <int R, int NV>
inline void Kernel(int64_t K, const uint16_t* A, int64_t lda, const uint32_t* B, int64_t ldb, float* C,
                   int64_t ldc, float alpha, bool accumulate) {
  __m512 acc[R][NV];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) acc[r][v] = accumulate ? _mm512_loadu_ps(C + r * ldc + 16 * v) : _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    __m512bh b[NV];
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) b[v] = (__m512bh)_mm512_loadu_si512(B + (k / 2) * ldb + 16 * v);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, A + r * lda + k, 4);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, b[v]);
    }
  }
  const __m512 s = _mm512_set1_ps(accumulate ? 1.0f : alpha);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(C + r * ldc + 16 * v, _mm512_mul_ps(acc[r][v], s));
}

void Gemm(int64_t M, int64_t N, int64_t K, const void* Av, int64_t lda, const uint32_t* B, int64_t ldb, float* C,
          int64_t ldc, float alpha, bool accumulate) {
  const auto* A = static_cast<const uint16_t*>(Av);
  ForRegisterTiles<kMR, kNV>(M, N, 16, [&]<int R, int NV>(int64_t m0, int64_t n0) {
    Kernel<R, NV>(K, A + m0 * lda, lda, B + n0, ldb, C + m0 * ldc + n0, ldc, alpha, accumulate);
  });
}

// bf16.hpp's Bf16Pairs with VCVTNE2PS2BF16, whose conversion is
// bf16_operand's: nearest even, a subnormal input to a signed zero, NaN
// kept and made quiet. It leaves the even row's 16 values in the low half
// and the odd row's in the high half; one permutation interleaves them.
void Pairs(const float* st, int64_t ld, int64_t nk, int64_t K, int64_t nrp, uint32_t* pp) {
  alignas(64) static constexpr uint16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,
                                                           21, 6, 22, 7, 23, 8, 24, 9, 25, 10, 26,
                                                           11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  for (int64_t k = 0; 2 * k < K; ++k) {
    const float* e = 2 * k < nk ? st + 2 * k * ld : nullptr;
    const float* o = 2 * k + 1 < nk ? st + (2 * k + 1) * ld : nullptr;
    uint32_t* dst = pp + k * ld;
    int64_t r = 0;
    for (; r + 16 <= nrp; r += 16) {
      const __m512 ev = e ? _mm512_loadu_ps(e + r) : _mm512_setzero_ps();
      const __m512 ov = o ? _mm512_loadu_ps(o + r) : _mm512_setzero_ps();
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(ov, ev);
      _mm512_storeu_si512(dst + r, _mm512_permutexvar_epi16(interleave, both));
    }
    for (; r < nrp; ++r)  // a SIMD target with 8 lanes leaves a half vector
      dst[r] = (e ? bf16_operand(e[r]) : 0u) | (o ? uint32_t(bf16_operand(o[r])) << 16 : 0u);
  }
}

}  // namespace dp

// ---- AMX: TDPBF16PS ---------------------------------------------------------

namespace native {
#include "kernels/fused/amx-inl.h"

// The intrinsics name their tile in the instruction text, so each tile
// number is spelled out. The compiler barriers tell it that a tile load
// reads and a store writes memory (the intrinsics' asm does not say so).
#define ATTN_TILE_SWITCH(OP, ...)                         \
  if constexpr (t == 0) OP(0, __VA_ARGS__);               \
  else if constexpr (t == 1) OP(1, __VA_ARGS__);          \
  else if constexpr (t == 2) OP(2, __VA_ARGS__);          \
  else if constexpr (t == 3) OP(3, __VA_ARGS__);          \
  else if constexpr (t == 4) OP(4, __VA_ARGS__);          \
  else if constexpr (t == 5) OP(5, __VA_ARGS__);          \
  else if constexpr (t == 6) OP(6, __VA_ARGS__);          \
  else OP(7, __VA_ARGS__)
#define ATTN_TILE_ZERO(t, unused) _tile_zero(t)

struct Tiles {
  // (GCC 12's _tile_loadconfig tells the compiler that it reads 8 of the 64
  // bytes, which lets it drop the stores of the rest: the operand here is
  // the whole configuration.)
  static void config(const TileConfig& c) { __asm__ volatile("ldtilecfg %0" ::"m"(c)); }
  static void release() { _tile_release(); }
  template <int t>
  static void load(const void* p, int64_t stride) {
    __asm__ volatile("" ::: "memory");
    ATTN_TILE_SWITCH(_tile_loadd, p, stride);
  }
  template <int t>
  static void store(void* p, int64_t stride) {
    ATTN_TILE_SWITCH(_tile_stored, p, stride);
    __asm__ volatile("" ::: "memory");
  }
  template <int t>
  static void zero() {
    ATTN_TILE_SWITCH(ATTN_TILE_ZERO, 0);
  }
  template <int c, int a, int b>
  static void dp() {
    static_assert((c == 0 && a == 4 && b == 6) || (c == 1 && a == 4 && b == 7) || (c == 2 && a == 5 && b == 6) ||
                      (c == 3 && a == 5 && b == 7),
                  "the block product's four tile triples");
    if constexpr (c == 0) _tile_dpbf16ps(0, 4, 6);
    else if constexpr (c == 1) _tile_dpbf16ps(1, 4, 7);
    else if constexpr (c == 2) _tile_dpbf16ps(2, 5, 6);
    else _tile_dpbf16ps(3, 5, 7);
  }
};
#undef ATTN_TILE_ZERO
#undef ATTN_TILE_SWITCH

}  // namespace native

#pragma GCC pop_options

#endif  // ATTN_BF16_X86

}  // namespace

const char* bf16_path_name(Bf16Path path) {
  switch (path) {
    case Bf16Path::portable: return "portable";
    case Bf16Path::avx512_bf16: return "AVX512_BF16";
    case Bf16Path::amx: return "AMX";
    case Bf16Path::amx_emulated: return "AMX (emulated)";
  }
  return "?";
}

bool bf16_path_available(Bf16Path path) {
#if ATTN_BF16_X86
  static const bool dp = cpu_avx512_bf16();
  static const bool amx = cpu_amx();
#else
  constexpr bool dp = false, amx = false;
#endif
  switch (path) {
    case Bf16Path::portable:
    case Bf16Path::amx_emulated: return true;
    case Bf16Path::avx512_bf16: return dp;
    case Bf16Path::amx: return amx;
  }
  return false;
}

namespace {
// Whether the CPU's vendor is AMD (CPUID leaf 0).
bool cpu_is_amd() {
#if ATTN_BF16_X86
  unsigned a, b, c, d;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return false;
  return b == 0x68747541u && d == 0x69746E65u && c == 0x444D4163u;  // "Auth" "enti" "cAMD"
#else
  return false;
#endif
}
}  // namespace

// VDPBF16PS pays on AMD's cores (Zen 4: the forward in 0.54-0.69 of the
// float32 forward's time) but not on Intel's: on an Emerald Rapids the
// AVX512_BF16 path took 1.7× the float32 forward's time and 1.5× the
// portable path's, whose bits it gives. So an Intel CPU without AMX (or
// whose OS refuses it) takes the portable path.
Bf16Path bf16_best_path() {
  static const Bf16Path best = bf16_path_available(Bf16Path::amx) ? Bf16Path::amx
                               : bf16_path_available(Bf16Path::avx512_bf16) && cpu_is_amd()
                                   ? Bf16Path::avx512_bf16
                                   : Bf16Path::portable;
  return best;
}

Bf16Kernel bf16_kernel(Bf16Path path) {
  Bf16Kernel k;
  k.path = path;
  switch (path) {
    case Bf16Path::portable:
      k.a_float = true;
      break;
    case Bf16Path::avx512_bf16:
#if ATTN_BF16_X86
      k.gemm = &dp::Gemm;
      k.pairs = &dp::Pairs;
      k.vcvtne2ps2bf16 = true;
#endif
      break;
    case Bf16Path::amx:
#if ATTN_BF16_X86
      k.gemm = &native::AmxGemm<native::Tiles>;
      k.pairs = &dp::Pairs;
      k.vcvtne2ps2bf16 = true;
      k.thread_begin = &native::AmxBegin<native::Tiles>;
      k.thread_end = &native::AmxEnd<native::Tiles>;
#endif
      k.kpad = 32, k.mpad = 16;
      break;
    case Bf16Path::amx_emulated:
      k.gemm = &emulated::AmxGemm<emulated::Tiles>;
      k.thread_begin = &emulated::AmxBegin<emulated::Tiles>;
      k.thread_end = &emulated::AmxEnd<emulated::Tiles>;
      k.kpad = 32, k.mpad = 16;
      break;
  }
  return k;
}

}  // namespace attn::detail
