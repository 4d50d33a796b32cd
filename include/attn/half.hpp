// attn/half.hpp — the two 16-bit floating-point storage types.
//
//   float16_t   IEEE 754 binary16: 1 sign, 5 exponent, 10 mantissa bits
//               (NumPy float16, torch.float16).
//   bfloat16_t  the upper half of a float32: 1 sign, 8 exponent, 7 mantissa
//               bits (torch.bfloat16, ml_dtypes.bfloat16).
//
// They are storage types only: attn never computes in them. Widening to
// float is exact and implicit (float f = h); narrowing from float rounds to
// nearest even and is explicit (float16_t(x)); NaN stays NaN, values beyond
// the float16 range become ±inf. The conversions are the library's one
// implementation (the same the KV cache uses on append), so a value rounded
// here is bit for bit the value the cache stores.
//
// Where they are accepted: q, k, v of scaled_dot_product_attention and its
// backward (attn/sdpa.hpp; everything else of those calls is float32) and the
// storage of attn::KVCache (attn/kv_cache.hpp).
#pragma once

#include <cstdint>
#include <string_view>
#include <type_traits>

namespace attn {

// The storage types attn reads and writes: float32 and the two halves. One
// enum for every place that names one (a KV cache's storage, the CLI's and
// Python's dtype arguments).
enum class Dtype { float32, float16, bfloat16 };
const char* dtype_name(Dtype t);                // "float32", "float16", "bfloat16"
Dtype parse_dtype(std::string_view name);       // also "f32", "f16", "bf16"; throws attn::InvalidArgument

// One 16-bit value of the given format (float16 or bfloat16); float16_t and
// bfloat16_t below.
template <Dtype F>
struct Half16 {
  uint16_t bits = 0;
  Half16() = default;
  explicit Half16(float x);  // round to nearest even
  explicit Half16(double x) : Half16(float(x)) {}  // via float (may round twice)
  explicit Half16(int x) : Half16(float(x)) {}
  operator float() const;  // exact
  static Half16 from_bits(uint16_t b) {
    Half16 h;
    h.bits = b;
    return h;
  }
};

using float16_t = Half16<Dtype::float16>;
using bfloat16_t = Half16<Dtype::bfloat16>;

// The conversions, in the library (src/half.cpp).
template <> float16_t::Half16(float x);
template <> float16_t::operator float() const;
template <> bfloat16_t::Half16(float x);
template <> bfloat16_t::operator float() const;

// The same conversions over n contiguous values: dst[i] = float(src[i])
// (exact), or the half type of src[i] (rounded as above). On num_threads
// OpenMP threads (0: OpenMP's default) from 2^16 values on; the same bits
// for any count. src and dst must not overlap. Throws attn::InvalidArgument
// naming the argument (n < 0, a null pointer, overlap, num_threads).
void to_float(const float16_t* src, int64_t n, float* dst, int num_threads = 0);
void to_float(const bfloat16_t* src, int64_t n, float* dst, int num_threads = 0);
void from_float(const float* src, int64_t n, float16_t* dst, int num_threads = 0);
void from_float(const float* src, int64_t n, bfloat16_t* dst, int num_threads = 0);

static_assert(sizeof(float16_t) == 2 && sizeof(bfloat16_t) == 2, "the half types are 16 bits wide");

// Whether T is one of the two half storage types.
template <class T>
inline constexpr bool is_half_v = false;
template <>
inline constexpr bool is_half_v<float16_t> = true;
template <>
inline constexpr bool is_half_v<const float16_t> = true;
template <>
inline constexpr bool is_half_v<bfloat16_t> = true;
template <>
inline constexpr bool is_half_v<const bfloat16_t> = true;

// The Dtype of float and of the half types (dtype_of<float16_t> = Dtype::float16).
template <class T>
inline constexpr Dtype dtype_of = std::is_same_v<T, float16_t> ? Dtype::float16
                                  : std::is_same_v<T, bfloat16_t> ? Dtype::bfloat16
                                                                  : Dtype::float32;

}  // namespace attn
