// safetensors: an 8-byte little-endian header length N, N bytes of JSON
// mapping each tensor name to {dtype, shape, data_offsets: [begin, end]}
// (offsets relative to the byte buffer after the header), then the buffer.
// An optional "__metadata__" entry maps string keys to string values.
// The JSON is parsed by nlohmann-json after a cheap nesting-depth scan; every
// entry is checked (dtype, shape overflow, offsets inside the buffer, size
// matching the shape) before any tensor is allocated, so allocations never
// exceed the file's own size. As strict as the format (and the reference
// `safetensors` library): the header may be padded with trailing spaces only,
// and the tensors' byte ranges must tile the buffer exactly: no overlap, no
// hole, no trailing byte after the last tensor.
#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "attn/io.hpp"
#include "io/io_detail.hpp"
#include "validate.hpp"

namespace attn::io {
namespace {

using detail::fail;
using json = nlohmann::json;

// Rejects JSON nested deeper than `max_depth` (counting brackets outside strings).
bool nesting_ok(std::string_view s, int max_depth) {
  int depth = 0;
  bool in_str = false;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (in_str) {
      if (c == '\\') ++i;
      else if (c == '"') in_str = false;
    } else if (c == '"') {
      in_str = true;
    } else if (c == '{' || c == '[') {
      if (++depth > max_depth) return false;
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return true;
}

uint64_t as_u64(const json& j, const std::string& name, const std::string& what) {
  if (!j.is_number_unsigned()) fail(name, what + " must be a non-negative integer");
  return j.get<uint64_t>();
}

// The "__metadata__" entry: an object whose values are all strings.
Metadata read_metadata(const json& m, const std::string& name) {
  if (!m.is_object()) fail(name, "'__metadata__' is not a JSON object (expected string keys and values)");
  Metadata out;
  for (auto it = m.begin(); it != m.end(); ++it) {
    if (!it.value().is_string())
      fail(name, "'__metadata__' entry '" + it.key() + "' is not a string (found " + it.value().type_name() + ")");
    out.emplace(it.key(), it.value().get<std::string>());
  }
  return out;
}

struct Entry {
  std::string key;
  DType dtype;
  std::vector<int64_t> shape;
  uint64_t begin, end;
};

}  // namespace

template <class T>
std::map<std::string, Array<T>> parse_safetensors(const unsigned char* bytes, size_t size, const std::string& name,
                                                  const Limits& limits, Metadata* metadata) {
  if (size < 8) fail(name, "not a safetensors file (shorter than its 8-byte header length)");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
  if (n > limits.max_header_bytes)
    fail(name, "header length " + std::to_string(n) + " exceeds the limit of " +
                   std::to_string(limits.max_header_bytes) + " bytes (or this is not a safetensors file)");
  if (n > size - 8)
    fail(name, "header length " + std::to_string(n) + " runs past the end of the file (" + std::to_string(size) +
                   " bytes)");
  const std::string_view text(reinterpret_cast<const char*>(bytes + 8), size_t(n));
  if (text.empty() || text.front() != '{') fail(name, "not a safetensors file (the header is not a JSON object)");
  const size_t nul = text.find('\0');
  if (nul != std::string_view::npos)
    fail(name, "the JSON header holds a NUL byte at offset " + std::to_string(nul) +
                   " (the format pads the header with spaces only)");
  if (!nesting_ok(text, 8)) fail(name, "the JSON header is nested too deeply");
  json header = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded()) fail(name, "the JSON header does not parse");
  if (!header.is_object()) fail(name, "the JSON header is not an object");

  const uint64_t buffer = size - 8 - n;
  std::vector<Entry> entries;
  Metadata meta;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      meta = read_metadata(it.value(), name);
      continue;
    }
    if (int(entries.size()) >= limits.max_tensors)
      fail(name, "more than " + std::to_string(limits.max_tensors) + " tensors");
    const std::string where = "tensor '" + it.key() + "'";
    const json& t = it.value();
    if (!t.is_object()) fail(name, where + " is not a JSON object");
    if (!t.contains("dtype") || !t.contains("shape") || !t.contains("data_offsets"))
      fail(name, where + " lacks one of 'dtype', 'shape', 'data_offsets'");
    Entry e;
    e.key = it.key();
    const json& dt = t["dtype"];
    if (!dt.is_string()) fail(name, where + ": 'dtype' is not a string");
    const std::string d = dt.get<std::string>();
    if (d == "F32") e.dtype = DType::f32;
    else if (d == "F64") e.dtype = DType::f64;
    else fail(name, where + " has unsupported dtype '" + d + "' (only F32 and F64 are read)");
    const json& sh = t["shape"];
    if (!sh.is_array()) fail(name, where + ": 'shape' is not an array");
    if (int(sh.size()) > limits.max_rank)
      fail(name, where + ": 'shape' has more than " + std::to_string(limits.max_rank) + " dimensions");
    for (const auto& s : sh) {
      const uint64_t v = as_u64(s, name, where + ": each entry of 'shape'");
      if (v > (uint64_t(1) << 50)) fail(name, where + ": a dimension of 'shape' is absurdly large");
      e.shape.push_back(int64_t(v));
    }
    const json& off = t["data_offsets"];
    if (!off.is_array() || off.size() != 2) fail(name, where + ": 'data_offsets' must be [begin, end]");
    e.begin = as_u64(off[0], name, where + ": 'data_offsets'");
    e.end = as_u64(off[1], name, where + ": 'data_offsets'");
    if (e.begin > e.end || e.end > buffer)
      fail(name, where + " has data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
                     "] outside the " + std::to_string(buffer) + "-byte data buffer");
    const uint64_t need = detail::checked_bytes(e.shape, detail::itemsize(e.dtype), name + ": " + where);
    if (e.end - e.begin != need)
      fail(name, where + " spans " + std::to_string(e.end - e.begin) + " bytes, but shape " +
                     shape_str(e.shape) + " of " + dtype_name(e.dtype) + " needs " + std::to_string(need));
    entries.push_back(std::move(e));
  }
  // The byte ranges, in order, must tile [0, buffer): each starts where the
  // previous one ended (an empty tensor is a range of length 0).
  std::vector<const Entry*> order;
  for (const auto& e : entries) order.push_back(&e);
  std::sort(order.begin(), order.end(),
            [](const Entry* a, const Entry* b) { return a->begin != b->begin ? a->begin < b->begin : a->end < b->end; });
  uint64_t covered = 0;
  const Entry* prev = nullptr;
  for (const Entry* e : order) {
    if (e->begin < covered)
      fail(name, "tensors '" + prev->key + "' and '" + e->key + "' overlap in the data buffer");
    if (e->begin > covered)
      fail(name, "bytes [" + std::to_string(covered) + ", " + std::to_string(e->begin) +
                     ") of the data buffer belong to no tensor (a hole before tensor '" + e->key + "')");
    covered = e->end;
    prev = e;
  }
  if (covered != buffer)
    fail(name, "the file holds " + std::to_string(buffer - covered) + " trailing bytes after the last tensor's data");

  std::map<std::string, Array<T>> out;
  const unsigned char* base = bytes + 8 + n;
  for (const auto& e : entries) {
    Array<T> a;
    a.shape = e.shape;
    a.stored = e.dtype;
    const size_t count = size_t((e.end - e.begin) / detail::itemsize(e.dtype));
    a.data.resize(count);
    detail::decode_any(e.dtype, base + e.begin, count, false, a.data.data(), name);
    out.emplace(e.key, std::move(a));
  }
  if (metadata) *metadata = std::move(meta);
  return out;
}

template <class T>
std::map<std::string, Array<T>> read_safetensors(const std::string& path, const Limits& limits, Metadata* metadata) {
  const std::vector<unsigned char> bytes = read_file(path, limits.max_file_bytes);
  return parse_safetensors<T>(bytes.data(), bytes.size(), path, limits, metadata);
}

template <class T>
std::vector<unsigned char> encode_safetensors(const std::map<std::string, Array<T>>& tensors,
                                              const Metadata& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  const attn::detail::Checker c{"io::write_safetensors"};
  uint64_t offset = 0;
  for (const auto& [key, a] : tensors) {
    if (key == "__metadata__") c.fail("'__metadata__' is not a tensor name");
    const std::string name = "tensors['" + key + "']";
    if (c.count(a.shape, name.c_str()) != int64_t(a.data.size()))
      c.fail("tensor '" + key + "' has shape " + shape_str(a.shape) + " but " + std::to_string(a.data.size()) +
             " elements");
    const uint64_t nbytes = a.data.size() * sizeof(T);
    header[key] = {{"dtype", std::is_same_v<T, float> ? "F32" : "F64"},
                   {"shape", a.shape},
                   {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const json::type_error&) {
    c.fail("a tensor name or metadata entry is not valid UTF-8");
  }
  text.append((8 - text.size() % 8) % 8, ' ');  // keep the buffer 8-byte aligned
  std::vector<unsigned char> out(8 + text.size() + offset);
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[size_t(i)] = static_cast<unsigned char>(n >> (8 * i));
  std::memcpy(out.data() + 8, text.data(), text.size());
  unsigned char* p = out.data() + 8 + text.size();
  for (const auto& [key, a] : tensors) {
    if (!a.data.empty()) std::memcpy(p, a.data.data(), a.data.size() * sizeof(T));
    p += a.data.size() * sizeof(T);
  }
  return out;
}

template <class T>
void write_safetensors(const std::string& path, const std::map<std::string, Array<T>>& tensors,
                       const Metadata& metadata) {
  std::vector<unsigned char> bytes;
  try {
    bytes = encode_safetensors(tensors, metadata);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(path + ": " + e.what());  // say which output the bad tensors were meant for
  }
  write_file_atomic(path, bytes.data(), bytes.size());
}

#define ATTN_IO_ST(T)                                                                                          \
  template std::map<std::string, Array<T>> parse_safetensors<T>(const unsigned char*, size_t,                 \
                                                                const std::string&, const Limits&, Metadata*); \
  template std::map<std::string, Array<T>> read_safetensors<T>(const std::string&, const Limits&, Metadata*); \
  template std::vector<unsigned char> encode_safetensors<T>(const std::map<std::string, Array<T>>&,          \
                                                            const Metadata&);                                \
  template void write_safetensors<T>(const std::string&, const std::map<std::string, Array<T>>&,             \
                                     const Metadata&);
ATTN_IO_ST(float)
ATTN_IO_ST(double)
#undef ATTN_IO_ST

}  // namespace attn::io
