// A self-contained attention test case: owns q, k, v, masks and outputs, and
// runs forward/backward through the public API. Used by the SDPA tests of
// every backend.
#pragma once

#include <optional>

#include "testing.hpp"

namespace attn::testing {

struct CaseShape {
  int64_t B = 1, H = 1, Hkv = 1, L = 4, S = 4, E = 8, Ev = 8;
  bool bnhd = false;     // store q/k/v/out as (B, N, H, d) instead of (B, H, N, d)
  int64_t pad = 0;       // extra elements after each row of q/k/v (non-contiguous strides)
};

enum class MaskKind { none, bool_full, bool_broadcast, bias_full, bias_broadcast, key_lengths };

template <class T>
struct SdpaCase {
  CaseShape s;
  Tensor<T> qbuf, kbuf, vbuf, obuf;
  Tensor<bool> mask;
  Tensor<T> bias;
  Tensor<int64_t> key_lengths;
  SdpaArgs<T> args;
  SdpaOptions opt;

  static View4<T> make_view(Tensor<T>& buf, int64_t B, int64_t H, int64_t N, int64_t F, bool bnhd, int64_t pad) {
    // Rows of F features followed by `pad` unused elements.
    const int64_t row = F + pad;
    if (bnhd) return View4<T>(buf.data(), {B, H, N, F}, {N * H * row, row, H * row, 1});
    return View4<T>(buf.data(), {B, H, N, F}, {H * N * row, N * row, row, 1});
  }

  SdpaCase(const CaseShape& shape, std::mt19937_64& rng, double stddev = 1.0) : s(shape) {
    qbuf = random_tensor<T>({s.B * s.H * s.L * (s.E + s.pad)}, rng, stddev);
    kbuf = random_tensor<T>({s.B * s.Hkv * s.S * (s.E + s.pad)}, rng, stddev);
    vbuf = random_tensor<T>({s.B * s.Hkv * s.S * (s.Ev + s.pad)}, rng, 1.0);
    obuf = Tensor<T>({s.B * s.H * s.L * (s.Ev + s.pad)});
    args.q = make_view(qbuf, s.B, s.H, s.L, s.E, s.bnhd, s.pad);
    args.k = make_view(kbuf, s.B, s.Hkv, s.S, s.E, s.bnhd, s.pad);
    args.v = make_view(vbuf, s.B, s.Hkv, s.S, s.Ev, s.bnhd, s.pad);
  }

  View4<T> out() { return make_view(obuf, s.B, s.H, s.L, s.Ev, s.bnhd, s.pad); }

  // Adds a mask of the given kind; a few query rows are fully masked on purpose.
  void add_mask(MaskKind kind, std::mt19937_64& rng) {
    std::bernoulli_distribution keep(0.7);
    auto dims = [&](bool broadcast) -> std::vector<int64_t> {
      return broadcast ? std::vector<int64_t>{1, s.H > 1 ? s.H : 1, s.L, s.S} : std::vector<int64_t>{s.B, s.H, s.L, s.S};
    };
    switch (kind) {
      case MaskKind::none: break;
      case MaskKind::bool_full:
      case MaskKind::bool_broadcast: {
        mask = Tensor<bool>(dims(kind == MaskKind::bool_broadcast));
        for (size_t i = 0; i < mask.size(); ++i) mask[i] = keep(rng);
        // Fully mask query row 0 of the first (b, h) slice.
        for (int64_t j = 0; j < s.S; ++j) mask[size_t(j)] = false;
        args.mask = mask.view4();
        break;
      }
      case MaskKind::bias_full:
      case MaskKind::bias_broadcast: {
        bias = random_tensor<T>(dims(kind == MaskKind::bias_broadcast), rng, 1.0);
        for (size_t i = 0; i < bias.size(); ++i)
          if (!keep(rng)) bias[i] = -std::numeric_limits<T>::infinity();
        for (int64_t j = 0; j < s.S; ++j) bias[size_t(j)] = -std::numeric_limits<T>::infinity();
        args.bias = bias.view4();
        break;
      }
      case MaskKind::key_lengths: {
        key_lengths = Tensor<int64_t>({s.B});
        std::uniform_int_distribution<int64_t> len(0, s.S);
        for (int64_t b = 0; b < s.B; ++b) key_lengths[size_t(b)] = len(rng);
        key_lengths[0] = 0;  // batch 0 sees no key at all
        args.key_lengths = View1<const int64_t>(key_lengths.data(), {s.B});
        break;
      }
    }
  }

  Tensor<T> forward(Tensor<T>* weights = nullptr, Tensor<T>* lse = nullptr) {
    View4<T> w;
    View3<T> l;
    if (weights) {
      *weights = Tensor<T>({s.B, s.H, s.L, s.S});
      w = weights->view4();
    }
    if (lse) {
      *lse = Tensor<T>({s.B, s.H, s.L});
      l = lse->template view<3>();
    }
    scaled_dot_product_attention<T>(args, {out(), w, l}, opt);
    // Return the output as a contiguous (B, H, L, Ev) tensor.
    Tensor<T> y({s.B, s.H, s.L, s.Ev});
    auto o = out();
    for (int64_t b = 0; b < s.B; ++b)
      for (int64_t h = 0; h < s.H; ++h)
        for (int64_t i = 0; i < s.L; ++i)
          for (int64_t e = 0; e < s.Ev; ++e) y.view4()(b, h, i, e) = o(b, h, i, e);
    return y;
  }

  struct Grads {
    Tensor<T> dq, dk, dv, dbias;
  };
  Grads backward(const Tensor<T>& dout, bool want_dbias) {
    Grads g{Tensor<T>({s.B, s.H, s.L, s.E}), Tensor<T>({s.B, s.Hkv, s.S, s.E}),
            Tensor<T>({s.B, s.Hkv, s.S, s.Ev}), {}};
    SdpaGrads<T> sg{g.dq.view4(), g.dk.view4(), g.dv.view4(), {}};
    if (want_dbias) {
      g.dbias = Tensor<T>(bias.shape());
      sg.dbias = g.dbias.view4();
    }
    scaled_dot_product_attention_backward<T>(args, dout.view4(), {}, sg, opt);
    return g;
  }
};

}  // namespace attn::testing
