// Internal: attention dropout, the one place that says which probabilities a
// call keeps. Every backend (reference, fused forward and backward, dense
// and varlen) asks these functions; none draws a random number of its own.
//
// What it computes. With p = dropout_p, each probability a_ij of the
// softmax is kept with probability 1 − p and scaled by 1 / (1 − p), or
// dropped (0), before the values are summed:
//   out_i = Σ_j a_ij · m_ij · v_j,   m_ij ∈ {0, 1 / (1 − p)},
// the normalisation (and lse) being that of a, as in PyTorch and
// FlashAttention. The attention weights a call returns are a ∘ m (what
// multiplies V). Backward, with D_i = Σ_e dY_ie·Y_ie as without dropout:
//   dV = (a ∘ m)ᵀ·dY,   dA = (dY·Vᵀ) ∘ m,   dZ = a ∘ (dA − D)
// (Σ_l a_il·dA_il = Σ_l a_il m_il (dY_i·v_l) = dY_i·Y_i = D_i).
//
// Which entries. m_ij is a function of (seed, offset, b, h, i, j) only:
// the Philox4x32-10 generator (Salmon et al., "Parallel random numbers: as
// easy as 1, 2, 3", SC 2011; the generator of PyTorch's and FlashAttention's
// GPU dropout), keyed by the 64-bit seed, on the counter (j / 4, i, b·H + h,
// offset), each word modulo 2^32; its four outputs serve keys 4·(j/4) ..
// 4·(j/4) + 3, and the key is dropped when its word is below p · 2^32
// (rounded). So the mask is the same for any thread count and tile size,
// and the backward regenerates it instead of storing it. (b, h, i, j) are
// the batch, query head, query row and key of the call; a packed
// variable-length batch uses its sequence index for b and positions within
// the sequence for i and j. Calls that want fresh masks change the seed or
// the offset (attn.torch draws a new seed from torch's generator per call).
#pragma once

#include <cmath>
#include <cstdint>

namespace attn::detail {

struct Dropout {
  double p = 0;               // the drop probability; 0 = off
  uint64_t seed = 0, offset = 0;
  int64_t batch_origin = 0;   // b of the call's first sequence in the larger call (varlen)
  uint64_t threshold = 0;     // dropped when the generator's word < threshold = round(p · 2^32)
  float keep_scale = 1;       // 1 / (1 − p); 0 when p = 1 (everything dropped)

  static Dropout of(double p, uint64_t seed, uint64_t offset, int64_t batch_origin = 0) {
    Dropout d;
    d.p = p, d.seed = seed, d.offset = offset, d.batch_origin = batch_origin;
    d.threshold = uint64_t(std::llround(std::ldexp(p, 32)));
    d.keep_scale = p < 1 ? float(1 / (1 - p)) : 0.0f;
    return d;
  }
  bool on() const { return p > 0; }

  // Philox4x32-10 on counter c with the seed as key: four 32-bit words.
  static void philox(uint32_t c[4], uint64_t key) {
    uint32_t k0 = uint32_t(key), k1 = uint32_t(key >> 32);
    for (int round = 0; round < 10; ++round) {
      const uint64_t p0 = uint64_t(0xD2511F53u) * c[0], p1 = uint64_t(0xCD9E8D57u) * c[2];
      const uint32_t n0 = uint32_t(p1 >> 32) ^ c[1] ^ k0, n2 = uint32_t(p0 >> 32) ^ c[3] ^ k1;
      c[0] = n0, c[1] = uint32_t(p1), c[2] = n2, c[3] = uint32_t(p0);
      k0 += 0x9E3779B9u, k1 += 0xBB67AE85u;
    }
  }

  // m_ij for keys j0 .. j0 + n of row i of (b, h), H query heads: 0 or keep_scale.
  void factors(int64_t b, int64_t H, int64_t h, int64_t i, int64_t j0, int64_t n, float* m) const {
    const uint32_t bh = uint32_t(uint64_t(b + batch_origin) * uint64_t(H) + uint64_t(h));
    for (int64_t j = j0; j < j0 + n;) {
      uint32_t c[4] = {uint32_t(uint64_t(j) >> 2), uint32_t(i), bh, uint32_t(offset)};
      philox(c, seed);
      for (int64_t k = j & 3; k < 4 && j < j0 + n; ++k, ++j) m[j - j0] = c[k] < threshold ? 0.0f : keep_scale;
    }
  }
};

}  // namespace attn::detail
