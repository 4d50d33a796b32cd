// The scalar conversions of the public half types (attn/half.hpp). They are
// the library's one statement of the rounding: the KV cache's storage
// conversions (src/kernels/decode/decode.cpp) narrow through them, and widen
// with vector loads that give the same exact values. Plain C++ on the bits,
// so any compiler and target gets the same results (and the file parsers,
// which read float16 .npy files, need no SIMD code).
#include "attn/half.hpp"

#include <algorithm>
#include <string>

#include "kernels/decode/decode.hpp"
#include "kernels/fused/bf16.hpp"
#include "validate.hpp"

#include <cmath>
#include <cstdint>
#include <cstring>

namespace attn {

namespace {
uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}
float float_of(uint32_t b) {
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}
}  // namespace

// binary16: 1 sign, 5 exponent (bias 15), 10 mantissa bits.
template <>
float16_t::Half16(float x) {
  const uint32_t f = bits_of(x);
  const auto sign = uint16_t((f >> 16) & 0x8000u);
  const uint32_t a = f & 0x7FFFFFFFu;
  if (a > 0x7F800000u) {  // NaN: stays a quiet NaN, top payload bits kept
    bits = uint16_t(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
  } else if (a >= 0x477FF000u) {  // >= 65520 (halfway above 65504) rounds to infinity
    bits = uint16_t(sign | 0x7C00u);
  } else if (a < 0x38800000u) {  // below 2^-14: a subnormal (or zero), mantissa = round(|x|·2^24)
    bits = uint16_t(sign | uint16_t(std::nearbyint(float_of(a) * 16777216.0f)));  // exact scaling, ties to even
  } else {  // normal: rebias the exponent (127 → 15), round 23 mantissa bits to 10, ties to even
    const uint32_t r = a - 0x38000000u;
    bits = uint16_t(sign | ((r + 0x0FFFu + ((r >> 13) & 1u)) >> 13));
  }
}

template <>
float16_t::operator float() const {
  const uint32_t sign = uint32_t(bits & 0x8000u) << 16, e = (bits >> 10) & 0x1Fu, m = bits & 0x3FFu;
  if (e == 0) {  // zero or subnormal: m·2^-24, exact in float
    const float v = float(m) * 0x1p-24f;
    return sign ? -v : v;
  }
  if (e == 0x1F) return float_of(sign | 0x7F800000u | (m << 13));  // infinity, NaN
  return float_of(sign | ((e + 112u) << 23) | (m << 13));
}

// bfloat16: the top 16 bits of a float.
template <>
bfloat16_t::Half16(float x) : bits(detail::bf16_round(bits_of(x))) {}  // nearest even, NaN stays NaN

template <>
bfloat16_t::operator float() const {
  return float_of(uint32_t(bits) << 16);
}

namespace {
constexpr detail::NamedValue<Dtype> kDtypes[] = {
    {Dtype::float32, "float32", "f32"}, {Dtype::float16, "float16", "f16"}, {Dtype::bfloat16, "bfloat16", "bf16"}};
}  // namespace

const char* dtype_name(Dtype t) { return detail::name_of(kDtypes, t); }

Dtype parse_dtype(std::string_view name) { return detail::Checker{"parse_dtype"}.parse(kDtypes, name, "dtype"); }

// Bulk conversions (attn/half.hpp): blocks of 2^14 values, each block one
// call of the plain row conversions below (this file stays free of SIMD
// code), on the calling thread below 2^16 values.
namespace {
template <class F>
void convert_blocks(const char* fn, const void* src, int64_t n, const void* dst, size_t src_size,
                    size_t dst_size, int num_threads, const F& block) {
  const detail::Checker c{fn};
  const int threads = c.threads(num_threads);
  if (n < 0) c.fail("argument 'n' is " + std::to_string(n) + ", expected n >= 0");
  if (n == 0) return;
  if (!src) c.fail("argument 'src' is null");
  if (!dst) c.fail("argument 'dst' is null");
  const auto s = reinterpret_cast<uintptr_t>(src), d = reinterpret_cast<uintptr_t>(dst);
  if (uint64_t(n) > UINTPTR_MAX / 8 || (s < d + uintptr_t(n) * dst_size && d < s + uintptr_t(n) * src_size))
    c.fail("arguments 'src' and 'dst' overlap");
  constexpr int64_t kBlock = int64_t(1) << 14;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && n >= (int64_t(1) << 16))
  for (int64_t b = 0; b < blocks; ++b) block(b * kBlock, std::min(kBlock, n - b * kBlock));
}
}  // namespace

void to_float(const float16_t* src, int64_t n, float* dst, int num_threads) {
  convert_blocks("to_float", src, n, dst, 2, 4, num_threads,
                 [&](int64_t i, int64_t m) { detail::widen_from_storage(Dtype::float16, src + i, m, dst + i); });
}
void to_float(const bfloat16_t* src, int64_t n, float* dst, int num_threads) {
  convert_blocks("to_float", src, n, dst, 2, 4, num_threads,
                 [&](int64_t i, int64_t m) { detail::widen_from_storage(Dtype::bfloat16, src + i, m, dst + i); });
}
void from_float(const float* src, int64_t n, float16_t* dst, int num_threads) {
  convert_blocks("from_float", src, n, dst, 4, 2, num_threads,
                 [&](int64_t i, int64_t m) { detail::convert_to_storage(Dtype::float16, src + i, 1, m, dst + i); });
}
void from_float(const float* src, int64_t n, bfloat16_t* dst, int num_threads) {
  convert_blocks("from_float", src, n, dst, 4, 2, num_threads,
                 [&](int64_t i, int64_t m) { detail::convert_to_storage(Dtype::bfloat16, src + i, 1, m, dst + i); });
}

namespace detail {

// The contiguous bfloat16 rows of the bulk conversions and the cache's
// appends and reads: the scalar arithmetic in loops the compiler vectorises,
// compiled for the baseline and, on x86, once more for AVX-512 (16 lanes
// where the baseline has 4; the same integer operations, so the same bits):
// rounding 2^14 values took 5.6 µs on one Zen 4 core with the baseline
// loop, 2.0 µs with the AVX-512 one.
namespace {
[[gnu::always_inline]] inline void round_loop(const float* x, int64_t n, uint16_t* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = bf16_round(bits_of(x[i]));
}
[[gnu::always_inline]] inline void widen_loop(const uint16_t* h, int64_t n, float* y) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = uint32_t(h[i]) << 16;
    std::memcpy(y + i, &b, 4);
  }
}
void round_rows(const float* x, int64_t n, uint16_t* y) { round_loop(x, n, y); }
void widen_rows(const uint16_t* h, int64_t n, float* y) { widen_loop(h, n, y); }
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define ATTN_HALF_WIDE [[gnu::target("avx512f,avx512bw")]]
bool cpu_wide() { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"); }
#else
#define ATTN_HALF_WIDE
bool cpu_wide() { return false; }
#endif
ATTN_HALF_WIDE void round_rows_wide(const float* x, int64_t n, uint16_t* y) { round_loop(x, n, y); }
ATTN_HALF_WIDE void widen_rows_wide(const uint16_t* h, int64_t n, float* y) { widen_loop(h, n, y); }
#undef ATTN_HALF_WIDE
}  // namespace

bool bf16_rows_wide() {
  static const bool yes = cpu_wide();
  return yes;
}
void bf16_round_rows(const float* x, int64_t n, uint16_t* y, bool wide) {
  (wide && bf16_rows_wide() ? round_rows_wide : round_rows)(x, n, y);
}
void bf16_widen_rows(const uint16_t* h, int64_t n, float* y, bool wide) {
  (wide && bf16_rows_wide() ? widen_rows_wide : widen_rows)(h, n, y);
}

// The KV cache's rows (kernels/decode/decode.hpp): the half types' rounding
// above on the way in; exact widening on the way out (the decode kernel's
// vector widening, convert_from_storage, gives the same bits).
void convert_to_storage(Dtype t, const float* x, int64_t stride, int64_t n, void* dst) {
  switch (t) {
    case Dtype::float32: {
      float* y = static_cast<float*>(dst);
      for (int64_t i = 0; i < n; ++i) y[i] = x[i * stride];
      return;
    }
    case Dtype::float16: {
      uint16_t* y = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) y[i] = attn::float16_t(x[i * stride]).bits;
      return;
    }
    case Dtype::bfloat16: {
      uint16_t* y = static_cast<uint16_t*>(dst);
      if (stride == 1)  // (bfloat16_t(x) is bf16_round of x's bits)
        bf16_round_rows(x, n, y, true);
      else
        for (int64_t i = 0; i < n; ++i) y[i] = attn::bfloat16_t(x[i * stride]).bits;
      return;
    }
  }
}

void widen_from_storage(Dtype t, const void* src, int64_t n, float* y) {
  switch (t) {
    case Dtype::float32:
      std::memcpy(y, src, size_t(n) * 4);
      return;
    case Dtype::float16:
      for (int64_t i = 0; i < n; ++i) y[i] = float16_t::from_bits(static_cast<const uint16_t*>(src)[i]);
      return;
    case Dtype::bfloat16:  // the bits moved up (bfloat16_t's float())
      return bf16_widen_rows(static_cast<const uint16_t*>(src), n, y, true);
  }
}

}  // namespace detail

}  // namespace attn
