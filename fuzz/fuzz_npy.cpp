// libFuzzer target for the .npy reader: any input must either parse or throw
// attn::io::FileError; whatever parses must survive a write/read round trip.
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "attn/io.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  attn::io::Limits lim;
  lim.max_header_bytes = 1 << 16;
  try {
    const auto a = attn::io::parse_npy<float>(data, size, "fuzz.npy", lim);
    const auto bytes = attn::io::encode_npy(a.shape, a.data.data());
    const auto b = attn::io::parse_npy<float>(bytes.data(), bytes.size(), "roundtrip.npy", lim);
    if (b.shape != a.shape || b.data.size() != a.data.size() ||
        (!a.data.empty() && std::memcmp(a.data.data(), b.data.data(), a.data.size() * sizeof(float)) != 0))
      std::abort();
  } catch (const attn::io::FileError&) {
  }
  return 0;
}
