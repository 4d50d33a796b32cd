// The fused kernels' plan (tile sizes, the backward's work split) and the
// layout of their per-thread scratch. Compiled once; see tiles.hpp.
#include "kernels/fused/tiles.hpp"

#include <algorithm>
#include <cstring>
#include <memory>

#include "kernels/fused/common.hpp"

namespace attn::detail {

namespace {

// The plan of fused_plan, with the key/value tiles counted as
// `kv_floats_per_element` floats per element (2 for float32 K and V and
// their copies, 1 for bfloat16 operands).
FusedPlan plan_for(const Problem& p, int64_t kv_floats_per_element, bool tiles = false) {
  // q_block: the queries of a unit, and the vector dimension of the
  // transposed score tile; larger blocks re-read K and V less often, smaller
  // ones waste less on the causal diagonal and give more units. k_block: as
  // large as keeps the key/value tiles and the score tile within about
  // 256 KiB (half of a typical L2).
  // Under a narrow window (w keys per row) a block of q rows visits
  // w + q − 1 keys per row, so halving the block cuts the masked scores on
  // the band's two edges: at w = 512, S = 16384 (1 thread) 48 rows ran 3-4%
  // faster forward and 7% forward+backward than 96, at w = 128 13%; at
  // w = 2048 it made no difference.
  FusedPlan t;
  const int64_t right = p.rules.causal ? 0 : p.rules.window_right;
  const int64_t left = p.rules.window_left;
  const bool narrow = left >= 0 && right >= 0 && left + right + 1 <= 1024;
  t.q_block = p.L <= 80 ? round_up(p.L, kMaxLanes) : narrow ? 48 : tiles && p.L >= 2048 ? 192 : 96;
  const int64_t budget = (tiles ? 1024 : 256) * 1024 / 4;  // floats
  int64_t kb = tiles ? 384 : 240;
  while (kb > kRowMultiple && kb * (p.E + p.Ev) * kv_floats_per_element + t.q_block * kb * 2 > budget) kb -= 48;
  t.k_block = std::min(std::max(kb, kRowMultiple), round_up(p.S, kRowMultiple));
  // Enough (b, kv head) pairs keep every thread busy with whole heads.
  t.own_heads = p.B * p.Hkv >= 8;
  // Where a query block meets 8 key blocks or more, building its query side
  // once saves more than it costs (scores-inl.h, BackwardQueries).
  t.queries_once = ceil_div(p.S, t.k_block) >= 8;
  // Likewise the key side, where the query pass packs each key block 8 times or more.
  t.keys_once = !t.own_heads && p.group() * ceil_div(p.L, t.q_block) >= 8;
  return t;
}

}  // namespace

FusedPlan fused_plan(const Problem& p) { return plan_for(p, 2); }

// bfloat16 K and V take half the bytes of a key: key tiles up to twice as
// long in the same budget (E = 128: 144 keys rather than 48, whose short
// P·V products spent a tenth of their time loading and storing the
// accumulator; forward 0.58 rather than 0.66 of the float32 time, Zen 4).
// With the products on AMX tiles (every such CPU has 2 MiB of L2 per core)
// the budget is 1 MiB, and long sequences take 192-query blocks: fewer
// loads and stores of the accumulator's tiles per product, and fewer
// rescales and row maxima per key. At B=1, H=8, L=S=4096, E=128, 2 threads,
// Emerald Rapids: 96 × 144 took 84-86 ms, 192 × 384 68-69 ms (full), 45 and
// 37 ms (causal); at E=64, 53-59 and 53-60 ms; at L=512 the 96-query blocks
// were as fast or faster.
FusedPlan fused_plan_bf16(const Problem& p, bool tiles) { return plan_for(p, 1, tiles); }

// On AMX tiles, heads of E + Ev >= 256 take the tile forward's key tiles:
// at B=1, H=8, L=S=4096, E=128, 2 threads, Emerald Rapids (medians of 5),
// 96 × 384 took 153 ms against 185 with 96 × 160 (full), 96 against 114
// (causal); at E=256, L=S=2048, 96 × 288 took 94 against 108 with 96 × 64.
// At E=64, 384-key tiles were no faster (131 against 130 ms full, 73
// against 71 causal), so smaller heads keep theirs.
FusedPlan fused_backward_plan_bf16(const Problem& p, bool tiles) {
  FusedPlan t = plan_for(p, 1);
  if (tiles && p.E + p.Ev >= 256) t.k_block = plan_for(p, 1, true).k_block;
  t.q_block = round_up(t.q_block, 32);
  t.k_block = round_up(t.k_block, 32);
  return t;
}

namespace {

// Hands out consecutive 64-byte aligned arrays from one block; with a null
// base it only measures (every pointer it returns is then null).
class Carver {
 public:
  explicit Carver(std::byte* base) : base_(base) {}
  template <class T>
  T* take(int64_t n) {
    off_ = round_up(off_, 64);
    T* ptr = base_ ? reinterpret_cast<T*>(base_ + off_) : nullptr;
    off_ += std::max<int64_t>(n, 1) * int64_t(sizeof(T));
    return ptr;
  }
  int64_t size() const { return off_; }

 private:
  std::byte* base_;
  int64_t off_ = 0;
};

// Measures the layout, allocates and zeroes it (with Alloc::yes), and carves
// it: `lay(carver)` assigns the arrays. Returns the size in bytes.
template <class Lay>
int64_t build(Alloc alloc, hwy::AlignedFreeUniquePtr<std::byte[]>& mem, Lay lay) {
  Carver measure(nullptr);
  lay(measure);
  const int64_t n = measure.size();
  if (alloc == Alloc::yes) {
    mem = hwy::AllocateAligned<std::byte>(size_t(n));
    std::memset(mem.get(), 0, size_t(n));
    Carver carve(mem.get());
    lay(carve);
  }
  return n;
}

}  // namespace

ForwardScratch::ForwardScratch(const Problem& p, const FusedPlan& t, int64_t lanes, Alloc alloc) {
  qb = t.q_block;
  kb = t.k_block;
  qbp = round_up(qb, lanes);
  Evp = round_up(p.Ev, lanes);
  const bool bf16 = p.bf16_products, f32 = !bf16;
  bytes_ = build(alloc, mem_, [&](Carver& c) {
    qt = f32 ? c.take<float>(p.E * qbp) : nullptr;
    st = c.take<float>((bf16 ? round_up(kb, 16) : kb) * qbp);
    kr = f32 ? c.take<float>(kb * p.E) : nullptr;
    vb = f32 ? c.take<float>(kb * Evp) : nullptr;
    o = f32 ? c.take<float>(qb * Evp) : nullptr;
    qp = bf16 ? c.take<uint32_t>(round_up(p.E, 32) / 2 * qbp) : nullptr;
    pp = bf16 ? c.take<uint32_t>(round_up(kb, 32) / 2 * qbp) : nullptr;
    ot = bf16 ? c.take<float>(round_up(p.Ev, 16) * qbp) : nullptr;
    colv = c.take<float>(4 * qbp);
    rows = c.take<online_softmax::State<float>>(qb);
    qbad = c.take<uint8_t>(qb);
    keep = p.dropout.on() ? c.take<float>(round_up(kb, lanes)) : nullptr;
  });
  if (rows) std::uninitialized_default_construct_n(rows, qb);
}

BackwardScratch::BackwardScratch(const Problem& p, const FusedPlan& t, int64_t lanes, Alloc alloc) {
  qb = t.q_block;
  kb = t.k_block;
  kbp = round_up(kb, lanes);
  ldk = kbp;
  Ep = round_up(p.E, lanes);
  Evp = round_up(p.Ev, lanes);
  const bool f32 = !p.bf16_products;
  bytes_ = build(alloc, mem_, [&](Carver& c) {
    q = f32 ? c.take<float>(qb * Ep) : nullptr;
    kt = f32 ? c.take<float>(p.E * kbp) : nullptr;
    dy = f32 ? c.take<float>(qb * Evp) : nullptr;
    vt = f32 ? c.take<float>(p.Ev * kbp) : nullptr;
    s = c.take<float>(qb * kbp);
    kr = f32 ? c.take<float>(kb * Ep) : nullptr;
    dp = c.take<float>(qb * kbp);
    dk = f32 ? c.take<float>(kb * Ep) : nullptr;
    dq = f32 ? c.take<float>(qb * Ep) : nullptr;
    dcap = p.rules.capped() ? c.take<float>(qb * kbp) : nullptr;
    dv = f32 ? c.take<float>(kb * Evp) : nullptr;
    acc = c.take<float>(qb * kbp);
    lse = c.take<float>(qb);
    D = c.take<float>(qb);
    poisoned = c.take<uint8_t>(qb);
    keep = p.dropout.on() ? c.take<float>(kbp) : nullptr;
  });
}

}  // namespace attn::detail
