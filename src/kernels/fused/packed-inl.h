// The packed variable-length batch of the fused kernel, for one SIMD target
// (included once per target by fused.cpp; no ordinary include guard): the
// scheduling of many sequences' units in one parallel region. The units
// themselves are the dense call's (attention-inl.h).

// Per-target include guard, the Highway way (see attention-inl.h).
#if defined(ATTN_KERNELS_FUSED_PACKED_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ATTN_KERNELS_FUSED_PACKED_INL_H_
#undef ATTN_KERNELS_FUSED_PACKED_INL_H_
#else
#define ATTN_KERNELS_FUSED_PACKED_INL_H_
#endif

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/fused/attention-inl.h"
#include "kernels/fused/fused.hpp"
#include "kernels/fused/tiles.hpp"

HWY_BEFORE_NAMESPACE();
namespace attn::detail {
namespace HWY_NAMESPACE {
namespace {

// ---- packed variable-length batches ------------------------------------------
//
// A packed batch (src/varlen.cpp) arrives as one dense call of batch 1 per
// sequence, all on one plan (fused.cpp: the plan of the longest sequence;
// any block sizes are correct, the short sequences just fill fewer rows of
// a block). Their units run in one parallel region, the same units as the
// dense call's: forward (sequence, head, query block); backward with
// plan.own_heads (sequence, kv head), otherwise the two passes over
// (sequence, kv head, key block) and (sequence, head, query block). Every
// unit owns what it writes, so nothing depends on which thread runs it. The
// units are handed out longest first (by their visible score count, a
// function of the shape only), so that the long sequences start at once and
// the short ones fill the end; the forward keeps each sequence's units
// together (SequencesLongestFirst).

struct PackedUnit {
  int64_t seq, head, first;  // sequence, (kv) head, first query row or key of the block
  double cost;  // visible scores (query rows × keys) the unit visits
};

void LongestFirst(std::vector<PackedUnit>& units) {
  std::stable_sort(units.begin(), units.end(), [](const PackedUnit& x, const PackedUnit& y) { return x.cost > y.cost; });
}

// The forward's order: whole sequences, the costliest first, each in its
// own order (head by head, query block by query block, as the dense call).
// Sorting the units themselves by cost would put every sequence's partial
// last block behind the full blocks of shorter ones, by when its K and V
// (all of which a block reads) have left the cache; by sequence, 0.86 →
// 0.89 of the dense kernel's GFLOP/s on 16 sequences (Zen 3, one run of 21
// paired repetitions, before the forward's groups of src/varlen.cpp).
void SequencesLongestFirst(std::vector<PackedUnit>& units, int64_t n) {
  std::vector<double> cost(size_t(n), 0.0);
  for (const PackedUnit& x : units) cost[size_t(x.seq)] += x.cost;
  std::stable_sort(units.begin(), units.end(),
                   [&](const PackedUnit& x, const PackedUnit& y) { return cost[size_t(x.seq)] > cost[size_t(y.seq)]; });
}

// The scores rows [i0, i0 + nr) of call c see (rows × the keys of the block).
double RowBlockCost(const FusedCall& c, int64_t i0, int64_t nr) {
  const rules::Keys keys = band_of(c, 0).keys_of_rows(i0, i0 + nr);
  return double(nr) * double(std::max<int64_t>(keys.hi - keys.lo, 0));
}

// The calls of the sequences, with their bad keys marked (one parallel loop
// over all sequences' key rows; `bad` keeps the marks alive).
std::vector<FusedCall> MakePackedCalls(const FusedSequence* seqs, int64_t n, const FusedPlan& t,
                                       std::vector<std::vector<uint8_t>>& bad) {
  std::vector<FusedCall> calls;
  struct Rows {
    int64_t seq, u0, u1;
  };
  std::vector<Rows> items;  // every sequence's key rows, in blocks of kMarkBlock
  bad.resize(size_t(n));
  for (int64_t s = 0; s < n; ++s) {
    const Problem& p = seqs[s].p;
    calls.push_back(FusedCall{&p, &seqs[s].a, t, float(p.rules.scale)});
    const int64_t rows = p.B * p.Hkv * p.S;
    bad[size_t(s)].assign(size_t(rows), 0);
    for (int64_t u = 0; u < rows; u += kMarkBlock) items.push_back({s, u, std::min(rows, u + kMarkBlock)});
  }
#pragma omp parallel for num_threads(seqs[0].p.threads) schedule(static)
  for (size_t i = 0; i < items.size(); ++i) {
    const Rows& x = items[i];
    MarkBadKeyRange(seqs[x.seq].p, seqs[x.seq].a, bad[size_t(x.seq)].data(), x.u0, x.u1);
  }
  for (int64_t s = 0; s < n; ++s) {
    const auto& marks = bad[size_t(s)];
    calls[size_t(s)].bad_keys = marks.data();
    calls[size_t(s)].any_bad_keys = std::find(marks.begin(), marks.end(), uint8_t(1)) != marks.end();
  }
  return calls;
}

// The query-block units (sequence, head, first row) of all sequences.
std::vector<PackedUnit> QueryBlockUnits(const FusedSequence* seqs, int64_t n, const std::vector<FusedCall>& calls,
                                        const FusedPlan& t) {
  std::vector<PackedUnit> units;
  for (int64_t s = 0; s < n; ++s)
    for (int64_t h = 0; h < seqs[s].p.H; ++h)
      for (int64_t i0 = 0; i0 < seqs[s].p.L; i0 += t.q_block)
        units.push_back({s, h, i0, RowBlockCost(calls[size_t(s)], i0, std::min(t.q_block, seqs[s].p.L - i0))});
  return units;
}

// f(unit, its sequence, its call) for every unit, in order, shared among the
// threads of the enclosing parallel region (ends with its barrier).
template <class F>
void ForEachUnit(const std::vector<PackedUnit>& units, const FusedSequence* seqs, const std::vector<FusedCall>& calls,
                 F f) {
#pragma omp for schedule(dynamic, 1)
  for (size_t u = 0; u < units.size(); ++u) f(units[u], seqs[units[u].seq], calls[size_t(units[u].seq)]);
}

// plan_p: the problem the plan was made for (its E, Ev and soft-cap size the
// scratch, as in every sequence).
void ForwardPackedImpl(const FusedSequence* seqs, int64_t n, const Problem& plan_p, FusedPlan t) {
  std::vector<std::vector<uint8_t>> bad;
  const std::vector<FusedCall> calls = MakePackedCalls(seqs, n, t, bad);
  std::vector<PackedUnit> units = QueryBlockUnits(seqs, n, calls, t);
  SequencesLongestFirst(units, n);
#pragma omp parallel num_threads(plan_p.threads)
  {
    const FlushToZero ftz;  // common.hpp
    ForwardScratch w(plan_p, t, Lanes());
    ForEachUnit(units, seqs, calls, [&](const PackedUnit& x, const FusedSequence& q, const FusedCall& c) {
      ForwardUnit(c, w, 0, x.head, x.first, std::min(t.q_block, q.p.L - x.first), q.out, {}, q.lse);
    });
  }
}

// dsinks: the sinks' gradient summed over all sequences (empty: not wanted).
void BackwardPackedImpl(const FusedSequence* seqs, int64_t n, const Problem& plan_p, FusedPlan t,
                        View1<float> dsinks) {
  std::vector<std::vector<uint8_t>> bad;
  const std::vector<FusedCall> calls = MakePackedCalls(seqs, n, t, bad);
  std::vector<SdpaGrads<float>> grads;
  for (int64_t s = 0; s < n; ++s) grads.push_back({seqs[s].dq, seqs[s].dk, seqs[s].dv, {}, {}});
  // Units: owned (sequence, kv head) pairs, whose cost is that of their
  // query blocks; or the key-block pass, then the query-block pass.
  std::vector<PackedUnit> query_units = QueryBlockUnits(seqs, n, calls, t), key_units;
  for (int64_t s = 0; s < n; ++s) {
    const Problem& p = seqs[s].p;
    for (int64_t hk = 0; hk < p.Hkv; ++hk) {
      if (t.own_heads) {
        key_units.push_back({s, hk, 0, 0.0});
        continue;
      }
      for (int64_t j0 = 0; j0 < p.S; j0 += t.k_block) {
        const int64_t nk = std::min(t.k_block, p.S - j0);
        const auto [r0, r1] = band_of(calls[size_t(s)], 0).rows_seeing(j0, j0 + nk, 0, p.L);
        key_units.push_back({s, hk, j0, double(std::max<int64_t>(r1 - r0, 0)) * double(nk) * double(p.group())});
      }
    }
  }
  if (t.own_heads) {
    std::vector<int64_t> first{0};  // index of each sequence's first pair
    for (int64_t s = 0; s < n; ++s) first.push_back(first.back() + seqs[s].p.Hkv);
    for (const PackedUnit& x : query_units)
      key_units[size_t(first[size_t(x.seq)] + seqs[x.seq].p.kv_head(x.head))].cost += x.cost;
    query_units.clear();
  }
  LongestFirst(key_units);
  LongestFirst(query_units);
#pragma omp parallel num_threads(plan_p.threads)
  {
    const FlushToZero ftz;  // common.hpp
    BackwardScratch w(plan_p, t, Lanes());
    ForEachUnit(key_units, seqs, calls, [&](const PackedUnit& x, const FusedSequence& q, const FusedCall& c) {
      const SdpaGrads<float>& g = grads[size_t(x.seq)];
      if (t.own_heads)
        OwnedHeadUnit(c, w, g, q.dout, q.saved_out, q.saved_lse, 0, x.head);
      else
        KeyBlockUnit(c, w, g, q.dout, q.saved_out, q.saved_lse, 0, x.head, x.first, false);
    });
    ForEachUnit(query_units, seqs, calls, [&](const PackedUnit& x, const FusedSequence& q, const FusedCall& c) {
      QueryBlockUnit(c, w, grads[size_t(x.seq)], q.dout, q.saved_out, q.saved_lse, 0, x.head, x.first,
                     std::min(t.q_block, q.p.L - x.first));
    });
    if (!dsinks.empty()) {
#pragma omp for schedule(static)
      for (int64_t h = 0; h < plan_p.H; ++h) {
        double acc = 0;  // over the sequences in order
        for (int64_t s = 0; s < n; ++s)
          AddSinkGradient(calls[size_t(s)], h, seqs[s].dout, seqs[s].saved_out, seqs[s].saved_lse, acc);
        dsinks(h) = float(acc);
      }
    }
  }
}

}  // namespace
}  // namespace HWY_NAMESPACE
}  // namespace attn::detail
HWY_AFTER_NAMESPACE();

#endif  // ATTN_KERNELS_FUSED_PACKED_INL_H_
