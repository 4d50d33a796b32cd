// Internal helpers shared by the .npy and safetensors readers: whole-file
// reads, overflow-checked sizes and element decoding from raw little/big-endian
// bytes.
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "attn/half.hpp"
#include "attn/io.hpp"

namespace attn::io {

// Reads a whole file (at most max_bytes, else FileError).
std::vector<unsigned char> read_file(const std::string& path, uint64_t max_bytes);

}  // namespace attn::io

namespace attn::io::detail {

// A file error: "<name>: <msg>", with the errno of the failed call if any.
[[noreturn]] inline void fail(const std::string& name, const std::string& msg, int error_code = 0) {
  throw FileError(name, msg, error_code);
}
// The same for a failed system call: "<name>: <what>: <strerror(errno)>".
[[noreturn]] inline void fail_errno(const std::string& name, const std::string& what) {
  const int err = errno;
  fail(name, what + ": " + std::strerror(err), err);
}

// Element count of `shape` times `itemsize`, or fail when it overflows 62
// bits. An empty shape (some axis 0) needs 0 bytes whatever its other axes.
inline uint64_t checked_bytes(const std::vector<int64_t>& shape, uint64_t itemsize, const std::string& name) {
  for (auto s : shape)
    if (s < 0) fail(name, "negative dimension " + std::to_string(s) + " in shape " + shape_str(shape));
  for (auto s : shape)
    if (s == 0) return 0;
  uint64_t n = itemsize;
  for (auto s : shape) {
    uint64_t r = 0;
    if (__builtin_mul_overflow(n, uint64_t(s), &r) || r > (uint64_t(1) << 62))
      fail(name, "shape " + shape_str(shape) + " has more elements than any file could hold");
    n = r;
  }
  return n;
}

// Decodes `count` elements of type S stored with the given byte order into T.
template <class S, class T>
void decode(const unsigned char* src, size_t count, bool big_endian, T* dst) {
  unsigned char buf[sizeof(S)];
  for (size_t i = 0; i < count; ++i) {
    std::memcpy(buf, src + i * sizeof(S), sizeof(S));
    if (big_endian)
      for (size_t b = 0; b < sizeof(S) / 2; ++b) std::swap(buf[b], buf[sizeof(S) - 1 - b]);
    S v;
    std::memcpy(&v, buf, sizeof(S));
    dst[i] = T(v);
  }
}

inline size_t itemsize(DType d) { return d == DType::f32 ? 4 : d == DType::f64 ? 8 : d == DType::f16 ? 2 : 1; }

// Decodes `count` elements stored as `stored` into T. A bool byte must be 0
// or 1 (NumPy writes nothing else); `name` names the file when it is not.
template <class T>
void decode_any(DType stored, const unsigned char* src, size_t count, bool big_endian, T* dst,
                const std::string& name) {
  if (stored == DType::f32) {
    decode<float>(src, count, big_endian, dst);
  } else if (stored == DType::f64) {
    decode<double>(src, count, big_endian, dst);
  } else if (stored == DType::f16) {
    std::vector<uint16_t> bits(count);
    decode<uint16_t>(src, count, big_endian, bits.data());
    for (size_t i = 0; i < count; ++i) dst[i] = T(float(float16_t::from_bits(bits[i])));  // exact
  } else {
    for (size_t i = 0; i < count; ++i) {
      if (src[i] > 1)
        fail(name, "bool element " + std::to_string(i) + " is the byte " + std::to_string(src[i]) +
                       ", expected 0 (False) or 1 (True)");
      dst[i] = T(src[i]);
    }
  }
}

template <class T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::f32; }
template <> constexpr DType dtype_of<double>() { return DType::f64; }

}  // namespace attn::io::detail
