// Ring attention across MPI processes on data each process makes itself.
//
//   mpirun -np 2 build/ring_example [N] [H] [E]
//
// Every rank generates only its own rows of a causal self-attention problem
// (row i of the sequence is drawn from a generator seeded by i, so the full
// sequence is the same whatever P is), in the zig-zag layout that balances
// causal work. The ranks run the ring forward and backward, then rank 0
// gathers the output and checks it against one single-process call.
#include <mpi.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "attn/dist.hpp"

namespace {

// Row i of head h of a (1, H, N, F) tensor: F values seeded by (which, h, i).
void fill_row(float* dst, int64_t F, int which, int64_t h, int64_t i) {
  std::mt19937_64 rng(uint64_t(which) * 1000003u + uint64_t(h) * 7919u + uint64_t(i));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int64_t e = 0; e < F; ++e) dst[e] = nd(rng);
}

// This rank's shard of tensor `which`: its chunks' rows, one after the other.
attn::Tensor<float> make_shard(int which, int64_t H, int64_t N, int64_t F, int P, int r) {
  using attn::dist::Layout;
  attn::Tensor<float> t({1, H, attn::dist::shard_length(N, P, r, Layout::zigzag), F});
  for (int64_t h = 0; h < H; ++h) {
    int64_t li = 0;
    for (const auto& c : attn::dist::chunk_layout(N, P, r, Layout::zigzag))
      for (int64_t i = c.begin; i < c.begin + c.length; ++i, ++li)
        fill_row(t.data() + (h * t.dim(2) + li) * F, F, which, h, i);
  }
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int P = 1, r = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &P);
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  const int64_t N = argc > 1 ? std::stoll(argv[1]) : 1000, H = argc > 2 ? std::stoll(argv[2]) : 4,
                E = argc > 3 ? std::stoll(argv[3]) : 32;
  int rc = 0;
  try {
    const auto q = make_shard(0, H, N, E, P, r), k = make_shard(1, H, N, E, P, r), v = make_shard(2, H, N, E, P, r);
    const auto dout = make_shard(3, H, N, E, P, r);
    attn::SdpaArgs<float> a;
    a.q = q.view4();
    a.k = k.view4();
    a.v = v.view4();
    attn::dist::DistOptions opt;
    opt.sdpa.causal = true;
    opt.layout = attn::dist::Layout::zigzag;
    const int64_t Lr = q.dim(2);
    attn::Tensor<float> out({1, H, Lr, E}), lse({1, H, Lr}), dq({1, H, Lr, E}), dk({1, H, Lr, E}), dv({1, H, Lr, E});
    attn::dist::RingStats fwd, bwd;
    attn::dist::ring_attention(MPI_COMM_WORLD, a, {out.view4(), {}, lse.view<3>()}, opt, &fwd);
    attn::dist::ring_attention_backward(MPI_COMM_WORLD, a, attn::View4<const float>(dout.view4()),
                                        {attn::View4<const float>(out.view4()), attn::View3<const float>(lse.view<3>())},
                                        {dq.view4(), dk.view4(), dv.view4(), {}}, opt, &bwd);
    // Rank 0 gathers every shard of the output and unshards it.
    std::vector<int> counts(static_cast<size_t>(P)), displs(static_cast<size_t>(P));
    for (int p = 0; p < P; ++p) counts[size_t(p)] = int(H * attn::dist::shard_length(N, P, p, opt.layout) * E);
    for (int p = 1; p < P; ++p) displs[size_t(p)] = displs[size_t(p - 1)] + counts[size_t(p - 1)];
    std::vector<float> all(size_t(H * N * E));
    MPI_Gatherv(out.data(), int(out.size()), MPI_FLOAT, all.data(), counts.data(), displs.data(), MPI_FLOAT, 0,
                MPI_COMM_WORLD);
    if (r == 0) {
      attn::Tensor<float> full({1, H, N, E});
      for (int p = 0; p < P; ++p) {
        const int64_t n = attn::dist::shard_length(N, P, p, opt.layout);
        attn::View4<const float> shard(all.data() + displs[size_t(p)], {1, H, n, E});
        attn::dist::unshard(shard, full.view4(), P, p, opt.layout);
      }
      // The same problem in one process (one rank's "shard" is the whole sequence in order).
      const auto fq = make_shard(0, H, N, E, 1, 0), fk = make_shard(1, H, N, E, 1, 0), fv = make_shard(2, H, N, E, 1, 0);
      attn::Tensor<float> ref({1, H, N, E});
      attn::SdpaArgs<float> fa;
      fa.q = fq.view4();
      fa.k = fk.view4();
      fa.v = fv.view4();
      attn::SdpaOptions so;
      so.causal = true;
      attn::scaled_dot_product_attention(fa, {ref.view4()}, so);
      double worst = 0;
      for (size_t i = 0; i < ref.size(); ++i) worst = std::max(worst, double(std::abs(full[i] - ref[i])));
      std::printf("ring attention: N = %lld, H = %lld, E = %lld on %d rank(s)\n", (long long)N, (long long)H,
                  (long long)E, P);
      std::printf("  forward  %.3f s (compute %.3f s, waiting %.3f s), backward %.3f s (compute %.3f s, waiting %.3f s)\n",
                  fwd.total_s, fwd.compute_s, fwd.wait_s, bwd.total_s, bwd.compute_s, bwd.wait_s);
      std::printf("  largest |ring - single process| of the output: %.3g\n", worst);
      if (!(worst < 1e-4)) rc = 1;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ring_example (rank %d): %s\n", r, e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  MPI_Bcast(&rc, 1, MPI_INT, 0, MPI_COMM_WORLD);
  MPI_Finalize();
  return rc;
}
