// libFuzzer target for the safetensors reader: any input must either parse or
// throw attn::io::FileError (a JSON or allocation exception escaping is a bug);
// whatever parses must survive a write/read round trip.
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "attn/io.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  attn::io::Limits lim;
  lim.max_header_bytes = 1 << 16;
  try {
    const auto t = attn::io::parse_safetensors<double>(data, size, "fuzz.safetensors", lim);
    const auto bytes = attn::io::encode_safetensors(t);
    const auto back = attn::io::parse_safetensors<double>(bytes.data(), bytes.size(), "roundtrip.safetensors", lim);
    if (back.size() != t.size()) std::abort();
    for (const auto& [k, a] : t) {
      const auto& b = back.at(k);
      if (b.shape != a.shape || b.data.size() != a.data.size() ||
          (!a.data.empty() && std::memcmp(a.data.data(), b.data.data(), a.data.size() * sizeof(double)) != 0))
        std::abort();
    }
  } catch (const attn::io::FileError&) {
  }
  return 0;
}
