// `attn mha`: PyTorch state_dict names, against a multi-head computation
// written out here.
#include "cli_test.hpp"

#include <cmath>
#include <map>
#include <random>
#include <vector>

#include "testing.hpp"

namespace attn_cli_test {
namespace {

using attn::io::Array;
using attn::io::DType;

// ---- mha: PyTorch state_dict names, against a multi-head computation written out ----

struct MhaParams {
  int64_t D, H;
  std::vector<double> win, bin, wout, bout;  // [3D, D], [3D], [D, D], [D]
};

// Y = concat_h(softmax(Q_h K_hᵀ / sqrt(E)) V_h) W_outᵀ + b_out, with Q = X W_qᵀ + b_q etc.
void mha_by_hand(const MhaParams& p, const std::vector<double>& x, int64_t B, int64_t N, bool causal,
                 std::vector<double>& y, std::vector<double>& a) {
  const int64_t D = p.D, H = p.H, E = D / H;
  y.assign(size_t(B * N * D), 0);
  a.assign(size_t(B * H * N * N), 0);
  for (int64_t b = 0; b < B; ++b) {
    std::vector<double> qkv(size_t(N * 3 * D));
    for (int64_t n = 0; n < N; ++n)
      for (int64_t o = 0; o < 3 * D; ++o) {
        double s = p.bin.empty() ? 0 : p.bin[size_t(o)];
        for (int64_t i = 0; i < D; ++i) s += x[size_t((b * N + n) * D + i)] * p.win[size_t(o * D + i)];
        qkv[size_t(n * 3 * D + o)] = s;
      }
    std::vector<double> concat(size_t(N * D), 0);
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < N; ++i) {
        std::vector<double> s(static_cast<size_t>(N));
        double mx = -1e300, sum = 0;
        for (int64_t j = 0; j < N; ++j) {
          double d = 0;
          for (int64_t e = 0; e < E; ++e) d += qkv[size_t(i * 3 * D + h * E + e)] * qkv[size_t(j * 3 * D + D + h * E + e)];
          s[size_t(j)] = (causal && j > i) ? -INFINITY : d / std::sqrt(double(E));
          mx = std::max(mx, s[size_t(j)]);
        }
        for (auto& z : s) sum += (z = std::exp(z - mx));
        for (int64_t j = 0; j < N; ++j) {
          const double w = s[size_t(j)] / sum;
          a[size_t(((b * H + h) * N + i) * N + j)] = w;
          for (int64_t e = 0; e < E; ++e) concat[size_t(i * D + h * E + e)] += w * qkv[size_t(j * 3 * D + 2 * D + h * E + e)];
        }
      }
    for (int64_t n = 0; n < N; ++n)
      for (int64_t o = 0; o < D; ++o) {
        double s = p.bout.empty() ? 0 : p.bout[size_t(o)];
        for (int64_t i = 0; i < D; ++i) s += concat[size_t(n * D + i)] * p.wout[size_t(o * D + i)];
        y[size_t((b * N + n) * D + o)] = s;
      }
  }
}

TEST_F(Cli, MhaWithPytorchStateDictAgreesWithAHandWrittenComputation) {
  std::mt19937_64 rng(7);
  std::normal_distribution<double> nd(0, 0.4);
  MhaParams p{8, 2, {}, {}, {}, {}};
  auto fill = [&](std::vector<double>& v, size_t n) {
    v.resize(n);
    for (auto& z : v) z = nd(rng);
  };
  fill(p.win, size_t(3 * p.D * p.D));
  fill(p.bin, size_t(3 * p.D));
  fill(p.wout, size_t(p.D * p.D));
  fill(p.bout, size_t(p.D));
  std::map<std::string, Array<double>> sd;
  sd["in_proj_weight"] = {{3 * p.D, p.D}, p.win, DType::f64};
  sd["in_proj_bias"] = {{3 * p.D}, p.bin, DType::f64};
  sd["out_proj.weight"] = {{p.D, p.D}, p.wout, DType::f64};
  sd["out_proj.bias"] = {{p.D}, p.bout, DType::f64};
  attn::io::write_safetensors(path("w.safetensors"), sd);
  const int64_t B = 2, N = 5;
  const auto x = write_random<double>("x.npy", {B, N, p.D}, rng);
  for (bool causal : {false, true}) {
    const Result r = run(std::string("mha --weights w.safetensors --x x.npy --heads 2 --out y.npy --weights-out a.npy") +
                         (causal ? " --causal" : ""));
    ASSERT_EQ(r.rc, 0) << r.err;
    std::vector<double> y, a;
    mha_by_hand(p, x, B, N, causal, y, a);
    const auto fy = attn::io::read_npy<double>(path("y.npy"));
    const auto fa = attn::io::read_npy<double>(path("a.npy"));
    ASSERT_EQ(fy.shape, (std::vector<int64_t>{B, N, p.D}));
    ASSERT_EQ(fa.shape, (std::vector<int64_t>{B, p.H, N, N}));
    const double tol = attn::testing::tolerance<double>(3 * p.D * N, 4.0);
    for (size_t i = 0; i < y.size(); ++i) EXPECT_NEAR(fy.data[i], y[i], tol) << "y " << i << " causal " << causal;
    for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(fa.data[i], a[i], tol) << "a " << i << " causal " << causal;
  }
  // Unbatched float32 input, no biases.
  std::map<std::string, Array<float>> sf;
  sf["in_proj_weight"] = {{3 * p.D, p.D}, std::vector<float>(p.win.begin(), p.win.end()), DType::f32};
  sf["out_proj.weight"] = {{p.D, p.D}, std::vector<float>(p.wout.begin(), p.wout.end()), DType::f32};
  attn::io::write_safetensors(path("wf.safetensors"), sf);
  const auto xf = write_random<float>("xf.npy", {N, p.D}, rng);
  const Result r = run("mha --weights wf.safetensors --x xf.npy --heads 4 --out yf.npy");
  ASSERT_EQ(r.rc, 0) << r.err;
  MhaParams pf{p.D, 4, {}, {}, {}, {}};
  pf.win.assign(sf["in_proj_weight"].data.begin(), sf["in_proj_weight"].data.end());
  pf.wout.assign(sf["out_proj.weight"].data.begin(), sf["out_proj.weight"].data.end());
  std::vector<double> y, a;
  mha_by_hand(pf, std::vector<double>(xf.begin(), xf.end()), 1, N, false, y, a);
  const auto fy = attn::io::read_npy<double>(path("yf.npy"));
  EXPECT_EQ(fy.stored, DType::f32);
  ASSERT_EQ(fy.shape, (std::vector<int64_t>{N, p.D}));
  for (size_t i = 0; i < y.size(); ++i) EXPECT_NEAR(fy.data[i], y[i], attn::testing::tolerance<float>(3 * p.D * N, 4.0)) << i;
}

}  // namespace
}  // namespace attn_cli_test
