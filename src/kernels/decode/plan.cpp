// The decode kernel's scalar side (no SIMD): how a call is cut into units
// (decode_plan), which requests take the kernel (decode_suits_rows,
// decode_suits_dense), the dense call's use of it, and the rounding
// of float32 into the storage types. The kernel itself is decode.cpp.
#include <algorithm>
#include <cstring>

#include "attn/half.hpp"
#include "kernels/decode/decode.hpp"
#include "kernels/fused/common.hpp"
#include "widen.hpp"

namespace attn::detail {

DecodePlan decode_plan(const Problem& p) {
  using namespace decode_common;
  DecodePlan plan;
  const int64_t M = p.group() * p.L;
  const int64_t nrb = ceil_div(M, kMaxRows);
  plan.rows = ceil_div(M, nrb);  // balanced row blocks of at most kMaxRows
  // Keys per tile: 128 for rows of 128 features (64 KiB of float32 keys),
  // 16384 / E for wider rows, 64 for narrower ones (docs/decode.md, "Tiles").
  // One tile for every storage type, so a half cache still gives the float32
  // call's bits on the widened values.
  const int64_t width = std::max<int64_t>({p.E, p.Ev, 1});
  plan.tile = width < 128 ? 64 : std::clamp<int64_t>(16384 / width / 8 * 8, 8, 128);
  // The longest run of keys a row block sees (the whole sequence, unless a
  // window narrows it); the chunks cut that run.
  int64_t smax = 1;
  for (int64_t b = 0; b < p.B; ++b) smax = std::max(smax, p.keys(b, p.L - 1).hi - p.keys(b, 0).lo);
  const int64_t nsplit = std::max<int64_t>(1, ceil_div(kTargetUnits, p.B * p.Hkv * nrb));
  plan.chunk = std::max(kMinChunk, round_up(ceil_div(smax, nsplit), plan.tile));
  plan.serial = double(p.B) * double(p.H * p.L) * double(smax) * double(p.E + p.Ev) < double(kMinParallelWork);
  return plan;
}

bool decode_suits_rows(int64_t L, int64_t G) { return L <= 32 && G * L <= decode_common::kMaxRows; }

bool decode_suits_dense(const Problem& p) {
  // Every score rule is the kernel's own (masks and bias included), and any
  // strides (features that are not contiguous are gathered per tile).
  return decode_suits_rows(p.L, p.group());
}

template <class T>
void decode_forward_dense(const Problem& p, const SdpaArgs<T>& a, View4<float> out, View3<float> lse) {
  const KVLayout kv = KVLayout::dense(dtype_of<T>, a.k, a.v);
  if constexpr (is_half_v<T>) {
    const Tensor<float> q = widen(a.q, p.threads);  // L rows per head; K and V stay half
    decode_forward(p, kv, q.view4(), out, lse);
  } else {
    decode_forward(p, kv, a.q, out, lse);
  }
}
template void decode_forward_dense<float>(const Problem&, const SdpaArgs<float>&, View4<float>, View3<float>);
template void decode_forward_dense<float16_t>(const Problem&, const SdpaArgs<float16_t>&, View4<float>, View3<float>);
template void decode_forward_dense<bfloat16_t>(const Problem&, const SdpaArgs<bfloat16_t>&, View4<float>,
                                               View3<float>);

}  // namespace attn::detail
