// attn-gemm-bench: the multi-head layer's matrix products alone.
//
// attn's detail::gemm, the product the layer and attn::nn call, and beside it
// (--candidates) each library it could call, on the same shapes, in one run:
//
//   attn         detail::gemm (oneDNN's sgemm per tile, the tiles on OpenMP threads)
//   openblas     cblas_sgemm of the OpenBLAS attn links (its OpenMP build), its threads
//   blis         BLIS's bli_sgemm (loaded at run time: gemm_blis.hpp), its threads
//   dnnl         oneDNN's dnnl_sgemm on the whole product, its threads
//   dnnl-matmul  oneDNN's matmul primitive, float32, created once per shape
//   dnnl-bf16    the same primitive on bfloat16 A and B (rounded before the
//                timing) with float32 accumulation and C
//   attn-bf16    attn's detail::gemm_bf16 on the float32 operands (their
//                rounding timed too), the multi-head layer's bfloat16 GEMMs
//
// --embed D,... times the six products of a packed self-attention layer with
// --rows = B·L rows and width D (forward x·W_inᵀ, o·W_oᵀ; backward dyᵀ·o,
// dy·W_o, dpᵀ·x, dp·W_in: compare_torch.py's layer_gemms); --shapes takes
// M,N,K,ta,tb;... instead: C[M×N] = op(A)·op(B), row-major, op(A) = Aᵀ when
// ta (A stored [K×M]), op(B) = Bᵀ when tb (B stored [N×K]).
//
// Each candidate's product is first validated (a sample of entries against
// the sum in double; bfloat16 against the sum of its rounded operands), then
// timed: rounds that call every candidate once in turn, in the order given
// and in reverse on every other round (so that no candidate always follows
// the same one, as compare_torch.py alternates), the median of --reps
// rounds after one warm-up. Fractions are of the FMA peak measured in the
// same run, with the same threads (fma_peak.hpp): of its GFLOP/s, and of its
// GFLOP per CPU-second against the product's (the time the process's threads
// ran, which other load on a shared machine does not lower; threads waiting
// passively for each other are not counted in it); the bfloat16 candidates'
// totals also give their fraction of the bfloat16 peak measured in the same
// run (AMX's TDPBF16PS where the CPU has it, else VDPBF16PS). Each round also
// ends with a short run of each peak (5 ms, best of three), and the totals
// give a second fraction, "of the round's peak": every call's time scaled by
// its round's peak over the first one, so that a spell in which the host
// gives the VM less (every candidate and the peak slow together) does not
// count against the products measured in it. The header names the CPU,
// the settings that force a library's choice when set (OPENBLAS_CORETYPE,
// BLIS_ARCH_TYPE, ONEDNN_MAX_CPU_ISA) and what each library chose.
//
//   attn-gemm-bench --embed 512,1024,2048 --candidates attn,openblas,blis,dnnl,dnnl-matmul,dnnl-bf16 --threads 1,2
//   attn-gemm-bench --shapes "2048,2304,768,0,1;..." [--threads 2] [--reps 9] [--json -]   (compare_torch.py --gemm)
#include <CLI/CLI.hpp>
#include <cblas.h>
#include <omp.h>

#include <oneapi/dnnl/dnnl.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "fma_peak.hpp"
#include "gemm_blis.hpp"
#include "kernels/fused/fused.hpp"
#include "kernels/gemm/gemm.hpp"

namespace {

struct Shape {
  int64_t M, N, K;
  bool ta, tb;
  int64_t lda() const { return ta ? M : K; }
  int64_t ldb() const { return tb ? K : N; }
  double flops() const { return 2.0 * double(M) * double(N) * double(K); }
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

// The products of a packed self-attention layer with R rows and width D.
std::vector<Shape> layer_shapes(int64_t R, int64_t D) {
  return {{R, 3 * D, D, false, true}, {R, D, D, false, true},    // forward: x·W_inᵀ, o·W_oᵀ
          {D, D, R, true, false},     {R, D, D, false, false},   // backward: dyᵀ·o, dy·W_o
          {3 * D, D, R, true, false}, {R, D, 3 * D, false, false}};  // dpᵀ·x, dp·W_in
}

// bfloat16 by rounding to nearest even (the operands are finite).
uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
float from_bf16(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct Operands {
  std::vector<float> A, B, C;
  std::vector<uint16_t> A16, B16;  // bfloat16 copies (dnnl-bf16)
  std::vector<float> A16f, B16f;   // their values as float, for the check
};

// The largest relative error over a sample of C's entries, against the sum in double.
double sample_error(const Shape& s, const std::vector<float>& A, const std::vector<float>& B,
                    const std::vector<float>& C, std::mt19937_64& rng) {
  const int64_t lda = s.lda(), ldb = s.ldb();
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

// A candidate: sets its thread count, then makes the call for one shape's
// operands (*picked: what it chose for that shape, where it says).
struct Candidate {
  std::string name;
  bool bf16 = false;
  std::function<void(int threads)> set_threads;
  std::function<std::function<void()>(const Shape&, Operands&, int threads, std::string* picked)> make;
};

const dnnl::engine& engine() {
  static const dnnl::engine e(dnnl::engine::kind::cpu, 0);
  return e;
}

// oneDNN's matmul on row-major operands: the transposes are strides.
std::function<void()> dnnl_matmul(const Shape& s, Operands& o, bool bf16, std::string* picked) {
  using dt = dnnl::memory::data_type;
  using dims = dnnl::memory::dims;
  const dt in = bf16 ? dt::bf16 : dt::f32;
  const dnnl::memory::desc a({s.M, s.K}, in, s.ta ? dims{1, s.lda()} : dims{s.lda(), 1});
  const dnnl::memory::desc b({s.K, s.N}, in, s.tb ? dims{1, s.ldb()} : dims{s.ldb(), 1});
  const dnnl::memory::desc c({s.M, s.N}, dt::f32, dims{s.N, 1});
  const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, b, c), engine());
  *picked = pd.impl_info_str();
  void* ap = bf16 ? static_cast<void*>(o.A16.data()) : o.A.data();
  void* bp = bf16 ? static_cast<void*>(o.B16.data()) : o.B.data();
  const dnnl::memory am(a, engine(), ap), bm(b, engine(), bp), cm(c, engine(), o.C.data());
  return [prim = dnnl::matmul(pd), am, bm, cm] {
    dnnl::stream st(engine());
    prim.execute(st, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
    st.wait();
  };
}

std::vector<Candidate> all_candidates() {
  std::vector<Candidate> c;
  const auto omp_threads = [](int t) { omp_set_num_threads(t); };
  c.push_back({"attn", false, omp_threads, [](const Shape& s, Operands& o, int t, std::string*) {
                 return std::function<void()>([&o, s, t] {
                   attn::detail::gemm<float>({s.M, s.N, s.K}, s.ta, o.A.data(), s.lda(), s.tb, o.B.data(), s.ldb(),
                                             o.C.data(), s.N, 1.0f, 0.0f, t);
                 });
               }});
  c.push_back({"attn-bf16", true, omp_threads, [](const Shape& s, Operands& o, int t, std::string*) {
                 return std::function<void()>([&o, s, t] {
                   attn::detail::gemm_bf16({s.M, s.N, s.K}, s.ta, o.A.data(), s.lda(), s.tb, o.B.data(), s.ldb(),
                                           o.C.data(), s.N, 1.0f, 0.0f, t);
                 });
               }});
  c.push_back({"openblas", false, [](int t) { openblas_set_num_threads(t), omp_set_num_threads(t); },
               [](const Shape& s, Operands& o, int, std::string*) {
                 return std::function<void()>([&o, s] {
                   cblas_sgemm(CblasRowMajor, s.ta ? CblasTrans : CblasNoTrans, s.tb ? CblasTrans : CblasNoTrans,
                               int(s.M), int(s.N), int(s.K), 1.0f, o.A.data(), int(s.lda()), o.B.data(),
                               int(s.ldb()), 0.0f, o.C.data(), int(s.N));
                 });
               }});
  c.push_back({"blis", false, [](int t) { attn_bench::blis_set_threads(t), omp_set_num_threads(t); },
               [](const Shape& s, Operands& o, int, std::string*) {
                 return std::function<void()>([&o, s] {
                   attn_bench::blis_sgemm(s.M, s.N, s.K, s.ta, o.A.data(), s.lda(), s.tb, o.B.data(), s.ldb(),
                                          o.C.data(), s.N);
                 });
               }});
  c.push_back({"dnnl", false, omp_threads, [](const Shape& s, Operands& o, int, std::string*) {
                 return std::function<void()>([&o, s] {
                   dnnl_sgemm(s.ta ? 'T' : 'N', s.tb ? 'T' : 'N', s.M, s.N, s.K, 1.0f, o.A.data(), s.lda(),
                              o.B.data(), s.ldb(), 0.0f, o.C.data(), s.N);
                 });
               }});
  c.push_back({"dnnl-matmul", false, omp_threads, [](const Shape& s, Operands& o, int, std::string* picked) {
                 return dnnl_matmul(s, o, false, picked);
               }});
  c.push_back({"dnnl-bf16", true, omp_threads, [](const Shape& s, Operands& o, int, std::string* picked) {
                 return dnnl_matmul(s, o, true, picked);
               }});
  return c;
}

constexpr double kRoundPeakSeconds = 0.005;  // each run of a round's peak (best of three)

std::string env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"attn-gemm-bench: the multi-head layer's GEMMs, attn's and candidate libraries', side by side"};
  std::string shapes_text, json_path, embed_text, candidates_text = "attn";
  std::vector<int> thread_counts{2};
  int64_t rows = 4096;
  int reps = 9;
  double peak_seconds = 0.5;
  auto* shapes_opt = app.add_option("--shapes", shapes_text, "M,N,K,ta,tb;...");
  app.add_option("--embed", embed_text, "layer widths D,...: the layer's six products at each")
      ->excludes(shapes_opt);
  app.add_option("--rows", rows, "the layer's rows B·L (with --embed)")->check(CLI::Range(int64_t(1), int64_t(1) << 20));
  app.add_option("--candidates", candidates_text, "attn,openblas,blis,dnnl,dnnl-matmul,dnnl-bf16 (any of them)");
  app.add_option("--threads", thread_counts, "thread counts, e.g. 1,2")->delimiter(',')->check(CLI::Range(1, 256));
  app.add_option("--reps", reps, "timed rounds per shape")->check(CLI::Range(1, 1000));
  app.add_option("--peak-seconds", peak_seconds, "length of each FMA-peak run (0: no peak, no fractions)")
      ->check(CLI::Range(0.0, 10.0));
  app.add_option("--json", json_path, "write the results as JSON here ('-' = stdout, instead of the table)");
  CLI11_PARSE(app, argc, argv);
  std::vector<Shape> shapes;
  try {
    if (!embed_text.empty()) {
      std::stringstream all(embed_text);
      for (std::string d; std::getline(all, d, ',');) {
        const long long D = std::atoll(d.c_str());
        if (D < 1) throw CLI::ValidationError("--embed", "'" + d + "' is not a width >= 1");
        for (const Shape& s : layer_shapes(rows, D)) shapes.push_back(s);
      }
    } else {
      shapes = parse_shapes(shapes_text);
    }
    if (shapes.empty()) throw CLI::ValidationError("--shapes/--embed", "no shape given");
  } catch (const CLI::Error& e) {
    return app.exit(e);
  }

  // The candidates asked for, and what each library chose for this CPU.
  std::vector<Candidate> cands;
  {
    const std::vector<Candidate> known = all_candidates();
    std::stringstream all(candidates_text);
    for (std::string name; std::getline(all, name, ',');) {
      const auto it = std::find_if(known.begin(), known.end(), [&](const Candidate& c) { return c.name == name; });
      if (it == known.end()) {
        std::fprintf(stderr, "attn-gemm-bench: unknown candidate '%s'\n", name.c_str());
        return 2;
      }
      cands.push_back(*it);
    }
  }
  std::map<std::string, std::string> chose{
      {"attn, dnnl", attn::detail::gemm_backend_description()},
      {"openblas", std::string(openblas_get_corename()) + " (" + openblas_get_config() + ")"}};
  if (std::any_of(cands.begin(), cands.end(), [](const Candidate& c) { return c.name == "blis"; })) {
    std::string arch, why;
    if (!attn_bench::blis_open(&arch, &why)) {
      std::fprintf(stderr, "attn-gemm-bench: blis: %s\n", why.c_str());
      return 2;
    }
    chose["blis"] = "BLIS, configuration " + arch;
  }
  const bool table = json_path != "-";
  double load[3] = {0, 0, 0};
  if (getloadavg(load, 3) != 3) load[0] = load[1] = load[2] = -1;
  if (table) {
    std::printf("CPU: %s; SIMD target %s; load average %.2f %.2f %.2f\n", attn_bench::cpu_model().c_str(),
                attn::detail::fused_target_name(), load[0], load[1], load[2]);
    std::printf("set: OPENBLAS_CORETYPE=%s BLIS_ARCH_TYPE=%s ONEDNN_MAX_CPU_ISA=%s OMP_NUM_THREADS=%s\n",
                env_or("OPENBLAS_CORETYPE", "-").c_str(), env_or("BLIS_ARCH_TYPE", "-").c_str(),
                env_or("ONEDNN_MAX_CPU_ISA", "-").c_str(), env_or("OMP_NUM_THREADS", "-").c_str());
    for (const auto& [lib, what] : chose) std::printf("  %-10s %s\n", lib.c_str(), what.c_str());
  }

  std::mt19937_64 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  nlohmann::json rows_json = nlohmann::json::array(), summary = nlohmann::json::array();
  std::map<int, std::pair<double, double>> peaks;  // threads -> wall, per CPU-second
  for (const int threads : thread_counts) {
    double peak = 0, per_cpu = 0;
    if (peak_seconds > 0) peak = attn_bench::fma_peak_gflops(threads, peak_seconds, &per_cpu);
    peaks[threads] = {peak, per_cpu};
    // The bfloat16 candidates' own limit: AMX's tiles where the CPU has them, else VDPBF16PS.
    const bool amx = peak_seconds > 0 && attn_bench::amx_peak_gflops(threads, 0.001) > 0;
    const auto bf16_peak_of = [amx](int n, double seconds) {
      return amx ? attn_bench::amx_peak_gflops(n, seconds) : attn_bench::dpbf16_peak_gflops(n, seconds);
    };
    const double bf16_peak = peak_seconds > 0 ? bf16_peak_of(threads, peak_seconds) : 0;
    const char* bf16_peak_what = amx ? "AMX bfloat16 peak (TDPBF16PS, tiles in registers)"
                                     : "AVX512_BF16 peak (VDPBF16PS, 512-bit, 12 chains a thread)";
    if (table) {
      std::printf("\n%d thread%s; FMA peak %.1f GFLOP/s (%.1f per CPU-second)\n", threads, threads > 1 ? "s" : "",
                  peak, per_cpu);
      if (bf16_peak > 0)
        std::printf("%s %.1f GFLOP/s: the bfloat16 rows' own limit\n", bf16_peak_what, bf16_peak);
      std::printf("%6s %6s %6s %2s %2s %-12s %9s %8s %6s %8s %6s %8s  %s\n", "M", "N", "K", "ta", "tb", "candidate",
                  "median ms", "GFLOP/s", "% peak", "GF/cpu-s", "% peak", "rel err", "picked");
    }
    std::vector<double> total_s(cands.size(), 0.0), total_cpu(cands.size(), 0.0), total_scaled(cands.size(), 0.0);
    const bool any_bf16 = std::any_of(cands.begin(), cands.end(), [](const Candidate& c) { return c.bf16; });
    std::vector<double> worst(cands.size(), 1e300), best(cands.size(), 0.0);
    double total_flops = 0;
    for (const Shape& s : shapes) {
      Operands o;
      o.A.resize(size_t(s.M * s.K)), o.B.resize(size_t(s.K * s.N)), o.C.resize(size_t(s.M * s.N));
      for (auto& x : o.A) x = nd(rng);
      for (auto& x : o.B) x = nd(rng);
      if (std::any_of(cands.begin(), cands.end(), [](const Candidate& c) { return c.bf16; })) {
        for (const float x : o.A) o.A16.push_back(to_bf16(x)), o.A16f.push_back(from_bf16(o.A16.back()));
        for (const float x : o.B) o.B16.push_back(to_bf16(x)), o.B16f.push_back(from_bf16(o.B16.back()));
      }
      // Make, warm up and validate every candidate's call, then time them in rounds.
      std::vector<std::function<void()>> calls;
      std::vector<std::string> picked(cands.size());
      std::vector<double> errs;
      for (size_t c = 0; c < cands.size(); ++c) {
        cands[c].set_threads(threads);
        calls.push_back(cands[c].make(s, o, threads, &picked[c]));
        std::fill(o.C.begin(), o.C.end(), std::nanf(""));
        calls.back()();
        errs.push_back(cands[c].bf16 ? sample_error(s, o.A16f, o.B16f, o.C, rng) : sample_error(s, o.A, o.B, o.C, rng));
        if (!(errs.back() < 1e-5)) {
          std::fprintf(stderr, "attn-gemm-bench: %s, %lld,%lld,%lld: relative error %.2e against the double sum\n",
                       cands[c].name.c_str(), (long long)s.M, (long long)s.N, (long long)s.K, errs.back());
          return 1;
        }
      }
      std::vector<std::vector<double>> t(cands.size()), cpu(cands.size()), scaled(cands.size());
      for (int r = 0; r < reps; ++r) {
        for (size_t i = 0; i < cands.size(); ++i) {
          const size_t c = r % 2 == 0 ? i : cands.size() - 1 - i;  // odd rounds in reverse order
          cands[c].set_threads(threads);
          const double c0 = attn_bench::cpu_seconds();
          const auto t0 = std::chrono::steady_clock::now();
          calls[c]();
          t[c].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
          cpu[c].push_back(attn_bench::cpu_seconds() - c0);
        }
        // The round's peaks: each call's time as it would have been at the run's first peak.
        if (peak_seconds > 0) {
          const double fma = attn_bench::fma_peak_gflops(threads, kRoundPeakSeconds);
          const double bf16 = any_bf16 && bf16_peak > 0 ? bf16_peak_of(threads, kRoundPeakSeconds) : 0;
          for (size_t c = 0; c < cands.size(); ++c)
            scaled[c].push_back(t[c].back() * (cands[c].bf16 && bf16 > 0 ? bf16 / bf16_peak : fma / peak));
        }
      }
      total_flops += s.flops();
      for (size_t c = 0; c < cands.size(); ++c) {
        std::sort(t[c].begin(), t[c].end());
        std::sort(cpu[c].begin(), cpu[c].end());
        std::sort(scaled[c].begin(), scaled[c].end());
        if (!scaled[c].empty()) total_scaled[c] += scaled[c][scaled[c].size() / 2];
        const double med = t[c][t[c].size() / 2], med_cpu = cpu[c][cpu[c].size() / 2];
        const double gflops = s.flops() / med * 1e-9, per_cpu_s = s.flops() / med_cpu * 1e-9;
        const double frac = peak > 0 ? gflops / peak : 0, frac_cpu = per_cpu > 0 ? per_cpu_s / per_cpu : 0;
        total_s[c] += med, total_cpu[c] += med_cpu;
        worst[c] = std::min(worst[c], frac), best[c] = std::max(best[c], frac);
        rows_json.push_back({{"candidate", cands[c].name}, {"threads", threads}, {"M", s.M}, {"N", s.N}, {"K", s.K},
                             {"ta", s.ta}, {"tb", s.tb}, {"median_s", med}, {"gflops", gflops},
                             {"peak_fraction", frac}, {"median_cpu_s", med_cpu}, {"gflop_per_cpu_s", per_cpu_s},
                             {"cpu_peak_fraction", frac_cpu}, {"rel_err", errs[c]}, {"picked", picked[c]}});
        if (table)
          std::printf("%6lld %6lld %6lld %2d %2d %-12s %9.3f %8.1f %6.1f %8.1f %6.1f %8.1e  %s\n", (long long)s.M,
                      (long long)s.N, (long long)s.K, int(s.ta), int(s.tb), cands[c].name.c_str(), med * 1e3, gflops,
                      100 * frac, per_cpu_s, 100 * frac_cpu, errs[c], picked[c].c_str());
      }
      std::fflush(stdout);
    }
    if (table) std::printf("all %zu products, %d thread%s:\n", shapes.size(), threads, threads > 1 ? "s" : "");
    for (size_t c = 0; c < cands.size(); ++c) {
      const double gflops = total_flops / total_s[c] * 1e-9, frac = peak > 0 ? gflops / peak : 0;
      const double per_cpu_s = total_flops / total_cpu[c] * 1e-9, frac_cpu = per_cpu > 0 ? per_cpu_s / per_cpu : 0;
      const double bf16_frac = cands[c].bf16 && bf16_peak > 0 ? gflops / bf16_peak : 0;
      // Of the round's peak (the candidate's own: bfloat16 for the bfloat16 ones).
      const double own_peak = cands[c].bf16 && bf16_peak > 0 ? bf16_peak : peak;
      const double round_frac =
          total_scaled[c] > 0 && own_peak > 0 ? total_flops / total_scaled[c] * 1e-9 / own_peak : 0;
      summary.push_back({{"candidate", cands[c].name}, {"threads", threads}, {"total_s", total_s[c]},
                         {"gflops", gflops}, {"peak_fraction", frac}, {"min_peak_fraction", worst[c]},
                         {"max_peak_fraction", best[c]}, {"gflop_per_cpu_s", per_cpu_s},
                         {"cpu_peak_fraction", frac_cpu}, {"bf16_peak_gflops", bf16_peak},
                         {"bf16_peak_fraction", bf16_frac}, {"round_peak_fraction", round_frac}});
      if (table) {
        std::printf("  %-12s %9.1f ms %8.1f GFLOP/s %6.1f%% of the peak (per product %.1f-%.1f%%); "
                    "%.1f GFLOP per CPU-second, %.1f%%",
                    cands[c].name.c_str(), total_s[c] * 1e3, gflops, 100 * frac, 100 * worst[c], 100 * best[c],
                    per_cpu_s, 100 * frac_cpu);
        if (bf16_frac > 0) std::printf("; %.1f%% of the bfloat16 peak", 100 * bf16_frac);
        if (round_frac > 0)
          std::printf("; %.1f%% of the round's %s peak", 100 * round_frac, bf16_frac > 0 ? "bfloat16" : "FMA");
        std::printf("\n");
      }
    }
  }
  nlohmann::json peaks_json = nlohmann::json::object();
  for (const auto& [t, p] : peaks) peaks_json[std::to_string(t)] = {{"gflops", p.first}, {"per_cpu_s", p.second}};
  const nlohmann::json doc{{"cpu", attn_bench::cpu_model()}, {"simd_target", attn::detail::fused_target_name()},
                           {"chose", chose},      {"threads", thread_counts},
                           {"reps", reps},        {"fma_peak_gflops", peaks_json},
                           {"results", rows_json}, {"summary", summary}};
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
