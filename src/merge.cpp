// merge_attention: the public form of the online softmax's merge of two
// partial results (kernels/fused/online_softmax.hpp holds the arithmetic and
// its −inf guards; this file only validates and walks the rows).
#include "attn/merge.hpp"

#include <array>
#include <cmath>
#include <limits>
#include <string>

#include "kernels/fused/online_softmax.hpp"

namespace attn {
namespace {

[[noreturn]] void fail(const std::string& msg) { throw InvalidArgument("attn::merge_attention: " + msg); }

template <class V>
void check_present(const V& v, const char* name) {
  if (v.data == nullptr) fail(std::string("argument '") + name + "' is required but was not given");
}

template <class T, int R>
void check_writable(const View<T, R>& v, const char* name) {
  for (int i = 0; i < R; ++i)
    if (v.shape[size_t(i)] > 1 && v.strides[size_t(i)] == 0)
      fail(std::string("output '") + name + "' has stride 0 on axis " + std::to_string(i) +
           " (a broadcast view cannot be written)");
}

}  // namespace

template <class T>
void merge_attention(View4<T> out_a, View3<T> lse_a, View4<const T> out_b, View3<const T> lse_b) {
  namespace os = detail::online_softmax;
  check_present(out_a, "out_a");
  check_present(lse_a, "lse_a");
  check_present(out_b, "out_b");
  check_present(lse_b, "lse_b");
  const auto& s = out_a.shape;
  for (int i = 0; i < 4; ++i)
    if (s[size_t(i)] < 0) fail("argument 'out_a' has a negative dimension " + shape_str(s));
  if (out_b.shape != s)
    fail("argument 'out_b' has shape " + shape_str(out_b.shape) + ", expected " + shape_str(s) +
         " (the shape of 'out_a')");
  const std::array<int64_t, 3> rows{s[0], s[1], s[2]};
  if (lse_a.shape != rows)
    fail("argument 'lse_a' has shape " + shape_str(lse_a.shape) + ", expected " + shape_str(rows) +
         " (B, H, L of 'out_a')");
  if (lse_b.shape != rows)
    fail("argument 'lse_b' has shape " + shape_str(lse_b.shape) + ", expected " + shape_str(rows) +
         " (B, H, L of 'out_a')");
  check_writable(out_a, "out_a");
  check_writable(lse_a, "lse_a");
  const T nan = std::numeric_limits<T>::quiet_NaN();
  for (int64_t b = 0; b < s[0]; ++b)
    for (int64_t h = 0; h < s[1]; ++h)
      for (int64_t i = 0; i < s[2]; ++i) {
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

template void merge_attention<float>(View4<float>, View3<float>, View4<const float>, View3<const float>);
template void merge_attention<double>(View4<double>, View3<double>, View4<const double>, View3<const double>);

}  // namespace attn
