// The decode kernel's bfloat16 products on 16-row tiles (AMX, or its
// emulation), for one SIMD target. Included by decode.cpp inside its
// per-target namespace, after the query packing and the softmax step (no
// include guard: once per target).
// ---- bfloat16 products on 16-row tiles (AMX, or its emulation) -----------------

using DFU = hn::RebindToUnsigned<DF>;
using VFU = hn::Vec<DFU>;

// N elements of a row (n < N: zeros after n) as bfloat16 bits in the high
// half of each 32-bit lane (bf16_operand; a bfloat16 element as stored: the
// tile products read a subnormal as zero).
template <class T>
HWY_INLINE VFU HighBits(const T* x, int64_t n) {
  const DF d;
  const VF v = n >= Lanes() ? LoadF(d, x) : LoadTail(d, x, n);
  if constexpr (std::is_same_v<T, hwy::bfloat16_t>) return hn::BitCast(DFU(), v);  // widened: the bits << 16
  else return RoundToBf16High(v);
}

// A key row of E elements as bfloat16 bits, zeros up to Eq (a multiple of 32).
template <class T>
void KeyBits(const T* x, int64_t E, int64_t Eq, uint16_t* dst) {
#if HWY_TARGET == HWY_SCALAR
  for (int64_t e = 0; e < Eq; ++e) dst[e] = e < E ? uint16_t(hn::GetLane(HighBits(x + e, E - e)) >> 16) : 0;
#else
  const DFU du;
  const hn::Repartition<uint16_t, DF> d16;
  const int64_t N = Lanes();
  for (int64_t e = 0; e < Eq; e += 2 * N) {
    const VFU a = e < E ? HighBits(x + e, E - e) : hn::Zero(du);
    const VFU b = e + N < E ? HighBits(x + e + N, E - e - N) : hn::Zero(du);
    hn::StoreU(hn::ConcatOdd(d16, hn::BitCast(d16, b), hn::BitCast(d16, a)), d16, dst + e);
  }
#endif
}

// Two value rows as one row of pairs (a's bits low, b's high), zeros from Ev to Evp.
template <class T>
void ValuePairs(const T* a, const T* b, int64_t Ev, int64_t Evp, uint32_t* dst) {
  const DFU du;
  const int64_t N = Lanes();
  for (int64_t e = 0; e < Evp; e += N) {
    if (e >= Ev) {
      hn::StoreU(hn::Zero(du), du, dst + e);
      continue;
    }
    const VFU x = HighBits(a + e, Ev - e), y = HighBits(b + e, Ev - e);
    hn::StoreU(hn::Or(hn::ShiftRight<16>(x), hn::And(y, hn::Set(du, 0xFFFF0000u))), du, dst + e);
  }
}

// One tile of nk keys from j0 (key rows w.kr, value rows w.vr) with the
// tile products: K·Qᵀ of the tile's keys (padded to 16) and the block's
// query pairs, the softmax step, then acc += P·V with P the rows' rounded
// probabilities (pp) and V the tile's value rows in key pairs (a key the
// rows do not see as zeros). A tile whose rows see different keys, or
// with keys the mask or bias hides, goes through the portable pair loop
// instead (a key a row does not see never touches it).
template <class T>
void AmxTile(const Call& c, Scratch& w, const Unit& u, int64_t j0, int64_t nk, float* acc, os::State<float>* st,
             uint8_t* nan) {
  const int64_t E = c.p->E, Ev = c.p->Ev, nq = c.qcols(), m16 = round_up(nk, 16);
  for (int64_t j = 0; j < nk; ++j) KeyBits(static_cast<const T*>(w.kr[size_t(j)]), E, c.Eq, w.kb.get() + j * c.Eq);
  std::fill(w.kb.get() + nk * c.Eq, w.kb.get() + m16 * c.Eq, uint16_t(0));
  c.kernel.gemm(m16, nq, c.Eq, w.kb.get(), c.Eq, w.qpair.get(), nq, w.sc.get(), nq, c.alpha, false);
  for (int64_t r = 0; r < u.nm; ++r)  // scores: keys × queries to the rows' lines
    for (int64_t j = 0; j < nk; ++j) w.s[size_t(r * c.tilep + j)] = w.sc[size_t(j * nq + r)];
  SoftmaxTile(c, w, u.nm, j0, nk, acc, st, nan);
  const rules::Keys k0 = TileKeys(w, 0, j0, nk);
  bool same = true;
  for (int64_t r = 0; r < u.nm && same; ++r) {
    const rules::Keys k = TileKeys(w, r, j0, nk);
    same = !w.holes[size_t(r)] && k.lo == k0.lo && k.hi == k0.hi;
  }
  if (!same) return ValueTileBf16<T>(c, w, u.nm, w.vr.data(), j0, nk, 0, nk, acc, RowPrefetch{});
  if (k0.hi <= k0.lo) return;
  const int64_t K = round_up(nk, 32), npairs = (nk + 1) / 2;
  const auto row = [&](int64_t j) { return static_cast<const T*>(j >= k0.lo && j < k0.hi ? w.vr[size_t(j)] : c.zeros); };
  for (int64_t k = 0; k < K / 2; ++k) ValuePairs(row(2 * k), row(2 * k + 1), Ev, c.Evp, w.vb.get() + k * c.Evp);
  for (int64_t r = 0; r < u.nm; ++r)  // P past the tile's keys is zero
    std::fill(w.pp.get() + r * c.ldp + npairs, w.pp.get() + r * c.ldp + K / 2, 0u);
  c.kernel.gemm(round_up(u.nm, 16), c.Evp, K, w.pp.get(), 2 * c.ldp, w.vb.get(), c.Evp, acc, c.Evp, 1.0f, true);
}

// The chunk u into (acc, st, nan) for its nm rows (acc zeroed here).
