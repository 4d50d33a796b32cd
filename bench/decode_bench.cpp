// attn-decode-bench: decoding over a KV cache, validated, then timed, side by
// side with the dense call and the per-head fused kernel on the same keys and
// values, against the machine's memory read bandwidth measured in the same
// run.
//
// For each shape (B, H, Hkv, L, S, E) and storage type: a cache of S tokens
// per sequence (the L queries are its last L tokens, bottom-right causal),
// then
//   decode     attn::decode_attention (the grouped split-KV kernel)
//   read       the bound: one plain read of the bytes decode reads, in place
//              (contiguous caches), by the same threads, also cold
//   dense      attn::scaled_dot_product_attention on the contiguous cache's
//              storage viewed as dense (B, Hkv, S, E) tensors (auto backend;
//              few query rows take the same kernel); float16/bfloat16 storage
//              as half k, v (and q rounded to it), read in place
//   per-head   the fused kernel called directly, one unit per query head (the
//              path the dense call took before the decode kernel), float32
// GB/s counts the K and V bytes once (B·Hkv·S·(E + Ev)·element size; with
// --window W, of the last L + W keys, the ones some query sees), the
// minimum any exact kernel must read; "% bw" relates it to the measured read
// bandwidth (wall time against wall time): every timed call follows one pass
// of the bandwidth measurement (which also evicts the caches, so each call
// reads K/V from memory), and "% bw" is the median call against the median
// of those passes (column bw). GB/cpu-s and "% cpu" do the same
// per CPU-second of the threads (the rate had each thread its core to
// itself): on a machine other processes load, the steadier pair. GFLOP/s
// counts 4·E flops per visible (query, key) pair.
//
// Threads: a decode loop's parallel regions follow each other closely, so
// this program, like `attn generate`, lets OpenMP's threads spin briefly
// between regions (GOMP_SPINCOUNT=10000, apps/passive_wait) when the
// environment sets no policy; the bandwidth pass before each call then
// leaves them awake, as the layers before attention do in a model. The
// header and the JSON name the policy in effect; OMP_WAIT_POLICY=passive
// measures calls that first wake a sleeping thread. GB/cpu-s and "% cpu"
// mean something only with passive waiting: Linux adds a thread's CPU time
// to the process's clock when it stops running, and a spinning thread runs
// on, so the CPU time would be undercounted (% cpu over 100): the columns
// show "-" unless the threads sleep (OMP_WAIT_POLICY=passive).
#include <omp.h>
#include <strings.h>
#include <time.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "attn/attn.hpp"
#include "attn/kv_cache.hpp"
#include "fma_peak.hpp"
#include "kernels/decode/decode.hpp"
#include "kernels/fused/fused.hpp"
#include "passive_wait.hpp"
#include "read_bandwidth.hpp"
#include "simd_target.hpp"

namespace {

using attn::Dtype;
using attn::Tensor;
using attn::View3;
using attn::View4;

// The arguments of decode_attention: q over `cache`, no rule operands.
attn::DecodeArgs decode_args(const Tensor<float>& q, const attn::KVCache& cache) {
  attn::DecodeArgs a;
  a.q = q.view4();
  a.cache = &cache;
  return a;
}

struct Shape {
  int64_t B, H, Hkv, L, S, E;
  std::string str() const {
    std::ostringstream os;
    os << B << "," << H << "," << Hkv << "," << L << "," << S << "," << E;
    return os.str();
  }
};

std::vector<Shape> parse_shapes(const std::string& text) {
  std::vector<Shape> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ';')) {
    Shape s{};
    if (std::sscanf(item.c_str(), "%ld,%ld,%ld,%ld,%ld,%ld", &s.B, &s.H, &s.Hkv, &s.L, &s.S, &s.E) != 6)
      throw attn::InvalidArgument("--shapes: '" + item + "' is not B,H,Hkv,L,S,E");
    out.push_back(s);
  }
  return out;
}

// Deterministic values in [-1, 1) without the cost of a normal generator
// (the largest cache holds a quarter of a billion numbers).
float hash_value(uint64_t i) {
  i ^= i >> 33;
  i *= 0xff51afd7ed558ccdULL;
  i ^= i >> 33;
  i *= 0xc4ceb9fe1a85ec53ULL;
  i ^= i >> 33;
  return float(double(i >> 11) * 0x1.0p-52 - 1.0);
}

void fill_cache(attn::KVCache& cache, const Shape& s) {
  const int64_t block = 1024;
  Tensor<float> k({s.Hkv, block, s.E}), v({s.Hkv, block, s.E});
  // The sequences grow together, block by block, as a server's do: in a
  // paged cache their pages interleave in the pool (one page in B is each
  // sequence's), not one sequence's pages in a row.
  for (int64_t t0 = 0; t0 < s.S; t0 += block)
    for (int64_t b = 0; b < s.B; ++b) {
      const int64_t n = std::min(block, s.S - t0);
      for (size_t i = 0; i < k.size(); ++i) {
        k[i] = hash_value(uint64_t((b * s.S + t0) * s.Hkv * s.E) * 2 + i);
        v[i] = hash_value(uint64_t((b * s.S + t0) * s.Hkv * s.E) * 2 + i + (uint64_t(1) << 60));
      }
      cache.append(b, View3<const float>(k.data(), {s.Hkv, n, s.E}, {block * s.E, s.E, 1}),
                   View3<const float>(v.data(), {s.Hkv, n, s.E}, {block * s.E, s.E, 1}));
    }
}

using attn_bench::cpu_seconds;

struct Timing {
  double wall = 0, cpu = 0;  // medians, seconds per call (cpu: all threads together)
  int reps = 0;
  attn_bench::ReadBandwidth bw;  // medians of the bandwidth passes paired with the calls
};

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  return x[x.size() / 2];
}

// What comes before each timed call: one pass of the bandwidth probe, or,
// with --warm, nothing (the call then finds whatever of its K/V the caches
// kept from the call before; the bandwidth columns show the header's best of
// 5 passes). Warm calls on a shape whose K/V fit the L2/L3 measure the
// kernel's arithmetic rate, the bound of the grouped half-precision shapes
// (docs/decode.md, "Half storage is bound by its arithmetic").
struct Rounds {
  const attn_bench::BandwidthProbe& probe;
  bool warm;
  attn_bench::ReadBandwidth best;
  attn_bench::ReadBandwidth before_call() const { return warm ? best : probe.pass(); }
};

// Medians over at least 3 rounds and about min_seconds. A round is one pass
// of the bandwidth probe, then one timed call: every call reads its K/V from
// memory (the pass evicts the caches, as the other layers of a model do
// between two decoding steps), and the bandwidth it is compared with is
// measured in the same seconds, so the drift of a shared machine cancels.
template <class F>
Timing time_it(F&& f, double min_seconds, const Rounds& rounds) {
  f();  // warm-up (page faults)
  std::vector<double> wall, cpu, bw, bw_cpu;
  const auto start = std::chrono::steady_clock::now();
  while (wall.size() < 3 || std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < min_seconds) {
    const attn_bench::ReadBandwidth b = rounds.before_call();
    bw.push_back(b.wall), bw_cpu.push_back(b.cpu);
    const double c0 = cpu_seconds();
    const auto t0 = std::chrono::steady_clock::now();
    f();
    wall.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    cpu.push_back(cpu_seconds() - c0);
    if (wall.size() >= 200) break;
  }
  return {median(wall), median(cpu), int(wall.size()), {median(bw), median(bw_cpu)}};
}

double max_abs_diff(const Tensor<float>& a, const Tensor<float>& b) {
  double d = 0;
  for (size_t i = 0; i < a.size(); ++i) d = std::max(d, std::abs(double(a[i]) - double(b[i])));
  return d;
}

std::string sci(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1e", x);
  return buf;
}

// A causal sliding window of `window` keys before each query (−1: none),
// the one score rule the benchmark can add (--window).
int64_t g_window = -1;

double visible_pairs(const Shape& s) {
  // Bottom-right causal: query i sits at S − L + i and sees the keys from
  // max(0, that − window) to it.
  double n = 0;
  for (int64_t i = 0; i < s.L; ++i) {
    const int64_t pos = s.S - s.L + i;
    n += double(pos + 1 - (g_window < 0 ? 0 : std::max<int64_t>(0, pos - g_window)));
  }
  return double(s.B) * double(s.H) * n;
}

// Keys any query of a sequence sees: all S, or the last L + window.
int64_t keys_read(const Shape& s) { return g_window < 0 ? s.S : std::min(s.S, s.L + g_window); }

// One storage type's cache of a shape, kept for the paired rounds, and
// whether the call takes bfloat16 products (compute_dtype bfloat16; the
// label then says "+bf16").
struct Kept {
  std::string dtype;
  std::shared_ptr<attn::KVCache> cache;
  bool bf16 = false;
  std::string label() const { return dtype + (bf16 ? "+bf16" : ""); }
};

// Half storage against float32, paired: rounds in which every storage type's
// call (and, with --bf16-compute, the float32 and bfloat16 caches' with
// bfloat16 products) runs once, each after its own bandwidth pass (which evicts the
// caches; none with --warm), the order rotating from round to round; the speed-up of a type is
// the median over the rounds of (float32 time / its time) within a round. On
// a machine whose memory speed drifts or switches between modes (docs/decode.md),
// calls of one round meet the same conditions, where the separate medians of
// the table above may have met different ones.
void paired_rounds(const Shape& s, const Tensor<float>& q, const std::vector<Kept>& kept, int threads,
                   double min_seconds, const Rounds& rounds, bool quiet, nlohmann::json& doc) {
  size_t base = kept.size();
  for (size_t i = 0; i < kept.size(); ++i)
    if (kept[i].dtype == "float32" && !kept[i].bf16) base = i;
  if (base == kept.size() || kept.size() < 2) return;
  Tensor<float> out({s.B, s.H, s.L, s.E});
  attn::SdpaOptions opt;
  opt.num_threads = threads;
  opt.causal = true;
  opt.window = {g_window, 0};
  attn::SdpaOptions bf16 = opt;
  bf16.compute_dtype = Dtype::bfloat16;
  const size_t n = kept.size();
  std::vector<std::vector<double>> ratio(n);
  const auto start = std::chrono::steady_clock::now();
  for (size_t round = 0; round < 5 || std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < n * min_seconds; ++round) {
    std::vector<double> t(n);
    for (size_t k = 0; k < n; ++k) {
      const size_t i = (round + k) % n;
      (void)rounds.before_call();
      const auto t0 = std::chrono::steady_clock::now();
      attn::decode_attention(decode_args(q, *kept[i].cache), {out.view4()}, kept[i].bf16 ? bf16 : opt);
      t[i] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    for (size_t i = 0; i < n; ++i) ratio[i].push_back(t[base] / t[i]);
    if (round >= 199) break;
  }
  std::string line;
  for (size_t i = 0; i < n; ++i) {
    if (i == base) continue;
    const double r = median(ratio[i]);
    char buf[96];
    std::snprintf(buf, sizeof buf, "%s%s %.2fx", line.empty() ? "" : ", ", kept[i].label().c_str(), r);
    line += buf;
    doc["paired"].push_back({{"shape", {s.B, s.H, s.Hkv, s.L, s.S, s.E}}, {"dtype", kept[i].dtype},
                             {"compute", kept[i].bf16 ? "bfloat16" : "float32"}, {"speedup_vs_float32", r},
                             {"rounds", ratio[i].size()}});
  }
  if (!quiet)
    std::printf("%-22s paired, decode, speed-up over float32 in the same rounds: %s (median of %zu rounds)\n",
                s.str().c_str(), line.c_str(), ratio[base].size());
  std::fflush(stdout);
}

// Whether OpenMP's waiting threads sleep at once (then the process's CPU
// clock accounts for every thread by the end of a call).
bool threads_sleep() {
  const char* policy = std::getenv("OMP_WAIT_POLICY");
  const char* spin = std::getenv("GOMP_SPINCOUNT");
  return (policy && strcasecmp(policy, "passive") == 0 && !spin) || (spin && std::strcmp(spin, "0") == 0);
}

// OpenMP's wait policy in effect, as the environment gives it.
std::string wait_policy() {
  const char* policy = std::getenv("OMP_WAIT_POLICY");
  const char* spin = std::getenv("GOMP_SPINCOUNT");
  std::string s;
  if (policy) s += std::string("OMP_WAIT_POLICY=") + policy;
  if (spin) s += std::string(s.empty() ? "" : " ") + "GOMP_SPINCOUNT=" + spin;
  return s.empty() ? "libgomp's default" : s;
}

}  // namespace

// The decode loop's brief spin unless the environment chose a policy.
extern "C" const char* attn_wait_policy(int, char**) { return kDecodeSpin; }

int main(int argc, char** argv) {
  CLI::App app{"attn-decode-bench: decoding over a KV cache against memory bandwidth, PyTorch and ggml"};
  std::string shapes_text =
      "1,32,8,1,4096,128;1,32,8,1,32768,128;1,8,8,1,16384,64;4,32,8,1,8192,128;1,32,8,1,131072,128;1,32,8,512,8192,128";
  std::vector<std::string> dtypes{"float32", "float16", "bfloat16"};
  int threads = omp_get_max_threads();
  int64_t page = 0;
  double min_seconds = 1.0;
  int64_t bw_mib = 256;
  std::string json;
  bool no_dense = false;
  app.add_option("--shapes", shapes_text, "B,H,Hkv,L,S,E;... (E = Ev)");
  app.add_option("--dtypes", dtypes, "cache storage: float32, float16, bfloat16")->delimiter(',');
  app.add_option("--threads", threads, "threads for every variant");
  app.add_option("--page", page, "paged cache with pages of this many tokens (0 = contiguous)");
  app.add_option("--min-seconds", min_seconds, "time each variant for at least this long (median of the runs)");
  app.add_option("--bandwidth-mib", bw_mib, "buffer size of the read-bandwidth measurement (well above the L3)");
  app.add_option("--json", json, "also write the results as JSON to this file ('-' = stdout only)");
  app.add_flag("--no-dense", no_dense, "skip the dense-call and per-head variants");
  bool bf16_compute = false;
  app.add_flag("--bf16-compute", bf16_compute,
               "also run the float32 and bfloat16 caches with compute_dtype bfloat16 (bfloat16 products; float16 "
               "caches stay exact, and so do all on CPUs where the products do not pay, docs/decode.md) in the paired "
               "rounds (dtype+bf16), each checked against the float32 cache's result");
  app.add_option("--window", g_window,
                 "a causal sliding window: each query sees itself and this many keys before it (-1 = none); "
                 "GB/s then counts the keys some query sees");
  bool warm = false;
  app.add_flag("--warm", warm,
               "no bandwidth pass before each call: K/V stay in the caches where they fit (the arithmetic rate)");
  std::string target = "best";
  app.add_option("--target", target, "SIMD target of the kernels (AVX3, AVX2, SSE4, ...; best: the best the CPU runs)");
  CLI11_PARSE(app, argc, argv);
  if (!attn_bench::limit_simd_target(target)) {
    std::fprintf(stderr, "attn-decode-bench: --target: '%s' is not a SIMD target this CPU runs\n", target.c_str());
    return 2;
  }
  const bool quiet = json == "-";
  std::vector<Shape> shapes;
  try {
    shapes = parse_shapes(shapes_text);
    for (auto& d : dtypes) (void)attn::parse_dtype(d);
  } catch (const attn::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }

  const attn_bench::BandwidthProbe probe(threads, bw_mib << 20);
  attn_bench::ReadBandwidth rb;  // best of 5 passes, for the header
  for (int rep = 0; rep < 5; ++rep) {
    const attn_bench::ReadBandwidth r = probe.pass();
    rb.wall = std::max(rb.wall, r.wall), rb.cpu = std::max(rb.cpu, r.cpu);
  }
  const double bw = rb.wall, bw_cpu = rb.cpu;
  const Rounds rounds{probe, warm, rb};
  const double peak = attn_bench::fma_peak_gflops(threads, 0.3);
  nlohmann::json doc;
  doc["threads"] = threads;
  doc["read_bandwidth_gbs"] = bw;
  doc["read_bandwidth_gbs_per_cpu_s"] = bw_cpu;
  doc["fma_peak_gflops"] = peak;
  doc["target"] = attn::detail::decode_target_name();
  doc["wait_policy"] = wait_policy();
  const bool cpu_columns = threads_sleep();
  doc["page"] = page;
  doc["warm"] = warm;
  doc["window"] = g_window;
  doc["rows"] = nlohmann::json::array();
  doc["paired"] = nlohmann::json::array();
  if (!quiet) {
    std::printf("attn-decode-bench: %d threads (%s), %s, read bandwidth %.1f GB/s best of 5 (%.1f GB/cpu-s), FMA "
                "peak %.0f GFLOP/s, %s cache%s; %s\n",
                threads, wait_policy().c_str(), attn::detail::decode_target_name(), bw, bw_cpu, peak,
                page ? ("paged (" + std::to_string(page) + " tokens/page)").c_str() : "contiguous",
                g_window < 0 ? "" : (", sliding window of " + std::to_string(g_window) + " keys").c_str(),
                warm ? "WARM calls (no bandwidth pass between calls; bw: the best of 5)"
                     : "% bw: against the passes paired with the calls (column bw)");
    std::printf("%-22s %-8s %-9s %9s %8s %6s %6s %8s %6s %8s %8s  %s\n", "B,H,Hkv,L,S,E", "dtype", "variant", "ms",
                "GB/s", "bw", "% bw", "GB/cpu-s", "% cpu", "GFLOP/s", "vs dec", "check");
  }
  int status = 0;
  for (const Shape& s : shapes) {
    Tensor<float> q({s.B, s.H, s.L, s.E});
    for (size_t i = 0; i < q.size(); ++i) q[i] = hash_value(i + (uint64_t(3) << 58));
    Tensor<float> out_f32;
    std::vector<Kept> kept;  // the caches of this shape, one per storage type
    for (const std::string& dt : dtypes) {
      const Dtype dtype = attn::parse_dtype(dt);
      attn::KVCacheConfig cfg;
      cfg.batch = s.B, cfg.kv_heads = s.Hkv, cfg.capacity = s.S, cfg.head_dim = s.E;
      cfg.dtype = dtype;
      cfg.page_size = page;
      kept.push_back({dt, std::make_shared<attn::KVCache>(cfg)});
      attn::KVCache& cache = *kept.back().cache;
      fill_cache(cache, s);
      const double elem = dtype == Dtype::float32 ? 4 : 2;
      const double kv_bytes = double(s.B) * double(s.Hkv) * double(keys_read(s)) * double(2 * s.E) * elem;
      const double fl = 4.0 * double(s.E) * visible_pairs(s);
      Tensor<float> out({s.B, s.H, s.L, s.E}), lse({s.B, s.H, s.L});
      attn::SdpaOptions opt;
      opt.num_threads = threads;
      opt.causal = true;
      opt.window = {g_window, 0};
      attn::decode_attention(decode_args(q, cache), {out.view4(), {}, lse.view<3>()}, opt);
      // Validate: the reference on the stored values where affordable,
      // otherwise agreement with the float32 cache's result.
      std::string check;
      const bool small = double(s.H) * double(s.L) * double(s.S) * double(s.B) <= double(1 << 22);
      if (small) {
        attn::SdpaOptions ro = opt;
        ro.backend = attn::Backend::reference;
        Tensor<float> ref({s.B, s.H, s.L, s.E});
        attn::decode_attention(decode_args(q, cache), {ref.view4()}, ro);
        const double d = max_abs_diff(out, ref);
        check = (d < 1e-4 ? "ok vs reference " : "MISMATCH vs reference ") + sci(d);
        if (d >= 1e-4) status = 1;
      } else if (!out_f32.size()) {
        check = "not checked (large; float32 runs first to check the others)";
      } else {
        const double d = max_abs_diff(out, out_f32), tol = dtype == Dtype::float16 ? 5e-3 : 4e-2;
        check = (d < tol ? "ok vs float32 " : "MISMATCH vs float32 ") + sci(d);
        if (d >= tol) status = 1;
      }
      if (dtype == Dtype::float32) out_f32 = out;
      const Timing t_dec =
          time_it([&] { attn::decode_attention(decode_args(q, cache), {out.view4(), {}, lse.view<3>()}, opt); }, min_seconds, rounds);
      // Per CPU-second: the rate had each thread run alone on its core (a
      // loaded machine stretches wall time, much less the CPU time).
      // Only where waiting threads sleep (spinning ones undercount: see the
      // top of the file); "-" and null otherwise.
      auto emit = [&](const char* variant, const Timing& t, const std::string& chk, double flops) {
        const double gbs = kv_bytes / t.wall * 1e-9, cpu_gbs = kv_bytes / (t.cpu / threads) * 1e-9;
        char cpu_cols[32] = "       -      -";
        if (cpu_columns) std::snprintf(cpu_cols, sizeof cpu_cols, "%8.1f %5.0f%%", cpu_gbs, 100 * cpu_gbs / t.bw.cpu);
        if (!quiet)
          std::printf("%-22s %-8s %-9s %9.3f %8.1f %6.1f %5.0f%% %s %8.1f %7.2fx  %s\n", s.str().c_str(), dt.c_str(),
                      variant, t.wall * 1e3, gbs, t.bw.wall, 100 * gbs / t.bw.wall, cpu_cols, flops / t.wall * 1e-9,
                      t.wall / t_dec.wall, chk.c_str());
        std::fflush(stdout);
        const nlohmann::json none;
        doc["rows"].push_back({{"shape", {s.B, s.H, s.Hkv, s.L, s.S, s.E}}, {"dtype", dt}, {"variant", variant},
                               {"ms", t.wall * 1e3}, {"cpu_ms", cpu_columns ? nlohmann::json(t.cpu * 1e3) : none},
                               {"kv_gbs", gbs}, {"kv_gbs_per_cpu_s", cpu_columns ? nlohmann::json(cpu_gbs) : none},
                               {"read_bandwidth_gbs", t.bw.wall}, {"read_bandwidth_gbs_per_cpu_s", t.bw.cpu},
                               {"pct_bandwidth", 100 * gbs / t.bw.wall},
                               {"pct_bandwidth_per_cpu_s", cpu_columns ? nlohmann::json(100 * cpu_gbs / t.bw.cpu) : none},
                               {"gflops", flops / t.wall * 1e-9}, {"reps", t.reps}, {"check", chk}});
      };
      emit("decode", t_dec, check, fl);
      if (page != 0) continue;
      // The bound: one plain read of exactly the bytes decode reads (each
      // (sequence, kv head)'s last keys_read rows of K and of V, in place),
      // by the same threads, in the same rounds (cold, after a pass).
      const attn::detail::KVLayout kv = attn::detail::KVCacheAccess::layout(cache);
      std::vector<attn_bench::Run> runs;
      const int64_t first = s.S - keys_read(s), esz = int64_t(elem);
      for (int64_t b = 0; b < s.B; ++b)
        for (int64_t hk = 0; hk < s.Hkv; ++hk) {
          const auto run_of = [&](const void* base, int64_t page_stride, int64_t head, int64_t row) {
            const char* p = static_cast<const char*>(base) + (b * page_stride + hk * head + first * row) * esz;
            return attn_bench::Run{reinterpret_cast<const float*>(p), keys_read(s) * row * esz / 4};
          };
          runs.push_back(run_of(kv.k, kv.k_page, kv.k_head, kv.k_row));
          runs.push_back(run_of(kv.v, kv.v_page, kv.v_head, kv.v_row));
        }
      volatile float read_sink = 0;
      const Timing t_read = time_it([&] { read_sink = read_sink + attn_bench::read_runs(runs, threads); }, min_seconds, rounds);
      emit("read", t_read, "a plain read of the same bytes (the bound)", 0);
      if (no_dense) continue;
      // The same keys and values as dense tensors: the contiguous cache's
      // storage, viewed (half storage as attn::float16_t / bfloat16_t k, v,
      // with q rounded to the same type: the dense call's half route).
      attn::SdpaOptions so;
      so.causal = true;
      so.causal_align = attn::CausalAlign::bottom_right;
      so.window = {g_window, 0};
      so.num_threads = threads;
      Tensor<float> dense_out({s.B, s.H, s.L, s.E});
      const auto dense = [&]<class T>(const Tensor<T>& qt) {
        attn::SdpaArgs<T> a;
        a.q = qt.view4();
        a.k = View4<const T>(static_cast<const T*>(kv.k), {s.B, s.Hkv, s.S, s.E}, {kv.k_page, kv.k_head, kv.k_row, 1});
        a.v = View4<const T>(static_cast<const T*>(kv.v), {s.B, s.Hkv, s.S, s.E}, {kv.v_page, kv.v_head, kv.v_row, 1});
        const Timing t_dense =
            time_it([&] { attn::scaled_dot_product_attention(a, {dense_out.view4(), {}, lse.view<3>()}, so); }, min_seconds, rounds);
        emit("dense", t_dense, "max |diff| vs decode " + sci(max_abs_diff(dense_out, out)), fl);
        return a;
      };
      const auto rounded_q = [&]<class T>(T) {
        Tensor<T> qt(q.shape());
        for (size_t i = 0; i < q.size(); ++i) qt[i] = T(q[i]);
        return qt;
      };
      if (dtype == Dtype::float16) dense(rounded_q(attn::float16_t{}));
      if (dtype == Dtype::bfloat16) dense(rounded_q(attn::bfloat16_t{}));
      if (dtype != Dtype::float32) continue;
      const attn::SdpaArgs<float> a = dense(q);
      attn::SdpaOptions po;
      po.causal = true;
      po.causal_align = attn::CausalAlign::bottom_right;
      po.window = {g_window, -1};
      po.num_threads = threads;
      const attn::detail::Problem p = attn::detail::make_problem(a, po);
      const Timing t_fused =
          time_it([&] { attn::detail::fused_forward(p, a, dense_out.view4(), {}, lse.view<3>()); }, min_seconds, rounds);
      emit("per-head", t_fused, "max |diff| vs decode " + sci(max_abs_diff(dense_out, out)), fl);
    }
    if (bf16_compute) {  // the caches again with bfloat16 products (float16's stay exact), checked against float32's result
      const size_t stored = kept.size();
      for (size_t i = 0; i < stored; ++i) {
        if (kept[i].dtype == "float16") continue;
        kept.push_back({kept[i].dtype, kept[i].cache, true});
        attn::SdpaOptions bo;
        bo.num_threads = threads;
        bo.causal = true;
        bo.window = {g_window, 0};
        bo.compute_dtype = Dtype::bfloat16;
        Tensor<float> out({s.B, s.H, s.L, s.E});
        attn::decode_attention(decode_args(q, *kept.back().cache), {out.view4()}, bo);
        if (!out_f32.size()) continue;
        // q, k, v and P rounded to bfloat16: a few 2^-8 of the values' range.
        const double d = max_abs_diff(out, out_f32), tol = 4e-2;
        if (d >= tol) status = 1;
        if (!quiet)
          std::printf("%-22s %-8s check of compute_dtype bfloat16: %s\n", s.str().c_str(), kept.back().label().c_str(),
                      ((d < tol ? "ok vs float32 " : "MISMATCH vs float32 ") + sci(d)).c_str());
      }
    }
    paired_rounds(s, q, kept, threads, min_seconds, rounds, quiet, doc);
  }
  if (!json.empty()) {
    if (json == "-") std::printf("%s\n", doc.dump(2).c_str());
    else std::ofstream(json) << doc.dump(2) << "\n";
  }
  return status;
}
