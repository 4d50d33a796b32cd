// The decode kernel's tile products, for one SIMD target: the scores of a
// tile of keys and its values added into the rows' accumulators (float32,
// half storage widened in registers, or bfloat16 products). Included by
// decode.cpp inside its per-target namespace, after the Call and Scratch
// types (no include guard: once per target).
// ---- scores of a tile (the register blocks are in blocks-inl.h) -------------

// The scores of nk keys from k into s (row r at s + r·tilep); the first row
// group runs the prefetch stream pf along with its keys.
template <class T>
void ScoreTile(const Call& c, Scratch& w, int64_t nm, const T* k, int64_t krow, int64_t nk, float* s,
               RowPrefetch pf) {
  const int64_t E = c.p->E;
  if (c.bf16) {  // bfloat16 products (bf16.hpp), on the call's path
    for (int64_t r0 = 0; r0 < nm; r0 += 4, pf.a.p = nullptr) {
      const uint16_t* q = w.qb.get() + r0 * c.Eq;
      float* sr = s + r0 * c.tilep;
      const int rows = int(std::min<int64_t>(4, nm - r0));
      if (c.path == Bf16Path::avx512_bf16) {
        decode_bf16_scores_native(c.kv->type, rows, q, c.Eq, k, krow, nk, E, c.alpha, sr, c.tilep, pf);
        continue;
      }
      switch (rows) {
        case 4: ScoreRowsBf16<4>(q, c.Eq, k, krow, nk, E, c.alpha, sr, c.tilep, pf); break;
        case 3: ScoreRowsBf16<3>(q, c.Eq, k, krow, nk, E, c.alpha, sr, c.tilep, pf); break;
        case 2: ScoreRowsBf16<2>(q, c.Eq, k, krow, nk, E, c.alpha, sr, c.tilep, pf); break;
        default: ScoreRowsBf16<1>(q, c.Eq, k, krow, nk, E, c.alpha, sr, c.tilep, pf); break;
      }
    }
    return;
  }
  for (int64_t r0 = 0; r0 < nm; r0 += 4, pf.a.p = nullptr) {
    const float* q = w.q.get() + r0 * c.Ep;
    float* sr = s + r0 * c.tilep;
    switch (std::min<int64_t>(4, nm - r0)) {
      case 4: ScoreRows<4>(q, c.Ep, k, krow, nk, E, sr, c.tilep, pf); break;
      case 3: ScoreRows<3>(q, c.Ep, k, krow, nk, E, sr, c.tilep, pf); break;
      case 2: ScoreRows<2>(q, c.Ep, k, krow, nk, E, sr, c.tilep, pf); break;
      default: ScoreRows<1>(q, c.Ep, k, krow, nk, E, sr, c.tilep, pf); break;
    }
  }
}

// ---- values of a tile ---------------------------------------------------------

// The keys [lo, hi) of a tile from j0 (nk keys) that row r sees, tile-relative.
HWY_INLINE rules::Keys TileKeys(const Scratch& w, int64_t r, int64_t j0, int64_t nk) {
  return {std::clamp<int64_t>(w.begin[size_t(r)] - j0, 0, nk), std::clamp<int64_t>(w.end[size_t(r)] - j0, 0, nk)};
}

// Whether the elementwise rules hide key j from row r (the mask says no, or
// the bias is −inf).
HWY_INLINE bool Hidden(const Problem& p, const Scratch& w, int64_t r, int64_t j) {
  return (!p.rules.mask.empty() && !w.mask[size_t(r)].at(j)) || (!p.rules.bias.empty() && w.bias[size_t(r)].at(j) == kNegInf);
}

// Keys a row does not see never touch it (not even as 0·v, which is NaN for
// a non-finite v): the keys every row sees go through the register blocks,
// the rest (the causal diagonal of a tile, the edge of a window) row by row.
// The rows are in query order, so both ends of their ranges never decrease:
// the common keys are [lo of the last row, hi of the first).
// The probabilities of the nk keys from j0 are at s (row r at s + r·tilep).
template <class T>
void ValueTile(const Call& c, Scratch& w, int64_t nm, const float* s, const T* v, int64_t vrow, int64_t j0,
               int64_t nk, float* acc, RowPrefetch pf) {
  const int64_t Ev = c.p->Ev;
  // A key the mask or bias hides never touches the row either: a tile with
  // such keys goes row by row over the runs of keys each row sees.
  if (std::any_of(w.holes.begin(), w.holes.begin() + nm, [](uint8_t x) { return x != 0; })) {
    for (int64_t r = 0; r < nm; ++r) {
      const rules::Keys k = TileKeys(w, r, j0, nk);
      for (int64_t a = k.lo; a < k.hi;) {
        if (Hidden(*c.p, w, r, j0 + a)) {
          ++a;
          continue;
        }
        int64_t b = a + 1;
        while (b < k.hi && !Hidden(*c.p, w, r, j0 + b)) ++b;
        ValueRows<1>(s + r * c.tilep + a, c.tilep, b - a, v + a * vrow, vrow, Ev, acc + r * c.Evp, c.Evp);
        a = b;
      }
    }
    return;
  }
  const int64_t lo = TileKeys(w, nm - 1, j0, nk).lo, hi = std::max(lo, TileKeys(w, 0, j0, nk).hi);
  const bool common = hi > lo;
  // Each row's keys before the common ones ([its lo, lo); all of its keys
  // when none is common), then the common keys in register blocks, then
  // each row's keys after them ([hi, its hi)): every row in key order.
  for (int64_t r = 0; r < nm; ++r) {
    const rules::Keys k = TileKeys(w, r, j0, nk);
    const int64_t a = common ? std::min(k.hi, lo) : k.hi;
    if (a > k.lo)
      ValueRows<1>(s + r * c.tilep + k.lo, c.tilep, a - k.lo, v + k.lo * vrow, vrow, Ev, acc + r * c.Evp, c.Evp);
  }
  const int64_t blk = ValueRowBlock(Ev, sizeof(T));
  pf.ahead += lo;  // the block loop's key 0 is the tile's key lo
  for (int64_t r0 = 0; r0 < nm && common; r0 += blk) {
    const float* p = s + r0 * c.tilep + lo;
    const T* vl = v + lo * vrow;
    float* o = acc + r0 * c.Evp;
    if (r0 > 0) pf.a.p = nullptr;
    switch (std::min<int64_t>(blk, nm - r0)) {
      case 4: ValueRows<4>(p, c.tilep, hi - lo, vl, vrow, Ev, o, c.Evp, pf); break;
      case 3: ValueRows<3>(p, c.tilep, hi - lo, vl, vrow, Ev, o, c.Evp, pf); break;
      case 2: ValueRows<2>(p, c.tilep, hi - lo, vl, vrow, Ev, o, c.Evp, pf); break;
      default: ValueRows<1>(p, c.tilep, hi - lo, vl, vrow, Ev, o, c.Evp, pf); break;
    }
  }
  for (int64_t r = 0; r < nm && common; ++r) {
    const int64_t b = std::max(TileKeys(w, r, j0, nk).lo, hi), e = TileKeys(w, r, j0, nk).hi;
    if (e > b) ValueRows<1>(s + r * c.tilep + b, c.tilep, e - b, v + b * vrow, vrow, Ev, acc + r * c.Evp, c.Evp);
  }
}

// The values of keys [a, b) of a tile (a even; the tile's nk keys from j0,
// their value rows vr) with bfloat16 products: the tile's key pairs
// (2m, 2m + 1) in order, a key a row does not see read as a row of zeros
// with probability 0, so that it adds nothing (bf16.hpp). Where every row
// sees the same keys the rows go in blocks of 4, else one by one; the bits
// are the same either way (a pair of unseen keys adds +0 to a sum that is
// never −0).
template <class T>
void ValueTileBf16(const Call& c, Scratch& w, int64_t nm, const void* const* vr, int64_t j0, int64_t nk, int64_t a,
                   int64_t b, float* acc, RowPrefetch pf) {
  const int64_t Ev = c.p->Ev;
  const auto pairs = [&](int rows, int64_t r0, int64_t m0, int64_t m1, const RowPrefetch& f) {
    const uint32_t* pp = w.pp.get() + r0 * c.ldp + m0;
    float* o = acc + r0 * c.Evp;
    if (c.path == Bf16Path::avx512_bf16)
      return decode_bf16_values_native(c.kv->type, rows, pp, c.ldp, m1 - m0, w.vp.data(), Ev, o, c.Evp, f);
    const T* const* v = reinterpret_cast<const T* const*>(w.vp.data());
    switch (rows) {
      case 4: return ValueRowsBf16<4>(pp, c.ldp, m1 - m0, v, Ev, o, c.Evp, f);
      case 3: return ValueRowsBf16<3>(pp, c.ldp, m1 - m0, v, Ev, o, c.Evp, f);
      case 2: return ValueRowsBf16<2>(pp, c.ldp, m1 - m0, v, Ev, o, c.Evp, f);
      default: return ValueRowsBf16<1>(pp, c.ldp, m1 - m0, v, Ev, o, c.Evp, f);
    }
  };
  const rules::Keys k0 = TileKeys(w, 0, j0, nk);
  bool same = true;
  for (int64_t r = 0; r < nm && same; ++r) {
    const rules::Keys k = TileKeys(w, r, j0, nk);
    same = !w.holes[size_t(r)] && k.lo == k0.lo && k.hi == k0.hi;
  }
  if (same) {
    const int64_t lo = std::max(a, k0.lo), hi = std::min(b, k0.hi);
    if (hi <= lo) return;
    const int64_t m0 = lo / 2, m1 = (hi + 1) / 2;
    for (int64_t j = 2 * m0; j < 2 * m1; ++j) w.vp[size_t(j - 2 * m0)] = j >= lo && j < hi ? vr[j] : c.zeros;
    pf.ahead += 2 * m0 - a;  // the pair loop's key 0 is the tile's key 2·m0
    for (int64_t r0 = 0; r0 < nm; r0 += 4, pf.a.p = nullptr) pairs(int(std::min<int64_t>(4, nm - r0)), r0, m0, m1, pf);
    return;
  }
  for (int64_t r = 0; r < nm; ++r) {
    const rules::Keys k = TileKeys(w, r, j0, nk);
    const int64_t lo = std::max(a, k.lo), hi = std::min(b, k.hi);
    if (hi <= lo) continue;
    const int64_t m0 = lo / 2, m1 = (hi + 1) / 2;
    for (int64_t j = 2 * m0; j < 2 * m1; ++j)
      w.vp[size_t(j - 2 * m0)] = j >= lo && j < hi && !Hidden(*c.p, w, r, j0 + j) ? vr[j] : c.zeros;
    pairs(1, r, m0, m1, RowPrefetch{});
  }
}
