// `mpirun -np P attn sdpa ... --context-parallel ring|ulysses`: every rank
// reads the same .npy files, keeps its shard of the sequence (zig-zag for
// causal, contiguous otherwise), runs attn::dist, and rank 0 gathers the
// output (and lse) and writes the same files the single-process command
// would (one output transaction: the paths are checked first, the files
// renamed into place together at the end). Computation is float32.
#include <mpi.h>

#include <fmt/format.h>

#include <array>
#include <optional>
#include <vector>

#include "attn/dist.hpp"
#include "dist.hpp"

namespace attn::cli {
namespace {

// MPI_Init when nobody has, MPI_Finalize on the way out (also after errors).
struct MpiSession {
  bool owner = false;
  MpiSession() {
    int init = 0;
    MPI_Initialized(&init);
    if (!init) {
      MPI_Init(nullptr, nullptr);
      owner = true;
    }
  }
  ~MpiSession() {
    if (owner) MPI_Finalize();
  }
};

// Every rank reads and checks the inputs; if any rank failed, all throw (the
// failing ones with their own error), so no rank waits in a collective (the
// agreement is within the bounded wait of attn/dist.hpp).
template <class F>
void on_every_rank(F&& f) {
  std::exception_ptr err;
  try {
    f();
  } catch (...) {
    err = std::current_exception();
  }
  const int bad = dist::first_failed_rank(MPI_COMM_WORLD, err != nullptr, {}, "attn sdpa");
  if (err) std::rethrow_exception(err);
  if (bad >= 0) throw InvalidArgument(fmt::format("attn sdpa: rank {} rejected the inputs (see its message)", bad));
}

std::array<int64_t, 4> as4(const std::vector<int64_t>& s) {
  std::array<int64_t, 4> r{1, 1, 1, 1};
  for (size_t i = 0; i < s.size(); ++i) r[4 - s.size() + i] = s[i];
  return r;
}

// Gathers every rank's (B, H, n_r, F) shard on rank 0 and unshards it into `full`.
void gather(const std::vector<float>& local, View4<float> full, int P, int r, dist::Layout lay) {
  const int64_t B = full.shape[0], H = full.shape[1], N = full.shape[2], F = full.shape[3];
  std::vector<int> counts(static_cast<size_t>(P)), displs(static_cast<size_t>(P));
  for (int p = 0; p < P; ++p) {
    const int64_t n = B * H * dist::shard_length(N, P, p, lay) * F;
    if (n > INT32_MAX) throw InvalidArgument("attn sdpa: a rank's output shard exceeds 2^31 elements (gather limit)");
    counts[size_t(p)] = int(n);
    if (p > 0) displs[size_t(p)] = displs[size_t(p - 1)] + counts[size_t(p - 1)];
  }
  std::vector<float> all(r == 0 ? size_t(B * H * N * F) : 0);
  MPI_Gatherv(local.data(), int(local.size()), MPI_FLOAT, all.data(), counts.data(), displs.data(), MPI_FLOAT, 0,
              MPI_COMM_WORLD);
  if (r != 0) return;
  for (int p = 0; p < P; ++p)
    dist::unshard(View4<const float>(all.data() + displs[size_t(p)], {B, H, dist::shard_length(N, P, p, lay), F}),
                  full, P, p, lay);
}

}  // namespace

void run_sdpa_context_parallel(const ContextParallelSdpa& o) {
  if (o.mask) throw UsageError("attn sdpa: --mask is not supported with --context-parallel (use --causal)");
  if (o.weights) throw UsageError("attn sdpa: --weights is not supported with --context-parallel (L x S never exists)");
  if (o.backend == "reference")
    throw UsageError("attn sdpa: --context-parallel runs the fused float32 kernel; --backend reference is not supported");
  const MpiSession mpi;
  int P = 1, r = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &P);
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  const dist::Layout lay = o.causal ? dist::Layout::zigzag : dist::Layout::contiguous;
  io::Array<float> qa, ka, va;
  std::array<int64_t, 4> qs{}, ks{}, vs{};
  std::vector<float> q, k, v;
  std::optional<Outputs> outputs;  // rank 0 writes (checked before anything is computed)
  std::string out_path, lse_path;
  on_every_rank([&] {
    if (r == 0) {
      outputs.emplace();
      out_path = outputs->add("--out", o.out);
      lse_path = outputs->add("--lse", o.lse);
    }
    qa = io::read_npy<float>(o.q), ka = io::read_npy<float>(o.k), va = io::read_npy<float>(o.v);
    for (const auto* a : {&qa, &ka, &va})
      if (a->stored != io::DType::f32)
        throw InvalidArgument(fmt::format("attn sdpa: --context-parallel computes in float32; --q {}, --k {} and --v {} must "
                                "all be float32 .npy files",
                                o.q, o.k, o.v));
    const size_t rank = qa.shape.size();
    if (rank < 2 || rank > 4 || ka.shape.size() != rank || va.shape.size() != rank)
      throw InvalidArgument(fmt::format("attn sdpa: --q {} {}, --k {} {} and --v {} {} must have the same number of axes, 2 to 4",
                              o.q, attn::shape_str(qa.shape), o.k, attn::shape_str(ka.shape), o.v,
                              attn::shape_str(va.shape)));
    qs = as4(qa.shape), ks = as4(ka.shape), vs = as4(va.shape);
    // This rank's rows of each input.
    auto mine = [&](const io::Array<float>& a, const std::array<int64_t, 4>& s) {
      std::vector<float> t(size_t(s[0] * s[1] * dist::shard_length(s[2], P, r, lay) * s[3]));
      dist::shard(View4<const float>(a.data.data(), s),
                  View4<float>(t.data(), {s[0], s[1], dist::shard_length(s[2], P, r, lay), s[3]}), P, r, lay);
      return t;
    };
    q = mine(qa, qs), k = mine(ka, ks), v = mine(va, vs);
  });
  const int64_t B = qs[0], H = qs[1], L = qs[2], Ev = vs[3];
  const int64_t Lr = dist::shard_length(L, P, r, lay);
  SdpaArgs<float> args;
  args.q = View4<const float>(q.data(), {qs[0], qs[1], Lr, qs[3]});
  args.k = View4<const float>(k.data(), {ks[0], ks[1], dist::shard_length(ks[2], P, r, lay), ks[3]});
  args.v = View4<const float>(v.data(), {vs[0], vs[1], dist::shard_length(vs[2], P, r, lay), vs[3]});
  dist::DistOptions opt;
  if (o.scale != 0) opt.sdpa.scale = o.scale;
  opt.sdpa.causal = o.causal;
  opt.layout = lay;
  std::vector<float> slopes, sinks;
  on_every_rank([&] {
    if (o.variants) o.variants(H, opt.sdpa, args, slopes, sinks);
  });
  std::vector<float> out(size_t(B * H * Lr * Ev)), lse(size_t(B * H * Lr));
  View4<float> ov(out.data(), {B, H, Lr, Ev});
  // The lse only where asked for: the ranks then agree on it (and on the
  // strategy) before the gathers below depend on it.
  const View3<float> lv = o.lse.empty() ? View3<float>{} : View3<float>(lse.data(), {B, H, Lr});
  try {
    if (o.strategy == "ring") dist::ring_attention(MPI_COMM_WORLD, args, {ov, {}, lv}, opt);
    else dist::ulysses_attention(MPI_COMM_WORLD, args, {ov, {}, lv}, opt);
  } catch (const Error& e) {
    throw InvalidArgument(fmt::format("attn sdpa: {} (q = {}, k = {}, v = {})", e.what(), o.q, o.k, o.v));
  }
  std::vector<float> full_out(r == 0 ? size_t(B * H * L * Ev) : 0), full_lse(r == 0 && !o.lse.empty() ? size_t(B * H * L) : 0);
  gather(out, View4<float>(full_out.data(), {B, H, L, Ev}), P, r, lay);
  if (!o.lse.empty()) gather(lse, View4<float>(full_lse.data(), {B, H, L, 1}), P, r, lay);
  on_every_rank([&] {
    if (r != 0) return;
    const size_t rank = qa.shape.size();
    auto tail = [&](std::vector<int64_t> full, size_t n) { return std::vector<int64_t>(full.end() - long(n), full.end()); };
    io::write_npy(out_path, tail({B, H, L, Ev}, rank), full_out.data());
    if (!o.lse.empty()) io::write_npy(lse_path, tail({B, H, L}, rank - 1), full_lse.data());
    outputs->commit();
    fmt::print(stderr, "attn sdpa: {} -> {} (float32, {} over {} process{}, fused)\n", attn::shape_str(qa.shape),
               o.out, o.strategy, P, P == 1 ? "" : "es");
  });
}

}  // namespace attn::cli
