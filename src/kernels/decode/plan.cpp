// The decode kernel's scalar side (no SIMD): how a call is cut into units
// (decode_plan), which requests take the kernel (decode_suits_rows,
// decode_suits_dense), the decode problem of a dense call, and the rounding
// of float32 into the storage types. The kernel itself is decode.cpp.
#include <algorithm>
#include <cstring>

#include "attn/half.hpp"
#include "kernels/decode/decode.hpp"
#include "kernels/fused/common.hpp"

namespace attn::detail {

DecodePlan decode_plan(const DecodeProblem& p) {
  using namespace decode_common;
  DecodePlan plan;
  const int64_t M = p.group() * p.L;
  const int64_t nrb = ceil_div(M, kMaxRows);
  plan.rows = ceil_div(M, nrb);  // balanced row blocks of at most kMaxRows
  // Keys per tile: 128 for rows of 128 features (64 KiB of float32 keys),
  // 16384 / E for wider rows, 64 for narrower ones. Measured on Zen 4 with
  // 2 threads (docs/decode.md): against the earlier 16 KiB tiles (32 keys at
  // E = 128) float32 decoding at E = 128 took 10-17% less time (G = 1 and
  // G = 4) and bfloat16 the same; at E = 64 longer tiles helped float32 with
  // G = 4 but slowed bfloat16, so those stay at 64; E = 256 was neutral.
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
  return plan;
}

bool decode_suits_rows(int64_t L, int64_t G) { return L <= 32 && G * L <= decode_common::kMaxRows; }

bool decode_suits_dense(const Problem& p, const SdpaArgs<float>&, bool want_weights) {
  // Every score rule is the kernel's own (masks and bias included), and any
  // strides (features that are not contiguous are gathered per tile).
  return !want_weights && decode_suits_rows(p.L, p.group());
}

DecodeProblem DecodeProblem::of(const Problem& p, const SdpaArgs<float>& a) {
  const View1<const int64_t>& key_lengths = a.key_lengths;
  const View1<const float>& alibi_slopes = a.alibi_slopes;
  const View1<const float>& sinks = a.sinks;
  DecodeProblem d;
  d.B = p.B, d.H = p.H, d.Hkv = p.Hkv, d.L = p.L, d.E = p.E, d.Ev = p.Ev;
  d.scale = p.scale;
  d.causal = p.causal;
  d.window_left = p.window_left, d.window_right = p.window_right;
  d.softcap = p.softcap;
  d.mask = a.mask;
  d.bias = a.bias;
  for (int64_t h = 0; h < alibi_slopes.dim(0); ++h) d.slopes.push_back(alibi_slopes(h));
  for (int64_t h = 0; h < sinks.dim(0); ++h) d.sinks.push_back(sinks(h));
  d.threads = p.threads;
  d.offset.assign(size_t(p.B), p.offset());
  d.length.resize(size_t(p.B));
  for (int64_t b = 0; b < p.B; ++b) d.length[size_t(b)] = key_lengths.empty() ? p.S : key_lengths(b);
  return d;
}

void decode_forward_dense(const Problem& p, const SdpaArgs<float>& a, View4<float> out, View3<float> lse) {
  decode_forward(DecodeProblem::of(p, a),
                 KVLayout::dense(KVStorage::f32, a.k, a.v), a.q, out, lse);
}

// ---- storage conversions ----------------------------------------------------

void convert_to_storage(KVStorage t, const float* x, int64_t stride, int64_t n, void* dst) {
  switch (t) {
    case KVStorage::f32: {
      float* y = static_cast<float*>(dst);
      for (int64_t i = 0; i < n; ++i) y[i] = x[i * stride];
      return;
    }
    case KVStorage::f16: {  // the public types hold the one rounding rule (src/half.cpp)
      uint16_t* y = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) y[i] = attn::float16_t(x[i * stride]).bits;
      return;
    }
    case KVStorage::bf16: {
      uint16_t* y = static_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) y[i] = attn::bfloat16_t(x[i * stride]).bits;
      return;
    }
  }
}

}  // namespace attn::detail
