// The non-template parts of the boundary's Checker (see validate.hpp).
#include "validate.hpp"

#include <omp.h>

#include <algorithm>
#include <utility>

#include "attn/sdpa.hpp"

namespace attn::detail {

void Checker::fail(const std::string& msg) const { throw InvalidArgument("attn::" + fn + ": " + msg); }

int64_t Checker::count(const int64_t* shape, int rank, const char* name) const {
  const std::span<const int64_t> s(shape, size_t(rank));
  if (std::any_of(s.begin(), s.end(), [](int64_t d) { return d < 0; }))
    fail(std::string("argument '") + name + "' has shape " + shape_str(s) + ", expected dimensions >= 0");
  if (std::find(s.begin(), s.end(), 0) != s.end()) return 0;  // empty, whatever the other axes
  int64_t n = 1;
  for (int64_t d : s)
    if (!checked_mul(n, d, &n))
      fail(std::string("argument '") + name + "' has shape " + shape_str(s) +
           ", too large: its element count does not fit in 64 bits");
  return n;
}

void Checker::sizes_impl(const int64_t* shape, const int64_t* strides, int rank, int64_t itemsize,
                         const char* name) const {
  if (count(shape, rank, name) == 0) return;
  int64_t last = itemsize;  // bytes from the first element's start to the last one's end
  for (int i = 0; i < rank; ++i) {
    int64_t span = 0;
    if (strides[i] < 0)
      fail(std::string("argument '") + name + "' has stride " + std::to_string(strides[i]) + " on axis " +
           std::to_string(i) + ", expected strides >= 0");
    if (!checked_mul(shape[i] - 1, strides[i], &span) || !checked_mul(span, itemsize, &span) ||
        !checked_add(last, span, &last))
      fail(std::string("argument '") + name + "' has shape " + shape_str(std::span(shape, size_t(rank))) +
           " and strides whose memory extent does not fit in 64 bits");
  }
}

void Checker::writable(const Extent& e) const {
  // Sufficient for distinct addresses: with the axes of size > 1 sorted by
  // stride, each stride steps past everything the smaller axes span. A view
  // with no elements writes nothing.
  std::vector<std::pair<int64_t, int>> axes;  // (stride, axis)
  for (int i = 0; i < e.rank; ++i) {
    if (e.shape[size_t(i)] == 0) return;
    if (e.shape[size_t(i)] > 1) axes.emplace_back(e.stride[size_t(i)], i);
  }
  std::sort(axes.begin(), axes.end());
  int64_t span = 0;  // bytes from the first to the last element of the smaller axes
  for (const auto& [stride, i] : axes) {
    if (stride == 0)
      fail(std::string("output '") + e.name + "' has stride 0 on axis " + std::to_string(i) +
           " (a broadcast view cannot be written)");
    if (stride < span + e.itemsize)
      fail(std::string("output '") + e.name + "' has overlapping strides: axis " + std::to_string(i) +
           " steps " + std::to_string(stride / e.itemsize) +
           " elements, inside the span of its faster axes (two elements would share an address)");
    span += (e.shape[size_t(i)] - 1) * stride;
  }
}

namespace {

bool has_elements(const Extent& e) {
  for (int i = 0; i < e.rank; ++i)
    if (e.shape[size_t(i)] == 0) return false;
  return e.lo != 0;
}

// Whether some period P splits the two views: every axis of both is either
// a multiple of P or lies inside one period, and within a period the two
// views' byte ranges do not meet. This accepts interleaved layouts such as
// q, k and v as column blocks of one packed (N, 3D) matrix.
bool separated_by_period(const Extent& a, const Extent& b) {
  const uintptr_t origin = std::min(a.lo, b.lo);
  auto residues = [&](const Extent& x, int64_t P, int64_t* lo, int64_t* hi) {
    int64_t inner = 0;
    for (int i = 0; i < x.rank; ++i) {
      if (x.shape[size_t(i)] <= 1) continue;
      const int64_t s = x.stride[size_t(i)];
      if (s >= P) {
        if (s % P != 0) return false;
      } else {
        inner += (x.shape[size_t(i)] - 1) * s;
      }
    }
    *lo = int64_t((x.lo - origin) % uint64_t(P));
    *hi = *lo + inner + x.itemsize - 1;
    return *hi < P;
  };
  for (const Extent* src : {&a, &b})
    for (int i = 0; i < src->rank; ++i) {
      const int64_t P = src->stride[size_t(i)];
      if (src->shape[size_t(i)] <= 1 || P <= 0) continue;
      int64_t alo, ahi, blo, bhi;
      if (residues(a, P, &alo, &ahi) && residues(b, P, &blo, &bhi) && (ahi < blo || bhi < alo)) return true;
    }
  return false;
}

}  // namespace

void Checker::disjoint(const std::vector<Extent>& outputs, const std::vector<Extent>& inputs) const {
  auto check = [&](const Extent& o, const Extent& x, const char* what) {
    if (!has_elements(o) || !has_elements(x)) return;
    if (o.hi < x.lo || x.hi < o.lo || separated_by_period(o, x)) return;
    fail(std::string("output '") + o.name + "' overlaps " + what + " '" + x.name +
         "' in memory; outputs must not share memory with each other or with the inputs");
  };
  for (size_t i = 0; i < outputs.size(); ++i) {
    for (size_t j = i + 1; j < outputs.size(); ++j) check(outputs[i], outputs[j], "output");
    for (const Extent& x : inputs) check(outputs[i], x, "input");
  }
}

int Checker::threads(int requested, const char* name) const {
  if (requested < 0 || requested > kMaxThreads)
    fail(std::string("option '") + name + "' is " + std::to_string(requested) + ", expected 0 (the default) to " +
         std::to_string(kMaxThreads));
  if (requested == 0) return std::max(1, omp_get_max_threads());
  // The processors this process may run on, asked once (a system call, a
  // twentieth of a decode call over a few keys).
  static const int procs = std::max(1, omp_get_num_procs());
  return std::min(requested, 4 * procs);
}

}  // namespace attn::detail
