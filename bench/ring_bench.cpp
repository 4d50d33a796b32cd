// ring-bench: times context-parallel attention (attn::dist) against the
// single-process fused kernel. Run under mpirun; bench/ring_bench.sh runs the
// sequence of docs/distributed.md (P = 1 and 2 with one thread each, and one
// process with two threads).
//
//   mpirun -np P ring-bench --N 16384 --H 8 --E 64 --causal --threads 1 --mode ring
//
// --mode single times the plain call (each rank on its own copy; meant for
// -np 1), ring and ulysses the distributed calls. Each mode is first
// validated at a small size against the single-process result (every rank
// checks its own shard), then timed: median of --reps of the forward and of
// forward + backward (wall time of the slowest rank), plus, for the ring,
// where the time went (compute, waiting for transfers) and the time of the
// same transfers alone (the K/V shards, and in the backward the dK/dV
// accumulators, sent around the ring without any attention), from which the
// fraction of communication hidden behind computation follows:
//   hidden = 1 − (waiting with compute) / (transfers alone).
// Prints one JSON line on rank 0.
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attn/dist.hpp"

namespace {

struct Args {
  int64_t B = 1, H = 8, Hkv = 0, N = 16384, E = 64;
  int threads = 1, reps = 3;
  bool causal = false, backward = true;
  std::string mode = "ring";
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "ring-bench: %s\nusage: ring-bench [--N n] [--B b] [--H h] [--Hkv h] [--E e] [--threads t] [--reps r]\n"
               "                  [--causal] [--no-backward] [--mode single|ring|ulysses]\n",
               why.c_str());
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) usage("missing value for " + f);
      return argv[++i];
    };
    if (f == "--N") a.N = std::stoll(val());
    else if (f == "--B") a.B = std::stoll(val());
    else if (f == "--H") a.H = std::stoll(val());
    else if (f == "--Hkv") a.Hkv = std::stoll(val());
    else if (f == "--E") a.E = std::stoll(val());
    else if (f == "--threads") a.threads = std::stoi(val());
    else if (f == "--reps") a.reps = std::stoi(val());
    else if (f == "--causal") a.causal = true;
    else if (f == "--no-backward") a.backward = false;
    else if (f == "--mode") a.mode = val();
    else usage("unknown flag " + f);
  }
  if (a.Hkv == 0) a.Hkv = a.H;
  if (a.mode != "single" && a.mode != "ring" && a.mode != "ulysses") usage("unknown mode " + a.mode);
  if (a.N < 1 || a.B < 1 || a.H < 1 || a.E < 1 || a.threads < 1 || a.reps < 1 || a.H % a.Hkv) usage("bad sizes");
  return a;
}

int P_ = 1, r_ = 0;

struct Problem {
  attn::Tensor<float> q, k, v, dout, out, lse, dq, dk, dv;
  attn::SdpaArgs<float> args() const {
    attn::SdpaArgs<float> s;
    s.q = q.view4();
    s.k = k.view4();
    s.v = v.view4();
    return s;
  }
};

// This rank's shard (or, for `single`, everything) of a seeded random problem.
Problem make(const Args& a, int64_t N, bool whole, attn::dist::Layout lay) {
  std::mt19937_64 rng(42);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto full = [&](int64_t h) {
    attn::Tensor<float> t({a.B, h, N, a.E});
    for (size_t i = 0; i < t.size(); ++i) t[i] = nd(rng);
    return t;
  };
  auto mine = [&](const attn::Tensor<float>& f) {
    if (whole) return f;
    attn::Tensor<float> t({f.dim(0), f.dim(1), attn::dist::shard_length(N, P_, r_, lay), f.dim(3)});
    attn::dist::shard(f.view4(), t.view4(), P_, r_, lay);
    return t;
  };
  Problem p;
  p.q = mine(full(a.H));
  p.k = mine(full(a.Hkv));
  p.v = mine(full(a.Hkv));
  p.dout = mine(full(a.H));
  p.out = attn::Tensor<float>(p.q.shape());
  p.lse = attn::Tensor<float>({a.B, a.H, p.q.dim(2)});
  p.dq = attn::Tensor<float>(p.q.shape());
  p.dk = attn::Tensor<float>(p.k.shape());
  p.dv = attn::Tensor<float>(p.v.shape());
  return p;
}

attn::dist::DistOptions options(const Args& a) {
  attn::dist::DistOptions o;
  o.sdpa.causal = a.causal;
  o.sdpa.num_threads = a.threads;
  o.layout = a.causal ? attn::dist::Layout::zigzag : attn::dist::Layout::contiguous;
  return o;
}

// One forward (and backward) of the chosen mode; stats of the ring calls.
void step(const Args& a, Problem& p, bool backward, attn::dist::RingStats* f, attn::dist::RingStats* b) {
  const auto o = options(a);
  const auto args = p.args();
  const attn::View4<const float> dout(p.dout.view4());
  const attn::SdpaOutputs<float> outputs{p.out.view4(), {}, p.lse.view<3>()};
  const attn::SdpaSaved<float> saved{attn::View4<const float>(p.out.view4()), attn::View3<const float>(p.lse.view<3>())};
  const attn::SdpaGrads<float> g{p.dq.view4(), p.dk.view4(), p.dv.view4(), {}};
  if (a.mode == "single") {
    attn::SdpaOptions so = o.sdpa;
    so.backend = attn::Backend::fused;
    attn::scaled_dot_product_attention(args, outputs, so);
    if (backward) attn::scaled_dot_product_attention_backward(args, dout, saved, g, so);
  } else if (a.mode == "ring") {
    attn::dist::ring_attention(MPI_COMM_WORLD, args, outputs, o, f);
    if (backward) attn::dist::ring_attention_backward(MPI_COMM_WORLD, args, dout, saved, g, o, b);
  } else {
    attn::dist::ulysses_attention(MPI_COMM_WORLD, args, outputs, o);
    if (backward) attn::dist::ulysses_attention_backward(MPI_COMM_WORLD, args, dout, saved, g, o);
  }
}

// Validation at a small size: every rank's shard against one fused call.
double validate(const Args& big) {
  Args a = big;
  a.N = 300;
  a.B = 1;
  const auto lay = options(a).layout;
  Problem d = make(a, a.N, a.mode == "single", lay);
  step(a, d, true, nullptr, nullptr);
  Args s = a;
  s.mode = "single";
  Problem w = make(s, a.N, true, lay);
  step(s, w, true, nullptr, nullptr);
  auto worst = [&](const attn::Tensor<float>& got, const attn::Tensor<float>& full) {
    attn::Tensor<float> want = got;
    if (a.mode != "single") attn::dist::shard(full.view4(), want.view4(), P_, r_, lay);
    else want = full;
    double m = 0;
    for (size_t i = 0; i < got.size(); ++i) m = std::max(m, double(std::abs(got[i] - want[i])));
    return m;
  };
  double m = std::max({worst(d.out, w.out), worst(d.dq, w.dq), worst(d.dk, w.dk), worst(d.dv, w.dv)});
  MPI_Allreduce(MPI_IN_PLACE, &m, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return m;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
double slowest(double t) {
  MPI_Allreduce(MPI_IN_PLACE, &t, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return t;
}

// The ring's transfers alone: P − 1 shifts of the K/V shards (forward), and
// in the backward also P shifts of the same volume (dK/dV).
double transfers_alone(const Problem& p, int shifts) {
  const int next = (r_ + 1) % P_, prev = (r_ + P_ - 1) % P_;
  std::vector<float> a(p.k.size() + p.v.size() + 64), b(a.size());
  MPI_Barrier(MPI_COMM_WORLD);
  const double t0 = MPI_Wtime();
  for (int s = 0; s < shifts; ++s) {
    MPI_Sendrecv(a.data(), int(a.size()), MPI_FLOAT, next, 7, b.data(), int(b.size()), MPI_FLOAT, prev, 7,
                 MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    std::swap(a, b);
  }
  return slowest(MPI_Wtime() - t0);
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_size(MPI_COMM_WORLD, &P_);
  MPI_Comm_rank(MPI_COMM_WORLD, &r_);
  const Args a = parse(argc, argv);
  try {
    const double err = validate(a);
    if (!(err < 1e-3)) {
      if (r_ == 0) std::fprintf(stderr, "ring-bench: validation FAILED: largest difference %.3g\n", err);
      MPI_Abort(MPI_COMM_WORLD, 1);
    }
    Problem p = make(a, a.N, a.mode == "single", options(a).layout);
    std::vector<double> tf, tfb, cf, wf, cb, wb;
    for (int rep = 0; rep < a.reps; ++rep) {
      attn::dist::RingStats f, b;
      MPI_Barrier(MPI_COMM_WORLD);
      double t0 = MPI_Wtime();
      step(a, p, false, &f, nullptr);
      tf.push_back(slowest(MPI_Wtime() - t0));
      cf.push_back(slowest(f.compute_s));
      wf.push_back(slowest(f.wait_s));
      if (a.backward) {
        MPI_Barrier(MPI_COMM_WORLD);
        t0 = MPI_Wtime();
        step(a, p, true, &f, &b);
        tfb.push_back(slowest(MPI_Wtime() - t0));
        cb.push_back(slowest(f.compute_s + b.compute_s));
        wb.push_back(slowest(f.wait_s + b.wait_s));
      }
    }
    const double comm_f = a.mode == "ring" ? transfers_alone(p, P_ - 1) : 0;
    const double comm_fb = a.mode == "ring" ? comm_f + transfers_alone(p, (P_ - 1) + P_) : 0;
    if (r_ == 0) {
      const double flops = 4.0 * double(a.B * a.H) * double(a.N) * double(a.N) * double(a.E) * (a.causal ? 0.5 : 1.0);
      std::printf(
          "{\"mode\": \"%s\", \"P\": %d, \"threads\": %d, \"B\": %lld, \"H\": %lld, \"Hkv\": %lld, \"N\": %lld, "
          "\"E\": %lld, \"causal\": %s, \"validation_max_abs_diff\": %.3g, \"forward_s\": %.4f, "
          "\"forward_gflops\": %.2f, \"forward_compute_s\": %.4f, \"forward_wait_s\": %.4f, "
          "\"forward_transfers_alone_s\": %.4f",
          a.mode.c_str(), P_, a.threads, (long long)a.B, (long long)a.H, (long long)a.Hkv, (long long)a.N,
          (long long)a.E, a.causal ? "true" : "false", err, median(tf), flops / median(tf) * 1e-9, median(cf),
          median(wf), comm_f);
      if (a.backward)
        std::printf(", \"fwd_bwd_s\": %.4f, \"fwd_bwd_gflops\": %.2f, \"fwd_bwd_compute_s\": %.4f, "
                    "\"fwd_bwd_wait_s\": %.4f, \"fwd_bwd_transfers_alone_s\": %.4f",
                    median(tfb), 3.5 * flops / median(tfb) * 1e-9, median(cb), median(wb), comm_fb);
      std::printf(", \"reps\": %d}\n", a.reps);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ring-bench (rank %d): %s\n", r_, e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  MPI_Finalize();
  return 0;
}
