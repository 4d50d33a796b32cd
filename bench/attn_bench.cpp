// attn-bench: times the attention backends on the base table's shapes
// (B=1, H=8, E=Ev=64, L=S from 512 to 16384, causal and not, forward and
// forward+backward, 1 and 2 threads).
//
// For every case each backend is first validated against the reference:
//   forward: a sample of 64 query rows (out and lse) against the reference run
//     on just those rows (with the keys they can see, so causal works too);
//   backward: dQ of the same rows likewise (dQ of a row depends on that row
//     only), and, for L <= --full-check-len, all of dQ, dK, dV.
// Then the backends are timed interleaved (rep by rep), and the table gives
// the median time, GFLOP/s (forward 4·B·H·L·S·E, halved for causal;
// forward+backward 3.5× that), the percentage of the FMA peak measured in the
// same run, the peak resident memory during the case and the time ratio to
// the fused backend. The reference is only timed up to --ref-max-len (it
// materialises L×S in double and takes minutes beyond).
//
// "fused-bf16" is the fused forward with bfloat16 products
// (compute_dtype bfloat16, docs/fused.md "bfloat16 compute"), on the
// instruction path this CPU has (printed in the header): forward only,
// validated against the reference on the bfloat16-rounded q, k, v within
// the bound of bfloat16's rounding of the probabilities, 2^-8·max|v|.
#include <time.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "attn/attn.hpp"
#include "fma_peak.hpp"
#include "kernels/fused/bf16.hpp"
#include "kernels/fused/fused.hpp"

namespace {

using attn::Backend;
using attn::View3;
using attn::View4;
using Clock = std::chrono::steady_clock;

// Peak resident set since the last reset, in bytes (Linux /proc).
int64_t status_kib(const char* key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(key, 0) == 0) return std::stoll(line.substr(std::string(key).size()));
  return -1;
}
void reset_peak_rss() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";  // resets VmHWM to the current RSS
}
double mib(int64_t kib) { return double(kib) / 1024.0; }
using attn_bench::cpu_model;
using attn_bench::cpu_seconds;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// What a table row runs: a backend, and for the fused one its products.
// "fused-bf16" is the library's call (compute_dtype bfloat16, the best
// path); "fused-bf16-amx", "-avx512" and "-portable" run one instruction
// path through the kernel's entry point (forward only; refused where the
// CPU lacks it).
struct Variant {
  Backend be = Backend::fused;
  bool bf16 = false;  // compute_dtype bfloat16
  std::optional<attn::detail::Bf16Path> path;  // a forced instruction path
  std::string name() const {
    if (!bf16) return attn::backend_name(be);
    if (!path) return "fused-bf16";
    return *path == attn::detail::Bf16Path::amx           ? "fused-bf16-amx"
           : *path == attn::detail::Bf16Path::avx512_bf16 ? "fused-bf16-avx512"
                                                          : "fused-bf16-portable";
  }
  static Variant parse(const std::string& name) {
    using attn::detail::Bf16Path;
    if (name == "fused-bf16") return {Backend::fused, true, {}};
    for (Bf16Path path : {Bf16Path::amx, Bf16Path::avx512_bf16, Bf16Path::portable}) {
      const Variant v{Backend::fused, true, path};
      if (name != v.name()) continue;
      if (!attn::detail::bf16_path_available(path))
        throw std::invalid_argument("backend " + name + ": this CPU does not run the " +
                                    attn::detail::bf16_path_name(path) + " path");
      return v;
    }
    return {attn::parse_backend(name), false, {}};
  }
};

// The tensors of one shape (contiguous (B, H, N, d)).
struct Buffers {
  int64_t B, H, L, S, E;
  attn::Tensor<float> q, k, v, dout, out, lse, dq, dk, dv;
  // Without `backward`, only q, k, v, out and lse are allocated.
  Buffers(int64_t b, int64_t h, int64_t l, int64_t s, int64_t e, bool backward = true)
      : B(b), H(h), L(l), S(s), E(e) {
    q = attn::Tensor<float>({B, H, L, E});
    k = attn::Tensor<float>({B, H, S, E});
    v = attn::Tensor<float>({B, H, S, E});
    out = attn::Tensor<float>({B, H, L, E});
    lse = attn::Tensor<float>({B, H, L});
    if (backward) {
      dout = attn::Tensor<float>({B, H, L, E});
      dq = attn::Tensor<float>({B, H, L, E});
      dk = attn::Tensor<float>({B, H, S, E});
      dv = attn::Tensor<float>({B, H, S, E});
    }
    std::mt19937_64 rng(42);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (auto* t : {&q, &k, &v, &dout})
      for (size_t i = 0; i < t->size(); ++i) (*t)[i] = nd(rng);
  }
  attn::SdpaArgs<float> args() const {
    attn::SdpaArgs<float> a;
    a.q = q.view4();
    a.k = k.view4();
    a.v = v.view4();
    return a;
  }
  attn::SdpaGrads<float> grads() { return {dq.view4(), dk.view4(), dv.view4(), {}}; }
};

struct Config {
  std::vector<int64_t> lengths{512, 1024, 2048, 4096, 8192, 16384};
  std::vector<int> threads{1, 2};
  std::vector<int> causal{0, 1};
  std::vector<std::string> modes{"fwd", "fwdbwd"};
  std::vector<std::string> backends{"fused", "reference"};
  int64_t heads = 8, dim = 64;
  int64_t ref_max_len = 1024;
  int64_t full_check_len = 512;
  int reps = 0;  // 0: adaptive
  double min_seconds = 1.5;
  std::string json;
  int64_t memory_len = 0;
};

struct Row {
  int64_t L;
  bool causal;
  std::string mode, backend;
  int threads;
  double median_s, gflops, pct_peak, peak_gflops, peak_rss_mib, extra_mib, vs_fused, cpu_s, cpu_eff;
  int reps;
  std::string check;
};

double flops(const Config& c, int64_t L, bool causal, const std::string& mode) {
  double f = 4.0 * double(c.heads) * double(L) * double(L) * double(c.dim);
  if (causal) f /= 2;
  if (mode == "fwdbwd") f *= 3.5;
  return f;
}

// Tile sizes forced for the fused backend (tuning; {0, 0} = the heuristic).
attn::detail::FusedPlan g_tiles;

// The kernels' view of a case (what the library's validation would build).
attn::detail::Problem problem_of(const Buffers& buf, bool causal, int threads) {
  attn::SdpaOptions opt;
  opt.causal = causal;
  opt.num_threads = threads;
  return attn::detail::make_problem(buf.args(), opt);
}

// Runs one forward (+ backward) of the case.
void run_once(Buffers& buf, Variant var, bool causal, int threads, bool bwd) {
  const Backend be = var.be;
  if (be == Backend::fused && !var.bf16 && g_tiles.q_block > 0) {
    const attn::detail::Problem p = problem_of(buf, causal, threads);
    const auto a = buf.args();
    attn::detail::FusedPlan t = attn::detail::fused_plan(p);  // the backward's split as usual
    t.q_block = g_tiles.q_block;
    t.k_block = g_tiles.k_block;
    attn::detail::fused_forward_tiled(p, a, buf.out.view4(), {}, buf.lse.view<3>(), t);
    if (bwd)
      attn::detail::fused_backward_tiled(p, a, buf.dout.view4(), buf.grads(), buf.out.view4(), buf.lse.view<3>(), t);
    return;
  }
  if (var.path) {  // one instruction path (forward only)
    const attn::detail::Problem p = problem_of(buf, causal, threads);
    attn::detail::fused_forward_bf16(p, buf.args(), buf.out.view4(), {}, buf.lse.view<3>(), *var.path);
    return;
  }
  attn::SdpaOptions opt;
  opt.backend = be;
  opt.causal = causal;
  opt.num_threads = threads;
  if (var.bf16) opt.compute_dtype = attn::Dtype::bfloat16;
  const auto a = buf.args();
  attn::scaled_dot_product_attention<float>(a, {buf.out.view4(), {}, buf.lse.view<3>()}, opt);
  if (bwd)
    attn::scaled_dot_product_attention_backward<float>(a, buf.dout.view4(), {buf.out.view4(), buf.lse.view<3>()},
                                                       buf.grads(), opt);
}

double max_abs_diff(const float* a, const float* b, size_t n, double* mag) {
  double d = 0;
  for (size_t i = 0; i < n; ++i) {
    d = std::max(d, std::abs(double(a[i]) - double(b[i])));
    *mag = std::max(*mag, std::abs(double(b[i])));
  }
  return d;
}

// Validates what run_once(be) left in buf against the reference (see the top
// comment); returns "ok ..." or throws.
std::string validate(Buffers& buf, Variant var, bool causal, bool bwd, const Config& c) {
  if (var.be == Backend::reference) return "oracle";
  const int64_t R = std::min<int64_t>(64, buf.L);
  const int64_t i0 = buf.L - R;  // the last rows: under causal they see the most keys
  const int64_t S = causal ? i0 + R : buf.S;
  attn::SdpaArgs<float> a;
  const int64_t H = buf.H, E = buf.E, L = buf.L;
  a.q = View4<const float>(buf.q.data() + i0 * E, {1, H, R, E}, {H * L * E, L * E, E, 1});
  a.k = View4<const float>(buf.k.data(), {1, H, S, E}, {H * buf.S * E, buf.S * E, E, 1});
  a.v = View4<const float>(buf.v.data(), {1, H, S, E}, {H * buf.S * E, buf.S * E, E, 1});
  // bfloat16 products: the reference on the rounded q, k, v (the products' operands).
  attn::Tensor<float> qr, kr, vr;
  if (var.bf16) {
    const auto round = [](const View4<const float>& x, attn::Tensor<float>& t) {
      t = attn::Tensor<float>({x.dim(0), x.dim(1), x.dim(2), x.dim(3)});
      size_t f = 0;
      for (int64_t b = 0; b < x.dim(0); ++b)
        for (int64_t h = 0; h < x.dim(1); ++h)
          for (int64_t n = 0; n < x.dim(2); ++n)
            for (int64_t e = 0; e < x.dim(3); ++e)
              t[f++] = attn::detail::bf16_value(attn::detail::bf16_operand(x(b, h, n, e)));
      return View4<const float>(t.view4());
    };
    a.q = round(a.q, qr), a.k = round(a.k, kr), a.v = round(a.v, vr);
  }
  attn::SdpaOptions opt;
  opt.backend = Backend::reference;
  opt.causal = causal;
  opt.causal_align = attn::CausalAlign::bottom_right;  // row r sees keys <= i0 + r
  attn::Tensor<float> out({1, H, R, E}), lse({1, H, R}), dq({1, H, R, E}), dk({1, H, S, E}), dv({1, H, S, E});
  attn::scaled_dot_product_attention<float>(a, {out.view4(), {}, lse.view<3>()}, opt);
  double worst = 0, mag = 0, lmag = 0;
  const double eps = 1.2e-7;
  auto tol = [&](int64_t n, double m) {
    const double exact = 20 * eps * std::sqrt(double(n)) * std::max(1.0, m);
    return var.bf16 ? exact + 0x1p-8 * m : exact;  // P rounded to bfloat16: 2^-8 relative, m ≥ max|v| for out
  };
  for (int64_t h = 0; h < H; ++h) {
    worst = std::max(worst, max_abs_diff(buf.out.data() + (h * L + i0) * E, out.data() + h * R * E,
                                         size_t(R * E), &mag));
    const double dl = max_abs_diff(buf.lse.data() + h * L + i0, lse.data() + h * R, size_t(R), &lmag);
    if (dl > tol(S + E, lmag)) throw std::runtime_error("lse mismatch: " + std::to_string(dl));
  }
  double vmag = 0;  // max|v|, the bound's scale for bfloat16 products
  for (size_t i = 0; var.bf16 && i < buf.v.size(); ++i) vmag = std::max(vmag, double(std::abs(buf.v[i])));
  if (worst > tol(S + E, var.bf16 ? std::max(mag, vmag) : mag)) throw std::runtime_error("out mismatch: " + std::to_string(worst));
  std::string what = "fwd rows ok";
  if (!bwd) return what;
  a.key_lengths = {};
  attn::SdpaArgs<float> ad = a;
  View4<const float> dout(buf.dout.data() + i0 * E, {1, H, R, E}, {H * L * E, L * E, E, 1});
  attn::scaled_dot_product_attention_backward<float>(ad, dout, {}, {dq.view4(), dk.view4(), dv.view4(), {}}, opt);
  mag = 0;
  worst = 0;
  for (int64_t h = 0; h < H; ++h)
    worst = std::max(worst, max_abs_diff(buf.dq.data() + (h * L + i0) * E, dq.data() + h * R * E,
                                         size_t(R * E), &mag));
  if (worst > tol(S + E, mag)) throw std::runtime_error("dq mismatch: " + std::to_string(worst));
  what += ", dq rows ok";
  if (buf.L <= c.full_check_len) {
    Buffers ref(buf.B, buf.H, buf.L, buf.S, buf.E);
    run_once(ref, Variant{Backend::reference, false, {}}, causal, 1, true);
    struct P {
      const attn::Tensor<float>* got;
      const attn::Tensor<float>* want;
      const char* name;
    };
    for (const P& p : {P{&buf.dq, &ref.dq, "dq"}, P{&buf.dk, &ref.dk, "dk"}, P{&buf.dv, &ref.dv, "dv"}}) {
      double m = 0;
      const double d = max_abs_diff(p.got->data(), p.want->data(), p.got->size(), &m);
      if (d > tol(buf.L + buf.S + E, m)) throw std::runtime_error(std::string(p.name) + " mismatch: " + std::to_string(d));
    }
    what += ", full grads ok";
  }
  return what;
}

void print_row(const Row& r) {
  std::printf("%6lld %-6s %-7s %2d %-10s %10.2f %9.1f %6.1f%% %6.1f %6.1f%% %9.1f %8.1f %8s %s\n", (long long)r.L,
              r.causal ? "causal" : "full", r.mode.c_str(), r.threads, r.backend.c_str(), r.median_s * 1e3,
              r.gflops, r.pct_peak, r.peak_gflops, r.cpu_eff, r.peak_rss_mib, r.extra_mib,
              r.vs_fused > 0 ? (std::to_string(r.vs_fused).substr(0, 6) + "x").c_str() : "-", r.check.c_str());
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  CLI::App app{"attn-bench: validate, then time the attention backends"};
  app.add_option("--lengths", c.lengths, "L = S values")->delimiter(',');
  app.add_option("--threads", c.threads, "thread counts")->delimiter(',');
  app.add_option("--causal", c.causal, "0 and/or 1")->delimiter(',');
  app.add_option("--modes", c.modes, "fwd and/or fwdbwd")->delimiter(',');
  app.add_option("--backends", c.backends, "fused, fused-bf16 (forward only) and/or reference")->delimiter(',');
  app.add_option("--heads", c.heads, "H (B = 1)");
  app.add_option("--dim", c.dim, "E = Ev");
  app.add_option("--ref-max-len", c.ref_max_len, "time the reference only up to this L");
  app.add_option("--full-check-len", c.full_check_len, "check all gradients up to this L");
  app.add_option("--reps", c.reps, "repetitions per case (0: at least 3, about --min-seconds)");
  app.add_option("--min-seconds", c.min_seconds, "adaptive repetitions aim at this much time per case");
  app.add_option("--json", c.json, "also write the results as JSON to this file ('-' = stdout only)");
  app.add_option("--memory-len", c.memory_len,
                 "instead: one causal forward at L = S = this, reporting peak memory against inputs+outputs");
  std::vector<int64_t> tiles;
  app.add_option("--tiles", tiles, "force the fused tiles q_block,k_block (tuning)")->delimiter(',')->expected(2);
  CLI11_PARSE(app, argc, argv);
  if (tiles.size() == 2) g_tiles = {tiles[0], tiles[1]};
  const bool quiet = c.json == "-";
  auto say = [&](const char* fmt, auto... args) {
    if (!quiet) std::printf(fmt, args...);
  };

  nlohmann::json doc;
  char date[64];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%d %H:%M UTC", std::gmtime(&now));
  doc["date"] = date;
  doc["cpu"] = cpu_model();
  doc["simd_target"] = attn::detail::fused_target_name();
  std::string cmd;
  for (int i = 0; i < argc; ++i) cmd += std::string(i ? " " : "") + argv[i];
  doc["command"] = cmd;
  say("attn-bench  %s  cpu: %s  SIMD target: %s  bfloat16 products: %s\n", date, cpu_model().c_str(),
      attn::detail::fused_target_name(), attn::detail::bf16_path_name(attn::detail::bf16_best_path()));
  doc["bf16_path"] = attn::detail::bf16_path_name(attn::detail::bf16_best_path());

  if (c.memory_len > 0) {
    const int64_t n = c.memory_len;
    reset_peak_rss();
    const int64_t base = status_kib("VmRSS:");
    Buffers buf(1, c.heads, n, n, c.dim, /*backward=*/false);
    const int64_t io_kib =
        int64_t((buf.q.size() + buf.k.size() + buf.v.size() + buf.out.size() + buf.lse.size()) * sizeof(float) / 1024);
    attn::SdpaOptions opt;
    opt.backend = Backend::fused;
    opt.causal = true;
    opt.num_threads = c.threads.front();
    const auto t0 = Clock::now();
    attn::scaled_dot_product_attention<float>(buf.args(), {buf.out.view4(), {}, buf.lse.view<3>()}, opt);
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    const int64_t peak = status_kib("VmHWM:") - base;
    // What the kernels allocate beyond inputs and outputs: per-thread scratch.
    const attn::detail::Problem p = problem_of(buf, true, opt.num_threads);
    const int64_t scratch_kib =
        opt.num_threads * attn::detail::fused_scratch_bytes(p, attn::detail::fused_plan(p)).forward / 1024;
    say("memory: causal fwd L=S=%lld H=%lld E=%lld threads=%d: %.1f s, peak RSS above start %.1f MiB, "
        "inputs+outputs %.1f MiB, extra %.1f MiB (fused scratch %.2f MiB)\n",
        (long long)n, (long long)c.heads, (long long)c.dim, opt.num_threads, dt, mib(peak), mib(io_kib),
        mib(peak - io_kib), mib(scratch_kib));
    doc["memory"] = {{"L", n}, {"seconds", dt}, {"peak_mib", mib(peak)}, {"inputs_outputs_mib", mib(io_kib)},
                     {"extra_mib", mib(peak - io_kib)}, {"scratch_mib", mib(scratch_kib)}};
    if (!c.json.empty()) {
      if (quiet) std::cout << doc.dump(2) << "\n";
      else std::ofstream(c.json) << doc.dump(2) << "\n";
    }
    return 0;
  }

  std::map<int, double> peak;
  for (int t : c.threads) {
    peak[t] = attn_bench::fma_peak_gflops(t, 0.5);
    say("FMA peak, %d thread(s): %.1f GFLOP/s (re-measured next to every case: column 'peak')\n", t, peak[t]);
    doc["fma_peak_gflops"][std::to_string(t)] = peak[t];
    if (const double amx = attn_bench::amx_peak_gflops(t, 0.5); amx > 0) {
      say("AMX bfloat16 peak (TDPBF16PS, tiles in registers), %d thread(s): %.1f GFLOP/s\n", t, amx);
      doc["amx_peak_gflops"][std::to_string(t)] = amx;
    }
  }
  say("\n%6s %-6s %-7s %2s %-10s %10s %9s %7s %6s %7s %9s %8s %8s %s\n", "L=S", "mask", "mode", "th", "backend",
      "median ms", "GFLOP/s", "%peak", "peak", "%cpu-pk", "peak MiB", "extraMiB", "vs fused", "validation");

  std::vector<Row> rows;
  for (int64_t L : c.lengths) {
    Buffers buf(1, c.heads, L, L, c.dim);
    for (const std::string& mode : c.modes)
      for (int causal : c.causal)
        for (int t : c.threads) {
          const bool bwd = mode == "fwdbwd";
          std::vector<Variant> bes;
          for (const auto& name : c.backends) {
            const Variant var = Variant::parse(name);
            if (var.be == Backend::reference && L > c.ref_max_len) continue;
            if (var.bf16 && bwd) continue;  // forward only
            bes.push_back(var);
          }
          // Validate each backend, and get one untimed warm-up run.
          std::vector<std::string> checks;
          std::vector<double> first;
          for (const Variant& be : bes) {
            const auto t0 = Clock::now();
            run_once(buf, be, causal, t, bwd);
            first.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
            try {
              checks.push_back(validate(buf, be, causal, bwd, c));
            } catch (const std::exception& e) {  // a mismatch, or an argument error
              std::fprintf(stderr, "VALIDATION FAILED: %s L=%lld causal=%d %s: %s\n", be.name().c_str(),
                           (long long)L, causal, mode.c_str(), e.what());
              return 1;
            }
          }
          // Interleaved timing.
          int reps = c.reps;
          if (reps <= 0) {
            const double slowest = *std::max_element(first.begin(), first.end());
            reps = int(std::clamp(c.min_seconds / std::max(slowest, 1e-6), 3.0, 15.0));
            if (slowest > 20) reps = 1;
            else if (slowest > 5) reps = std::min(reps, 3);
          }
          // The machine may be shared: measure the peak again right next to the case.
          double core_peak = 0;  // GFLOP per CPU-second of one core
          const double case_peak = std::max(attn_bench::fma_peak_gflops(t, 0.1), 1e-9);
          attn_bench::fma_peak_gflops(1, 0.1, &core_peak);
          std::vector<std::vector<double>> times(bes.size()), cpu(bes.size());
          std::vector<double> peak_mib(bes.size(), 0), extra(bes.size(), 0);
          for (int r = 0; r < reps; ++r)
            for (size_t b = 0; b < bes.size(); ++b) {
              reset_peak_rss();
              const int64_t before = status_kib("VmRSS:");
              const auto t0 = Clock::now();
              const double c0 = cpu_seconds();
              run_once(buf, bes[b], causal, t, bwd);
              times[b].push_back(std::chrono::duration<double>(Clock::now() - t0).count());
              cpu[b].push_back(cpu_seconds() - c0);
              const int64_t hwm = status_kib("VmHWM:");
              peak_mib[b] = std::max(peak_mib[b], mib(hwm));
              extra[b] = std::max(extra[b], mib(hwm - before));
            }
          double fused_med = 0;
          for (size_t b = 0; b < bes.size(); ++b)
            if (bes[b].be == Backend::fused && !bes[b].bf16) fused_med = median(times[b]);
          for (size_t b = 0; b < bes.size(); ++b) {
            Row row;
            row.L = L;
            row.causal = causal;
            row.mode = mode;
            row.backend = bes[b].name();
            row.threads = t;
            row.median_s = median(times[b]);
            row.gflops = flops(c, L, causal, mode) / row.median_s * 1e-9;
            row.pct_peak = 100.0 * row.gflops / case_peak;
            row.peak_gflops = case_peak;
            row.cpu_s = median(cpu[b]);
            row.cpu_eff = 100.0 * flops(c, L, causal, mode) * 1e-9 / row.cpu_s / std::max(core_peak, 1e-9);
            row.peak_rss_mib = peak_mib[b];
            row.extra_mib = extra[b];
            row.vs_fused = fused_med > 0 ? row.median_s / fused_med : 0;
            row.reps = reps;
            row.check = checks[b];
            if (!quiet) print_row(row);
            rows.push_back(row);
            doc["results"].push_back({{"L", row.L}, {"S", row.L}, {"B", 1}, {"H", c.heads}, {"E", c.dim},
                                      {"causal", row.causal}, {"mode", row.mode}, {"backend", row.backend},
                                      {"threads", row.threads}, {"median_s", row.median_s},
                                      {"gflops", row.gflops}, {"pct_fma_peak", row.pct_peak}, {"fma_peak_gflops", row.peak_gflops},
                                      {"cpu_s", row.cpu_s}, {"pct_core_peak_per_cpu_second", row.cpu_eff},
                                      {"peak_rss_mib", row.peak_rss_mib}, {"extra_rss_mib", row.extra_mib},
                                      {"time_vs_fused", row.vs_fused}, {"reps", row.reps},
                                      {"validation", row.check}});
          }
        }
  }
  if (!c.json.empty()) {
    if (quiet) std::cout << doc.dump(2) << "\n";
    else std::ofstream(c.json) << doc.dump(2) << "\n";
  }
  return 0;
}
