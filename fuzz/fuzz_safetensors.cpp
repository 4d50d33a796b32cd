// libFuzzer target for the safetensors reader: any input must either parse or
// throw attn::io::FileError (a JSON or allocation exception escaping is a bug);
// whatever parses, tensors and "__metadata__" alike, must survive a write/read
// round trip.
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "attn/io.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  attn::io::Limits lim;
  lim.max_header_bytes = 1 << 16;
  try {
    attn::io::Metadata meta, meta_back;
    const auto t = attn::io::parse_safetensors<double>(data, size, "fuzz.safetensors", lim, &meta);
    const auto bytes = attn::io::encode_safetensors(t, meta);
    const auto back =
        attn::io::parse_safetensors<double>(bytes.data(), bytes.size(), "roundtrip.safetensors", lim, &meta_back);
    if (back.size() != t.size() || meta_back != meta) std::abort();
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
