// merge_attention: the public form of the online softmax's merge of two
// partial results (kernels/fused/online_softmax.hpp holds the arithmetic and
// its −inf guards; this file only validates and walks the rows).
#include "attn/merge.hpp"

#include <array>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/fused/online_softmax.hpp"
#include "validate.hpp"

namespace attn {

template <class T>
void merge_attention(View4<T> out_a, View3<T> lse_a, View4<const T> out_b, View3<const T> lse_b, int num_threads) {
  namespace os = detail::online_softmax;
  const detail::Checker c{"merge_attention"};
  c.require(out_a, "out_a");
  c.require(lse_a, "lse_a");
  c.require(out_b, "out_b");
  c.require(lse_b, "lse_b");
  const auto& s = out_a.shape;
  c.shape(out_b, "out_b", s, shape_str(s) + " (the shape of 'out_a')");
  const std::array<int64_t, 3> rows{s[0], s[1], s[2]};
  c.shape(lse_a, "lse_a", rows, shape_str(rows) + " (B, H, L of 'out_a')");
  c.shape(lse_b, "lse_b", rows, shape_str(rows) + " (B, H, L of 'out_a')");
  const std::vector<detail::Extent> written{c.extent(out_a, "out_a"), c.extent(lse_a, "lse_a")};
  for (const auto& e : written) c.writable(e);
  c.disjoint(written, {c.extent(out_b, "out_b"), c.extent(lse_b, "lse_b")});
  const int threads = c.threads(num_threads);
  const T nan = std::numeric_limits<T>::quiet_NaN();
  const int64_t nrows = s[0] * s[1] * s[2];
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && nrows * s[3] >= (int64_t(1) << 14))
  for (int64_t r = 0; r < nrows; ++r) {
    const int64_t b = r / (s[1] * s[2]), h = r / s[2] % s[1], i = r % s[2];
    const T la = lse_a(b, h, i), lb = lse_b(b, h, i);
    if (std::isnan(la) || std::isnan(lb)) {  // a poisoned part poisons the row
      lse_a(b, h, i) = nan;
      for (int64_t e = 0; e < s[3]; ++e) out_a(b, h, i, e) = nan;
      continue;
    }
    // Each part as an online-softmax state whose sum is 1 relative to its lse.
    const bool a_empty = la == os::neg_inf<T>(), b_empty = lb == os::neg_inf<T>();
    os::State<T> a{la, a_empty ? T(0) : T(1)};
    const os::State<T> sb{lb, b_empty ? T(0) : T(1)};
    const auto w = os::merge(a, sb);     // a.sum = wa + wb relative to a.max
    const auto fin = os::finalize(a);    // 1 / (wa + wb) and the merged lse
    for (int64_t e = 0; e < s[3]; ++e) {
      // O = (wa·O_a + wb·O_b) / (wa + wb); an empty part (lse −inf) adds nothing
      const T oa = a_empty ? T(0) : w.wa * out_a(b, h, i, e);
      const T ob = b_empty ? T(0) : w.wb * out_b(b, h, i, e);
      out_a(b, h, i, e) = (oa + ob) * fin.inv_sum;
    }
    lse_a(b, h, i) = fin.lse;
  }
}

template void merge_attention<float>(View4<float>, View3<float>, View4<const float>, View3<const float>, int);
template void merge_attention<double>(View4<double>, View3<double>, View4<const double>, View3<const double>, int);

}  // namespace attn
