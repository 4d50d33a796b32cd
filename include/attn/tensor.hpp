// attn/tensor.hpp — strided views and a small owning tensor.
//
// Layout
// ------
// Every attention argument is a rank-4 view with logical axes
//
//     (batch B, heads H, sequence N, features d)
//
// and element strides for each axis (in elements, not bytes; strides may be
// any non-negative value, including 0 for broadcasting). The logical order is
// fixed; the physical order is whatever the strides say. So the same data can
// be described as
//
//     (B,H,N,d) contiguous:  strides = {H*N*d, N*d, d, 1}   -> View4::bhnd(...)
//     (B,N,H,d) contiguous:  strides = {N*H*d, d, H*d, 1}   -> View4::bnhd(...)
//
// and no kernel ever copies to change layout. Letters used everywhere:
//   B batch, H query heads, Hkv key/value heads, L queries, S keys,
//   E = d_k (query/key features), Ev = d_v (value features), D model width.
//
// Rank-3 views are used for per-row statistics (log-sum-exp, (B,H,L)) and for
// token matrices in the multi-head layer ((B,N,D)); rank-2 for weights
// ([out, in], PyTorch's convention) and rank-1 for biases.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "attn/error.hpp"

namespace attn {

// Human-readable shape as NumPy prints it: "(2, 4, 16, 64)", "(5,)", "()".
// The one shape formatter of the library's messages.
inline std::string shape_str(std::span<const int64_t> s) {
  std::string out = "(";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + (s.size() == 1 ? ",)" : ")");
}
inline std::string shape_str(std::initializer_list<int64_t> s) { return shape_str(std::span(s.begin(), s.size())); }

// A non-owning view of R-dimensional strided data. T may be const.
template <class T, int R>
struct View {
  static_assert(R >= 1 && R <= 4, "attn::View supports ranks 1 to 4");
  T* data = nullptr;
  std::array<int64_t, R> shape{};
  std::array<int64_t, R> strides{};  // in elements

  View() = default;
  View(T* d, std::array<int64_t, R> shp, std::array<int64_t, R> str)
      : data(d), shape(shp), strides(str) {}
  // Contiguous, row-major (last axis fastest).
  View(T* d, std::array<int64_t, R> shp) : data(d), shape(shp) {
    int64_t s = 1;
    for (int i = R - 1; i >= 0; --i) {
      strides[i] = s;
      s *= shp[i];
    }
  }

  // A view of const data converts implicitly from a view of mutable data.
  template <class U, class = std::enable_if_t<std::is_same_v<const U, T> && !std::is_same_v<U, T>>>
  View(const View<U, R>& o) : data(o.data), shape(o.shape), strides(o.strides) {}

  bool empty() const { return data == nullptr; }
  // The element count (0 when an axis is 0, whatever the others); throws
  // attn::InvalidArgument when a dimension is negative or the count does not
  // fit in int64 (never overflows).
  int64_t numel() const {
    for (auto s : shape)
      if (s <= 0) {
        if (s < 0) throw InvalidArgument("attn::View::numel: shape " + shape_str(shape) + " has a negative dimension");
        return 0;
      }
    int64_t n = 1;
    for (auto s : shape)
      if (__builtin_mul_overflow(n, s, &n))
        throw InvalidArgument("attn::View::numel: shape " + shape_str(shape) + " has more elements than int64 can count");
    return n;
  }
  int64_t dim(int i) const { return shape[i]; }

  template <class... I>
  T& operator()(I... idx) const {
    static_assert(sizeof...(I) == R, "wrong number of indices");
    const int64_t ii[R] = {static_cast<int64_t>(idx)...};
    int64_t off = 0;
    for (int i = 0; i < R; ++i) off += ii[i] * strides[i];
    return data[off];
  }

  // True when the elements are densely packed in row-major order.
  bool is_contiguous() const {
    int64_t s = 1;
    for (int i = R - 1; i >= 0; --i) {
      if (shape[i] != 1 && strides[i] != s) return false;
      s *= shape[i];
    }
    return true;
  }
};

template <class T>
struct View4 : View<T, 4> {
  using View<T, 4>::View;
  View4() = default;
  View4(const View<T, 4>& v) : View<T, 4>(v) {}
  template <class U, class = std::enable_if_t<std::is_same_v<const U, T> && !std::is_same_v<U, T>>>
  View4(const View<U, 4>& o) : View<T, 4>(o.data, o.shape, o.strides) {}

  // Memory laid out as (B, H, N, d), last axis fastest.
  static View4 bhnd(T* d, int64_t B, int64_t H, int64_t N, int64_t F) {
    return View4(d, {B, H, N, F}, {H * N * F, N * F, F, 1});
  }
  // Memory laid out as (B, N, H, d) — the "batch_first, heads interleaved"
  // layout of a projected (B, N, H*d) matrix — viewed as logical (B, H, N, d).
  static View4 bnhd(T* d, int64_t B, int64_t N, int64_t H, int64_t F) {
    return View4(d, {B, H, N, F}, {N * H * F, F, H * F, 1});
  }
};

template <class T> using View3 = View<T, 3>;
template <class T> using View2 = View<T, 2>;
template <class T> using View1 = View<T, 1>;

// Owning, contiguous, 64-byte aligned tensor of rank 1..4, zero-initialised
// (Tensor::uninitialized leaves the elements unset).
template <class T>
class Tensor {
 public:
  static constexpr size_t kAlign = 64;
  // The largest allocation considered: 2^62 bytes, or what size_t holds on a 32-bit target.
  static constexpr size_t kMaxBytes = size_t(std::min<uint64_t>(uint64_t(1) << 62, SIZE_MAX));

  Tensor() = default;
  explicit Tensor(std::vector<int64_t> shape) : Tensor(std::move(shape), true) {}
  Tensor(std::initializer_list<int64_t> shape) : Tensor(std::vector<int64_t>(shape)) {}
  // A tensor whose elements are left unset (PyTorch's torch.empty), for a
  // buffer the caller overwrites whole: it skips a pass that writes zeros.
  static Tensor uninitialized(std::vector<int64_t> shape) { return Tensor(std::move(shape), false); }
  Tensor(const Tensor& o) {
    if (o.shape_.empty()) return;  // copy of an empty tensor
    Tensor t(o.shape_, false);
    for (size_t i = 0; i < t.size_; ++i) t.data_[i] = o.data_[i];
    *this = std::move(t);
  }
  Tensor& operator=(const Tensor& o) {
    if (this != &o) {
      Tensor t(o);
      *this = std::move(t);
    }
    return *this;
  }
  Tensor(Tensor&&) noexcept = default;
  Tensor& operator=(Tensor&&) noexcept = default;

  T* data() { return data_.get(); }
  const T* data() const { return data_.get(); }
  size_t size() const { return size_; }
  int rank() const { return static_cast<int>(shape_.size()); }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t dim(int i) const { return shape_.at(static_cast<size_t>(i)); }
  T& operator[](size_t i) { return data_[i]; }
  const T& operator[](size_t i) const { return data_[i]; }
  void fill(T v) {
    for (size_t i = 0; i < size_; ++i) data_[i] = v;
  }

  // Views of the whole tensor; the rank must match.
  template <int R> View<T, R> view() { return View<T, R>(data(), dims<R>()); }
  template <int R> View<const T, R> view() const { return View<const T, R>(data(), dims<R>()); }
  View4<T> view4() { return View4<T>(view<4>()); }
  View4<const T> view4() const { return View4<const T>(view<4>()); }

 private:
  Tensor(std::vector<int64_t> shape, bool zero) : shape_(std::move(shape)) {
    if (shape_.empty() || shape_.size() > 4)
      throw InvalidArgument("attn::Tensor: rank must be 1 to 4, got " + std::to_string(shape_.size()));
    size_ = 1;
    for (auto s : shape_)
      if (s < 0) throw InvalidArgument("attn::Tensor: negative dimension " + std::to_string(s));
    for (auto s : shape_) {
      if (std::find(shape_.begin(), shape_.end(), 0) != shape_.end()) {
        size_ = 0;  // empty, whatever the other axes
        break;
      }
      if (__builtin_mul_overflow(size_, static_cast<size_t>(s), &size_) || size_ > kMaxBytes / sizeof(T))
        throw InvalidArgument("attn::Tensor: shape " + shape_str(shape_) + " is too large to allocate");
    }
    if (size_ > 0) {
      const size_t bytes = ((size_ * sizeof(T) + kAlign - 1) / kAlign) * kAlign;
      data_.reset(static_cast<T*>(::operator new[](bytes, std::align_val_t(kAlign))));
      if (zero)
        for (size_t i = 0; i < size_; ++i) data_[i] = T(0);
    }
  }
  struct Deleter {
    void operator()(T* p) const { ::operator delete[](p, std::align_val_t(kAlign)); }
  };
  template <int R>
  std::array<int64_t, R> dims() const {
    if (static_cast<int>(shape_.size()) != R)
      throw InvalidArgument("attn::Tensor::view: tensor has rank " + std::to_string(shape_.size()) +
                  ", requested a rank-" + std::to_string(R) + " view");
    std::array<int64_t, R> a{};
    for (int i = 0; i < R; ++i) a[i] = shape_[static_cast<size_t>(i)];
    return a;
  }
  std::vector<int64_t> shape_;
  size_t size_ = 0;
  std::unique_ptr<T[], Deleter> data_;
};

}  // namespace attn
