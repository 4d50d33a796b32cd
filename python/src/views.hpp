// NumPy arrays as attn views, shared by the extensions attn._attn and
// attn._attn_dist: pointer, shape and element strides, never a copy.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>

#include "attn/error.hpp"
#include "attn/tensor.hpp"

namespace attn_python {

template <class T, int R>
using Arr = nanobind::ndarray<T, nanobind::ndim<R>, nanobind::device::cpu>;

// A strided view of an ndarray. Strides are in elements, as attn expects;
// negative strides are refused here (the Python layer copies such inputs).
template <class T, int R, class A>
attn::View<T, R> view_of(const A& a, const char* name) {
  std::array<int64_t, R> shape{}, strides{};
  for (int i = 0; i < R; ++i) {
    shape[size_t(i)] = int64_t(a.shape(size_t(i)));
    strides[size_t(i)] = int64_t(a.stride(size_t(i)));
    if (strides[size_t(i)] < 0)
      throw attn::InvalidArgument(std::string("attn._attn: argument '") + name + "' has a negative stride on axis " +
                                  std::to_string(i));
  }
  return attn::View<T, R>(static_cast<T*>(a.data()), shape, strides);
}

template <class T, int R, class A>
attn::View<T, R> view_of(const std::optional<A>& a, const char* name) {
  return a ? view_of<T, R>(*a, name) : attn::View<T, R>{};
}

}  // namespace attn_python
