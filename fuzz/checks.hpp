// The property both parser fuzzers check, shared with the unit tests that
// replay the seed corpus (tests/test_io.cpp): an input either parses or is
// refused with attn::io::FileError (any other exception escapes, and a crash
// or sanitizer report is a failure), and whatever parses survives a
// write/read round trip bit for bit, "__metadata__" included.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "attn/io.hpp"

namespace attn::fuzz {

inline attn::io::Limits limits() {
  attn::io::Limits lim;
  lim.max_header_bytes = 1 << 16;
  return lim;
}

template <class T>
bool same(const attn::io::Array<T>& a, const attn::io::Array<T>& b) {
  return a.shape == b.shape && a.data.size() == b.data.size() &&
         (a.data.empty() || std::memcmp(a.data.data(), b.data.data(), a.data.size() * sizeof(T)) == 0);
}

// Returns true when the input parsed (and round-tripped), false when it was refused.
inline bool check_npy(const uint8_t* data, size_t size) {
  try {
    const auto a = attn::io::parse_npy<float>(data, size, "fuzz.npy", limits());
    const auto bytes = attn::io::encode_npy(a.shape, a.data.data());
    const auto b = attn::io::parse_npy<float>(bytes.data(), bytes.size(), "roundtrip.npy", limits());
    if (!same(a, b)) std::abort();
    return true;
  } catch (const attn::io::FileError&) {
    return false;
  }
}

inline bool check_safetensors(const uint8_t* data, size_t size) {
  try {
    attn::io::Metadata meta, meta_back;
    const auto t = attn::io::parse_safetensors<double>(data, size, "fuzz.safetensors", limits(), &meta);
    const auto bytes = attn::io::encode_safetensors(t, meta);
    const auto back =
        attn::io::parse_safetensors<double>(bytes.data(), bytes.size(), "roundtrip.safetensors", limits(), &meta_back);
    if (back.size() != t.size() || meta_back != meta) std::abort();
    for (const auto& [k, a] : t)
      if (!same(a, back.at(k))) std::abort();
    return true;
  } catch (const attn::io::FileError&) {
    return false;
  }
}

}  // namespace attn::fuzz
