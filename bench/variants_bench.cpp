// attn-bench-variants: the targets of the variants issue, each measured side
// by side in one run and reported as a ratio:
//
//   window   B=1, H=8, E=64, causal, L=S=16384: a window of 512 keys against
//            full causal. Target: time ratio <= 1.3 × the fraction of the
//            causal scores the window keeps.
//   overhead L=S=4096 (not causal): soft-cap, ALiBi and sinks against the
//            same call without them. Targets: soft-cap <= 1.20, ALiBi and
//            sinks <= 1.10.
//   varlen   16 sequences of lengths uniform in [32, 2048] (seeded), packed:
//            GFLOP/s on the real work against the dense kernel at the mean
//            length (target >= 0.9), and time against the same batch padded
//            to the longest sequence with key lengths (target: speed-up >= 0.8
//            × the padding ratio of the work the padded call does).
//
//   case     one variant alone, for bench/compare_torch.py --variants (which
//            times PyTorch on the equivalent dense mask or bias): --case
//            plain|causal|window|alibi|softcap|sinks|varlen at L=S=--case-len
//            (varlen: the sequences of --varlen-lengths, not causal); prints
//            one JSON line per mode.
//
// Every timed configuration is first validated (fused against reference on
// the same options at a small size, forward and backward), then timed: the
// median (--stat min: the fastest; --stat paired: ratios as medians of the
// per-repetition ratios) of --reps interleaved repetitions of the
// fused backend, forward or forward+backward (--modes). --clock cpu times
// the process's CPU time instead of the wall clock: with --threads 1 on a
// machine others load, it leaves out the time the thread waited for a core
// (the ratios are then those of one thread).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <ctime>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "attn/attn.hpp"
#include "kernels/fused/fused.hpp"
#include "simd_target.hpp"

namespace {

using attn::Backend;
using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Seconds on the clock the run measures (--clock): wall or process CPU time.
bool g_cpu_clock = false;
double now() {
  if (!g_cpu_clock) return std::chrono::duration<double>(Clock::now().time_since_epoch()).count();
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

// The statistic over the repetitions (--stat): the median, the fastest (on
// a machine others load, the run least disturbed), or paired: times are
// medians, and a ratio of two configurations is the median over the
// repetitions of their ratio within one repetition. The configurations of a
// repetition run back to back, so a slow spell of the machine (this VM's
// neighbours move the plain call by ±15% from one run to the next) slows
// both sides of a ratio and cancels in it.
enum class Stat { median, min, paired };
Stat g_stat = Stat::median;

// The times of each configuration over the interleaved repetitions.
struct Timings {
  std::vector<std::vector<double>> t;
  // The statistic of configuration i, in seconds.
  double operator[](size_t i) const {
    return g_stat == Stat::min ? *std::min_element(t[i].begin(), t[i].end()) : median(t[i]);
  }
  // Time of configuration i over that of configuration j.
  double ratio(size_t i, size_t j) const {
    if (g_stat != Stat::paired) return (*this)[i] / (*this)[j];
    std::vector<double> r;
    for (size_t k = 0; k < t[i].size(); ++k) r.push_back(t[i][k] / t[j][k]);
    return median(r);
  }
};

// Times each of `fns` `reps` times, interleaved (after one warm-up call each).
Timings time_interleaved(const std::vector<std::function<void()>>& fns, int reps) {
  Timings m;
  m.t.resize(fns.size());
  for (auto& f : fns) f();  // warm-up
  for (int r = 0; r < reps; ++r)
    for (size_t i = 0; i < fns.size(); ++i) {
      const double t0 = now();
      fns[i]();
      m.t[i].push_back(now() - t0);
    }
  return m;
}

struct Dense {
  int64_t B, H, L, S, E;
  attn::Tensor<float> q, k, v, dout, out, lse, dq, dk, dv, slopes, sinks, dsinks;
  std::vector<int64_t> key_lengths;
  Dense(int64_t b, int64_t h, int64_t l, int64_t s, int64_t e)
      : B(b), H(h), L(l), S(s), E(e), q({b, h, l, e}), k({b, h, s, e}), v({b, h, s, e}), dout({b, h, l, e}),
        out({b, h, l, e}), lse({b, h, l}), dq({b, h, l, e}), dk({b, h, s, e}), dv({b, h, s, e}), slopes({h}),
        sinks({h}), dsinks({h}) {
    std::mt19937_64 rng(7);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (auto* t : {&q, &k, &v, &dout})
      for (size_t i = 0; i < t->size(); ++i) (*t)[i] = nd(rng);
    for (int64_t i = 0; i < h; ++i) slopes[size_t(i)] = std::exp2(-8.0f * float(i + 1) / float(h)), sinks[size_t(i)] = 0.5f;
  }
  attn::SdpaArgs<float> args(bool alibi, bool sink) const {
    attn::SdpaArgs<float> a;
    a.q = q.view4();
    a.k = k.view4();
    a.v = v.view4();
    if (alibi) a.alibi_slopes = slopes.view<1>();
    if (sink) a.sinks = sinks.view<1>();
    if (!key_lengths.empty()) a.key_lengths = attn::View1<const int64_t>(key_lengths.data(), {B});
    return a;
  }
  void run(const attn::SdpaOptions& opt, bool alibi, bool sink, bool bwd) {
    const auto a = args(alibi, sink);
    attn::scaled_dot_product_attention<float>(a, {out.view4(), {}, lse.view<3>()}, opt);
    if (bwd) {
      attn::SdpaGrads<float> g{dq.view4(), dk.view4(), dv.view4(), {}, {}};
      if (sink) g.dsinks = dsinks.view<1>();
      attn::scaled_dot_product_attention_backward<float>(a, dout.view4(), {out.view4(), lse.view<3>()}, g, opt);
    }
  }
};

double max_diff(const attn::Tensor<float>& a, const attn::Tensor<float>& b, double* mag) {
  double d = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    d = std::max(d, std::abs(double(a[i]) - double(b[i])));
    *mag = std::max(*mag, std::abs(double(b[i])));
  }
  return d;
}

// Whether the fused run f matches the reference run r (out and the
// gradients within 1e-4 of their magnitude); reports a failure.
template <class Run>
bool matches(const Run& f, const Run& r, const char* what) {
  double worst = 0;
  for (auto [a, b] : {std::pair{&f.out, &r.out}, {&f.dq, &r.dq}, {&f.dk, &r.dk}, {&f.dv, &r.dv}}) {
    double mag = 0;
    worst = std::max(worst, max_diff(*a, *b, &mag) / std::max(1.0, mag));
  }
  if (worst > 1e-4) std::fprintf(stderr, "VALIDATION FAILED (%s): relative difference %g\n", what, worst);
  return worst <= 1e-4;
}

// Fused against reference on a small dense problem with these options.
bool validate(attn::SdpaOptions opt, bool alibi, bool sink) {
  Dense f(1, 2, 300, 300, 64), r(1, 2, 300, 300, 64);
  opt.backend = Backend::fused;
  f.run(opt, alibi, sink, true);
  opt.backend = Backend::reference;
  r.run(opt, alibi, sink, true);
  return matches(f, r, "dense");
}

// A packed batch of sequences of the given lengths (L_b = S_b, H = Hkv).
struct PackedBatch {
  std::vector<int64_t> cu{0};
  int64_t longest = 0;
  attn::Tensor<float> q, k, v, out, lse, dout, dq, dk, dv;
  PackedBatch(const std::vector<int64_t>& lens, int64_t H, int64_t E, std::mt19937_64& rng) {
    for (int64_t n : lens) cu.push_back(cu.back() + n), longest = std::max(longest, n);
    const int64_t total = cu.back();
    for (auto* t : {&q, &k, &v, &out, &dout, &dq, &dk, &dv}) *t = attn::Tensor<float>({total, H, E});
    lse = attn::Tensor<float>({H, total});
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (auto* t : {&q, &k, &v, &dout})
      for (size_t i = 0; i < t->size(); ++i) (*t)[i] = nd(rng);
  }
  void run(const attn::SdpaOptions& opt, bool bwd) {
    attn::VarlenArgs<float> a;
    a.q = q.view<3>();
    a.k = k.view<3>();
    a.v = v.view<3>();
    a.cu_seqlens_q = a.cu_seqlens_k = attn::View1<const int64_t>(cu.data(), {int64_t(cu.size())});
    a.max_seqlen_q = a.max_seqlen_k = longest;
    attn::varlen_attention<float>(a, {out.view<3>(), lse.view<2>()}, opt);
    if (bwd)
      attn::varlen_attention_backward<float>(a, dout.view<3>(), {out.view<3>(), lse.view<2>()},
                                             {dq.view<3>(), dk.view<3>(), dv.view<3>()}, opt);
  }
};

// The packed path, fused against reference, on a small awkward packing.
bool validate_varlen(attn::SdpaOptions opt) {
  std::mt19937_64 r1(3), r2(3);
  PackedBatch f({50, 130, 7, 96}, 2, 64, r1), r({50, 130, 7, 96}, 2, 64, r2);
  opt.backend = Backend::fused;
  f.run(opt, true);
  opt.backend = Backend::reference;
  r.run(opt, true);
  return matches(f, r, "varlen");
}

struct Config {
  std::vector<std::string> sections{"window", "overhead", "varlen"};
  std::vector<std::string> modes{"fwd", "fwdbwd"};
  int64_t window_len = 16384, window = 512, overhead_len = 4096, heads = 8, dim = 64;
  int reps = 3, threads = 0;
  double softcap = 30.0;
  uint64_t seed = 2026;
  std::string case_name = "plain";
  int64_t case_len = 2048, case_window = 256;
  std::vector<int64_t> varlen_lengths;
};

void window_section(const Config& c, bool bwd) {
  const int64_t n = c.window_len, w = c.window;
  attn::SdpaOptions causal;
  causal.causal = true;
  causal.backend = Backend::fused;
  causal.num_threads = c.threads;
  attn::SdpaOptions win = causal;
  win.window = {w - 1, 0};  // w keys: the query's own and the w − 1 before it
  if (!validate(win, false, false)) std::exit(1);
  Dense d(1, c.heads, n, n, c.dim);
  const auto t = time_interleaved({[&] { d.run(causal, false, false, bwd); }, [&] { d.run(win, false, false, bwd); }}, c.reps);
  // Visible scores: causal n(n+1)/2; window Σ_i min(i + 1, w).
  const double causal_scores = double(n) * double(n + 1) / 2;
  const double window_scores = double(w) * double(w + 1) / 2 + double(n - w) * double(w);
  const double fraction = window_scores / causal_scores, ratio = t.ratio(1, 0);
  std::printf("window  %-6s L=S=%lld H=%lld E=%lld window=%lld: causal %.3f s, windowed %.3f s; time ratio %.4f, "
              "visible fraction %.4f, target <= %.4f: %s (ratio / fraction = %.2f)\n",
              bwd ? "fwdbwd" : "fwd", (long long)n, (long long)c.heads, (long long)c.dim, (long long)w, t[0], t[1], ratio,
              fraction, 1.3 * fraction, ratio <= 1.3 * fraction ? "met" : "MISSED", ratio / fraction);
}

void overhead_section(const Config& c, bool bwd) {
  const int64_t n = c.overhead_len;
  attn::SdpaOptions plain;
  plain.backend = Backend::fused;
  plain.num_threads = c.threads;
  attn::SdpaOptions cap = plain;
  cap.softcap = c.softcap;
  if (!validate(cap, false, false) || !validate(plain, true, false) || !validate(plain, false, true)) std::exit(1);
  Dense d(1, c.heads, n, n, c.dim);
  const auto t = time_interleaved({[&] { d.run(plain, false, false, bwd); }, [&] { d.run(cap, false, false, bwd); },
                                   [&] { d.run(plain, true, false, bwd); }, [&] { d.run(plain, false, true, bwd); }},
                                  c.reps);
  const char* names[] = {"softcap", "alibi", "sinks"};
  const double targets[] = {1.2, 1.1, 1.1};
  std::printf("overhead %-6s L=S=%lld H=%lld E=%lld: plain %.3f s\n", bwd ? "fwdbwd" : "fwd", (long long)n,
              (long long)c.heads, (long long)c.dim, t[0]);
  for (int i = 0; i < 3; ++i) {
    const double r = t.ratio(size_t(i + 1), 0);
    std::printf("  %-8s %.3f s, ratio %.3f, target <= %.2f: %s\n", names[i], t[size_t(i + 1)], r, targets[i],
                r <= targets[i] ? "met" : "MISSED");
  }
}

void varlen_section(const Config& c, bool bwd) {
  std::mt19937_64 rng(c.seed);
  std::uniform_int_distribution<int64_t> len(32, 2048);
  std::vector<int64_t> cu{0}, lens;
  double work = 0;  // Σ L_b², the real score count
  int64_t longest = 0;
  for (int b = 0; b < 16; ++b) {
    lens.push_back(len(rng));
    cu.push_back(cu.back() + lens.back());
    work += double(lens.back()) * double(lens.back());
    longest = std::max(longest, lens.back());
  }
  const int64_t total = cu.back(), H = c.heads, E = c.dim, mean = total / 16;
  attn::SdpaOptions opt;
  opt.backend = Backend::fused;
  opt.num_threads = c.threads;
  // Packed tensors.
  attn::Tensor<float> q({total, H, E}), k({total, H, E}), v({total, H, E}), out({total, H, E}), lse({H, total});
  attn::Tensor<float> dout({total, H, E}), dq({total, H, E}), dk({total, H, E}), dv({total, H, E});
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (auto* t : {&q, &k, &v, &dout})
    for (size_t i = 0; i < t->size(); ++i) (*t)[i] = nd(rng);
  attn::VarlenArgs<float> va;
  va.q = q.view<3>();
  va.k = k.view<3>();
  va.v = v.view<3>();
  va.cu_seqlens_q = va.cu_seqlens_k = attn::View1<const int64_t>(cu.data(), {17});
  va.max_seqlen_q = va.max_seqlen_k = longest;
  auto packed = [&] {
    attn::varlen_attention<float>(va, {out.view<3>(), lse.view<2>()}, opt);
    if (bwd)
      attn::varlen_attention_backward<float>(va, dout.view<3>(), {out.view<3>(), lse.view<2>()},
                                             {dq.view<3>(), dk.view<3>(), dv.view<3>()}, opt);
  };
  Dense dense(1, H, mean, mean, E);
  Dense padded(16, H, longest, longest, E);
  padded.key_lengths = lens;
  const auto t = time_interleaved({packed, [&] { dense.run(opt, false, false, bwd); },
                                   [&] { padded.run(opt, false, false, bwd); }},
                                  c.reps);
  const double f = (bwd ? 3.5 : 1.0) * 4.0 * double(H) * double(E);
  const double g_packed = f * work / t[0] * 1e-9, g_dense = f * double(mean) * double(mean) / t[1] * 1e-9;
  const double efficiency = work / (double(mean) * double(mean)) * t.ratio(1, 0);  // = g_packed / g_dense
  // The padded call computes every query row (padded ones too) against its
  // sequence's keys: Σ_b longest·L_b scores.
  const double padded_work = double(longest) * double(total);
  const double pad_ratio = padded_work / work, speedup = t.ratio(2, 0);
  std::printf("varlen  %-6s 16 sequences, lengths 32..2048 (total %lld, mean %lld, longest %lld), H=%lld E=%lld:\n"
              "  packed %.3f s = %.1f GFLOP/s on real work; dense at the mean length %.1f GFLOP/s; ratio %.3f, target >= 0.90: %s\n"
              "  padded with key lengths %.3f s; speed-up %.2f, padding ratio %.2f, target >= %.2f: %s\n",
              bwd ? "fwdbwd" : "fwd", (long long)total, (long long)mean, (long long)longest, (long long)H, (long long)E,
              t[0], g_packed, g_dense, efficiency, efficiency >= 0.9 ? "met" : "MISSED", t[2], speedup,
              pad_ratio, 0.8 * pad_ratio, speedup >= 0.8 * pad_ratio ? "met" : "MISSED");
}

// One variant alone at L = S = case_len (or the packed varlen batch), as one
// JSON line: the median seconds of the fused backend and the validation.
void case_section(const Config& c, bool bwd) {
  attn::SdpaOptions opt;
  opt.backend = Backend::fused;
  opt.num_threads = c.threads;
  const std::string& v = c.case_name;
  bool alibi = false, sink = false;
  if (v == "causal" || v == "window") opt.causal = true;
  if (v == "window") opt.window = {c.case_window - 1, 0};  // case_window keys: the query's own and those before it
  if (v == "softcap") opt.softcap = c.softcap;
  alibi = v == "alibi";
  sink = v == "sinks";
  if (v != "plain" && v != "causal" && v != "window" && v != "alibi" && v != "softcap" && v != "sinks" &&
      v != "varlen") {
    std::fprintf(stderr, "unknown case '%s'\n", v.c_str());
    std::exit(2);
  }
  double t = 0;
  if (v == "varlen") {
    if (c.varlen_lengths.empty()) {
      std::fprintf(stderr, "case varlen needs --varlen-lengths\n");
      std::exit(2);
    }
    if (!validate_varlen(opt)) std::exit(1);
    std::mt19937_64 rng(c.seed);
    PackedBatch p(c.varlen_lengths, c.heads, c.dim, rng);
    t = time_interleaved({[&] { p.run(opt, bwd); }}, c.reps)[0];
  } else {
    if (!validate(opt, alibi, sink)) std::exit(1);
    Dense d(1, c.heads, c.case_len, c.case_len, c.dim);
    t = time_interleaved({[&] { d.run(opt, alibi, sink, bwd); }}, c.reps)[0];
  }
  std::printf("{\"case\": \"%s\", \"mode\": \"%s\", \"len\": %lld, \"heads\": %lld, \"dim\": %lld, "
              "\"median_s\": %.6f, \"validation\": \"fused = reference within 1e-4\", \"target\": \"%s\"}\n",
              v.c_str(), bwd ? "fwdbwd" : "fwd", (long long)c.case_len, (long long)c.heads, (long long)c.dim, t,
              attn::detail::fused_target_name());
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  CLI::App app{"attn-bench-variants: the variants' performance targets, measured side by side"};
  app.add_option("--sections", c.sections, "window, overhead, varlen and/or case")->delimiter(',');
  app.add_option("--modes", c.modes, "fwd and/or fwdbwd")->delimiter(',');
  app.add_option("--window-len", c.window_len, "L = S of the window section");
  app.add_option("--window", c.window, "keys in the window");
  app.add_option("--overhead-len", c.overhead_len, "L = S of the overhead section");
  app.add_option("--softcap", c.softcap, "the soft-cap of the overhead section");
  app.add_option("--heads", c.heads, "H");
  app.add_option("--dim", c.dim, "E = Ev");
  app.add_option("--reps", c.reps, "timed repetitions (median)");
  app.add_option("--threads", c.threads, "threads (0: the library default)");
  std::string clock = "wall";
  app.add_option("--clock", clock, "wall or cpu (process CPU time; with --threads 1 for a loaded machine)")
      ->check(CLI::IsMember({"wall", "cpu"}));
  std::string stat = "median";
  app.add_option("--stat", stat,
                 "median, min or paired: the median, the fastest (the least disturbed run), or medians with each ratio "
                 "the median of the per-repetition ratios")
      ->check(CLI::IsMember({"median", "min", "paired"}));
  app.add_option("--seed", c.seed, "seed of the varlen lengths (and values)");
  app.add_option("--case", c.case_name, "case section: plain, causal, window, alibi, softcap, sinks or varlen");
  app.add_option("--case-len", c.case_len, "case section: L = S");
  app.add_option("--case-window", c.case_window, "case section: keys in the window");
  app.add_option("--varlen-lengths", c.varlen_lengths, "case section, varlen: the sequence lengths")->delimiter(',');
  std::string target = "best";
  app.add_option("--target", target, "SIMD target of the kernels (AVX3, AVX2, SSE4, ...; best: the best the CPU runs)");
  CLI11_PARSE(app, argc, argv);
  if (!attn_bench::limit_simd_target(target)) {
    std::fprintf(stderr, "attn-bench-variants: --target: '%s' is not a SIMD target this CPU runs\n", target.c_str());
    return 2;
  }
  g_cpu_clock = clock == "cpu";
  g_stat = stat == "min" ? Stat::min : stat == "paired" ? Stat::paired : Stat::median;
  if (std::find(c.sections.begin(), c.sections.end(), "case") == c.sections.end())
    std::printf("attn-bench-variants: fused SIMD target %s, %d threads (0: the library default), %s clock, %s of %d\n",
                attn::detail::fused_target_name(), c.threads, clock.c_str(), stat.c_str(), c.reps);
  for (const auto& mode : c.modes)
    for (const auto& s : c.sections) {
      const bool bwd = mode == "fwdbwd";
      if (s == "window") window_section(c, bwd);
      else if (s == "overhead") overhead_section(c, bwd);
      else if (s == "varlen") varlen_section(c, bwd);
      else if (s == "case") case_section(c, bwd);
      else {
        std::fprintf(stderr, "unknown section '%s'\n", s.c_str());
        return 2;
      }
      std::fflush(stdout);
    }
  return 0;
}
