// `attn tour`: the whole mechanism on built-in data in about a minute — the
// worked examples, the experiments as short tables, multi-head attention on a
// sentence with its heatmap, and a speed comparison between backends.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <random>

#include <fmt/format.h>

#include "commands.hpp"
#include "common.hpp"
#include "experiments.hpp"
#include "plot.hpp"

namespace attn::cli {
namespace {

struct TourOpts {
  std::string heatmap = "attn-tour-heatmap.png";
  bool quick = false;
  uint64_t seed = 0;
};

void section(const std::string& title) {
  fmt::print("\n{}\n{}\n", title, std::string(title.size(), '='));
  std::fflush(stdout);
}

void sentence(const TourOpts& o) {
  const std::vector<std::string> words = {"the", "cat", "sat", "on", "the", "mat", "because", "it", "was", "tired"};
  const int64_t N = int64_t(words.size()), D = 32, H = 4;
  // Embeddings: one fixed random vector per distinct word (so both "the"s
  // share one), plus sinusoidal positions so the layer can tell them apart.
  std::vector<float> x(size_t(N * D));
  for (int64_t i = 0; i < N; ++i) {
    std::mt19937_64 rng(std::hash<std::string>{}(words[size_t(i)]) ^ o.seed);
    std::normal_distribution<float> nd;
    for (int64_t d = 0; d < D; ++d) {
      const double f = std::pow(10000.0, -double(d / 2 * 2) / double(D));
      x[size_t(i * D + d)] = nd(rng) + float(d % 2 == 0 ? std::sin(double(i) * f) : std::cos(double(i) * f));
    }
  }
  MultiheadConfig cfg;
  cfg.embed_dim = D;
  cfg.num_heads = H;
  MultiheadAttention<float> layer(cfg, o.seed + 7);
  std::vector<float> y(x.size()), w(size_t(H * N * N));
  MhaArgs<float> args;
  args.query = View3<const float>(x.data(), {1, N, D});
  layer.forward(args, {View3<float>(y.data(), {1, N, D}), View4<float>::bhnd(w.data(), 1, H, N, N), {}});
  fmt::print("\"{}\": {} tokens, D = {}, {} heads of d_k = {},\n"
             "weights as PyTorch initialises them (untrained: the patterns show the mechanism, not grammar).\n\n",
             "the cat sat on the mat because it was tired", N, D, H, D / H);
  fmt::print("  where each head's \"it\" looks (top two weights):\n");
  const int64_t it = 7;
  for (int64_t h = 0; h < H; ++h) {
    std::vector<int64_t> idx(static_cast<size_t>(N));
    for (int64_t j = 0; j < N; ++j) idx[size_t(j)] = j;
    const float* row = &w[size_t((h * N + it) * N)];
    std::sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return row[a] > row[b]; });
    double sum = 0;
    for (int64_t j = 0; j < N; ++j) sum += row[j];
    fmt::print("    head {}: {:<8} {:.3f}   {:<8} {:.3f}   (row sums to {:.6f})\n", h, words[size_t(idx[0])],
               row[idx[0]], words[size_t(idx[1])], row[idx[1]], sum);
  }
  std::vector<double> wd(w.begin(), w.end());
  draw_heatmap(wd, H, N, N, words, words, "attn tour: 4 heads over \"the cat sat on the mat because it was tired\"",
               o.heatmap);
  fmt::print("  heatmap of all four heads written to {}\n", o.heatmap);
}

// Times SDPA per backend on (1, 8, n, 64) float inputs after checking each
// backend against the reference.
void speed(const TourOpts& o) {
  const std::vector<int64_t> sizes = o.quick ? std::vector<int64_t>{64} : std::vector<int64_t>{256, 1024, 2048};
  const int64_t H = 8, E = 64;
  const int reps = o.quick ? 1 : 3;
  std::vector<Backend> backends = {Backend::reference};
  {
    std::vector<float> t(size_t(H * 16 * E), 0.5f);
    SdpaArgs<float> a;
    a.q = a.k = a.v = View4<const float>::bhnd(t.data(), 1, H, 16, E);
    SdpaOptions so;
    so.backend = Backend::fused;
    try {
      (void)resolve_backend(a, so);
      backends.push_back(Backend::fused);
    } catch (const Error& e) {
      fmt::print("  fused backend unavailable here ({})\n", e.what());
    }
  }
  fmt::print("  shape (B, H, L = S, E) = (1, {}, n, {}), float32, causal off; median of {} runs\n\n", H, E, reps);
  std::vector<std::string> lines;
  Progress bar("timing backends", int64_t(sizes.size() * backends.size()) * (reps + 1));
  int64_t done = 0;
  std::mt19937_64 rng(o.seed);
  std::normal_distribution<float> nd;
  std::map<Backend, std::pair<int64_t, double>> measured;
  for (int64_t n : sizes) {
    std::vector<float> q(size_t(H * n * E)), k(q.size()), v(q.size()), ref(q.size()), out(q.size());
    for (auto* t : {&q, &k, &v})
      for (auto& z : *t) z = nd(rng);
    SdpaArgs<float> a;
    a.q = View4<const float>::bhnd(q.data(), 1, H, n, E);
    a.k = View4<const float>::bhnd(k.data(), 1, H, n, E);
    a.v = View4<const float>::bhnd(v.data(), 1, H, n, E);
    double ref_ms = 0;
    for (Backend b : backends) {
      // Skip a size whose runs would take too long at the speed just measured (time grows like n^2).
      const auto [mn, mms] = measured[b];  // the last size timed for this backend
      const double guess = mms * double(n * n) / double(std::max<int64_t>(mn, 1) * std::max<int64_t>(mn, 1)) * (reps + 1);
      if (mn > 0 && guess > 25000) {
        lines.push_back(fmt::format("  n = {:>5}  {:<9} skipped (about {:.0f} s at the speed measured for n = {})", n,
                                    backend_name(b), guess / 1e3, mn));
        done += reps + 1;
        bar.tick(done);
        continue;
      }
      SdpaOptions so;
      so.backend = b;
      auto& dst = b == Backend::reference ? ref : out;
      std::vector<double> ms;
      for (int r = 0; r <= reps; ++r) {  // run 0 is a warm-up and the validation run
        const auto t0 = std::chrono::steady_clock::now();
        scaled_dot_product_attention<float>(a, {View4<float>::bhnd(dst.data(), 1, H, n, E)}, so);
        const auto t1 = std::chrono::steady_clock::now();
        if (r > 0) ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
        bar.tick(++done);
      }
      std::sort(ms.begin(), ms.end());
      const double med = ms[ms.size() / 2];
      measured[b] = {n, med};
      const double gflop = 4.0 * double(H) * double(n) * double(n) * double(E) / 1e9;
      std::string check = "(the reference)";
      if (b == Backend::reference) {
        ref_ms = med;
      } else if (ref_ms == 0) {
        check = "(reference skipped at this size; validated at the smaller sizes)";
      } else {
        double err = 0;
        for (size_t i = 0; i < out.size(); ++i) err = std::max(err, double(std::abs(out[i] - ref[i])));
        check = fmt::format("max |diff| vs reference {:.1e}, {:.2f}x the reference's speed", err, ref_ms / med);
      }
      lines.push_back(fmt::format("  n = {:>5}  {:<9} {:>9.2f} ms  {:>7.2f} GFLOP/s  {}", n, backend_name(b), med,
                                  gflop / (med / 1e3), check));
    }
  }
  bar.finish();
  for (const auto& l : lines) fmt::print("{}\n", l);
}

void run_tour(const TourOpts& o) {
  const auto t0 = std::chrono::steady_clock::now();
  fmt::print("attn tour: self-attention, step by step, then measured.\n");
  section("1. Attention by hand: 'the cat was hungry' and the two-token example");
  explain_example("cat");
  fmt::print("\n");
  explain_example("two-tokens");

  section("2. Five claims about attention, measured");
  for (const auto& name : experiment_names()) {
    const auto t = std::chrono::steady_clock::now();
    const auto r = run_experiment(name, o.seed);
    fmt::print("\n[{}] ", name);
    print_experiment(r);
    fmt::print("  ({:.1f} s)\n", std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count());
  }

  section("3. Multi-head attention on a sentence");
  sentence(o);

  section("4. Speed: the backends side by side");
  speed(o);

  fmt::print("\nTour finished in {:.1f} s. Next: `attn explain --example random --heads 2`, `attn experiment "
             "variance --plot variance.png`, `attn --help`.\n",
             std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

}  // namespace

void add_tour(CLI::App& app) {
  auto o = std::make_shared<TourOpts>();
  auto* c = app.add_subcommand("tour", "A one-minute walk through attention: examples, experiments, heatmap, speed");
  c->add_option("--heatmap", o->heatmap, "where to write the sentence's heatmap")->capture_default_str();
  c->add_flag("--quick", o->quick, "one small size in the speed comparison (for tests)");
  c->add_option("--seed", o->seed, "random seed")->capture_default_str();
  c->footer(kExitCodesHelp);
  c->callback([o] { run_tour(*o); });
}

}  // namespace attn::cli
