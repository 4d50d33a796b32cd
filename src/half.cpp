// The scalar conversions of the public half types (attn/half.hpp), on the
// library's one implementation of them: the KV cache's storage conversions
// (src/kernels/decode/decode.cpp).
#include "attn/half.hpp"

#include "kernels/decode/decode.hpp"

namespace attn {

namespace {
template <HalfFormat F>
constexpr detail::KVStorage storage = F == HalfFormat::ieee_binary16 ? detail::KVStorage::f16 : detail::KVStorage::bf16;
}

#define ATTN_HALF_CONVERSIONS(F)                                                              \
  template <>                                                                                 \
  Half16<F>::Half16(float x) {                                                                \
    detail::convert_to_storage(storage<F>, &x, 1, 1, &bits);                                  \
  }                                                                                           \
  template <>                                                                                 \
  Half16<F>::operator float() const {                                                         \
    float y;                                                                                  \
    detail::convert_from_storage(storage<F>, &bits, 1, &y);                                   \
    return y;                                                                                 \
  }
ATTN_HALF_CONVERSIONS(HalfFormat::ieee_binary16)
ATTN_HALF_CONVERSIONS(HalfFormat::brain_float)
#undef ATTN_HALF_CONVERSIONS

}  // namespace attn
