// attn-gemm-bench: the multi-head layer's matrix products alone, through the
// same detail::gemm (OpenBLAS, OpenMP build) the layer calls, so that
// bench/compare_torch.py --gemm can put them beside torch.matmul on the same
// shapes and split the layer's time into projections and attention.
//
// Each shape is M,N,K,ta,tb: C[M×N] = op(A)·op(B), row-major, op(A) = Aᵀ
// when ta (A stored [K×M]), op(B) = Bᵀ when tb (B stored [N×K]). Each
// product is first validated (a sample of entries against the plain loop
// in double), then timed: the median of --reps calls after one warm-up.
//
//   attn-gemm-bench --shapes "2048,2304,768,0,1;..." [--threads 2] [--reps 9] [--json -]
#include <CLI/CLI.hpp>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/gemm/gemm.hpp"

namespace {

struct Shape {
  int64_t M, N, K;
  bool ta, tb;
};

std::vector<Shape> parse_shapes(const std::string& text) {
  std::vector<Shape> shapes;
  std::stringstream all(text);
  std::string one;
  while (std::getline(all, one, ';')) {
    if (one.empty()) continue;
    long long m, n, k;
    int ta, tb;
    if (std::sscanf(one.c_str(), "%lld,%lld,%lld,%d,%d", &m, &n, &k, &ta, &tb) != 5 || m < 1 || n < 1 || k < 1)
      throw CLI::ValidationError("--shapes", "'" + one + "' is not M,N,K,ta,tb with M, N, K >= 1");
    shapes.push_back({m, n, k, ta != 0, tb != 0});
  }
  return shapes;
}

// The largest relative error over a sample of C's entries, against the sum in double.
double sample_error(const Shape& s, const std::vector<float>& A, const std::vector<float>& B,
                    const std::vector<float>& C, std::mt19937_64& rng) {
  const int64_t lda = s.ta ? s.M : s.K, ldb = s.tb ? s.K : s.N;
  std::uniform_int_distribution<int64_t> row(0, s.M - 1), col(0, s.N - 1);
  double worst = 0;
  for (int t = 0; t < 64; ++t) {
    const int64_t i = row(rng), j = col(rng);
    double acc = 0, mag = 0;
    for (int64_t k = 0; k < s.K; ++k) {
      const double p = double(s.ta ? A[size_t(k * lda + i)] : A[size_t(i * lda + k)]) *
                       double(s.tb ? B[size_t(j * ldb + k)] : B[size_t(k * ldb + j)]);
      acc += p, mag += std::abs(p);
    }
    worst = std::max(worst, std::abs(double(C[size_t(i * s.N + j)]) - acc) / std::max(mag, 1e-30));
  }
  return worst;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"attn-gemm-bench: the multi-head layer's GEMMs (detail::gemm) timed alone"};
  std::string shapes_text, json_path;
  int threads = 2, reps = 9;
  app.add_option("--shapes", shapes_text, "M,N,K,ta,tb;...")->required();
  app.add_option("--threads", threads, "OpenMP threads (OpenBLAS's OpenMP build uses the same pool)")
      ->check(CLI::Range(1, 256));
  app.add_option("--reps", reps, "timed calls per shape")->check(CLI::Range(1, 1000));
  app.add_option("--json", json_path, "write the results as JSON here ('-' = stdout, instead of the table)");
  CLI11_PARSE(app, argc, argv);
  std::vector<Shape> shapes;
  try {
    shapes = parse_shapes(shapes_text);
  } catch (const CLI::Error& e) {
    return app.exit(e);
  }
  omp_set_num_threads(threads);
  std::mt19937_64 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  nlohmann::json rows = nlohmann::json::array();
  const bool table = json_path != "-";
  if (table) std::printf("%6s %6s %6s %2s %2s %10s %9s %9s\n", "M", "N", "K", "ta", "tb", "median ms", "GFLOP/s", "rel err");
  for (const Shape& s : shapes) {
    std::vector<float> A(size_t(s.M * s.K)), B(size_t(s.K * s.N)), C(size_t(s.M * s.N));
    for (auto& x : A) x = nd(rng);
    for (auto& x : B) x = nd(rng);
    auto call = [&] {
      attn::detail::gemm<float>({s.M, s.N, s.K}, s.ta, A.data(), s.ta ? s.M : s.K, s.tb, B.data(),
                                s.tb ? s.K : s.N, C.data(), s.N);
    };
    call();  // warm-up, and the product validated
    const double err = sample_error(s, A, B, C, rng);
    if (!(err < 1e-5)) {
      std::fprintf(stderr, "attn-gemm-bench: %lld,%lld,%lld: relative error %.2e against the double sum\n",
                   (long long)s.M, (long long)s.N, (long long)s.K, err);
      return 1;
    }
    std::vector<double> t;
    for (int r = 0; r < reps; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      call();
      t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(t.begin(), t.end());
    const double med = t[t.size() / 2], gflops = 2.0 * double(s.M) * double(s.N) * double(s.K) / med * 1e-9;
    rows.push_back({{"M", s.M}, {"N", s.N}, {"K", s.K}, {"ta", s.ta}, {"tb", s.tb}, {"median_s", med},
                    {"gflops", gflops}, {"rel_err", err}});
    if (table)
      std::printf("%6lld %6lld %6lld %2d %2d %10.3f %9.1f %9.1e\n", (long long)s.M, (long long)s.N, (long long)s.K,
                  int(s.ta), int(s.tb), med * 1e3, gflops, err);
  }
  const nlohmann::json doc{{"threads", threads}, {"reps", reps}, {"results", rows}};
  if (json_path == "-") {
    std::printf("%s\n", doc.dump().c_str());
  } else if (!json_path.empty()) {
    std::FILE* f = std::fopen(json_path.c_str(), "w");
    if (!f) {
      std::fprintf(stderr, "attn-gemm-bench: cannot write %s\n", json_path.c_str());
      return 3;
    }
    std::fprintf(f, "%s\n", doc.dump(2).c_str());
    std::fclose(f);
  }
  return 0;
}
