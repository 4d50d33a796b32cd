// A minimal safetensors reader and atomic writer (F32/F64), for checkpoints.
#include "attn/nn/checkpoint.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "attn/error.hpp"

namespace attn::nn {

static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian");

namespace {

int64_t dtype_size(const std::string& dtype) {
  if (dtype == "F32") return 4;
  if (dtype == "F64") return 8;
  return 0;
}

[[noreturn]] void fail(const std::string& fn, const std::string& path, const std::string& msg) {
  throw Error("attn::nn::" + fn + ": '" + path + "': " + msg);
}

}  // namespace

void write_safetensors(const std::string& path, const SafetensorsFile& file) {
  const char* fn = "write_safetensors";
  nlohmann::json header = nlohmann::json::object();
  if (!file.metadata.empty()) header["__metadata__"] = file.metadata;
  uint64_t offset = 0;
  for (const auto& [name, t] : file.tensors) {
    if (name == "__metadata__") fail(fn, path, "a tensor may not be named __metadata__");
    const int64_t es = dtype_size(t.dtype);
    if (es == 0) fail(fn, path, "tensor '" + name + "' has dtype '" + t.dtype + "', expected F32 or F64");
    int64_t n = 1;
    for (auto s : t.shape) n *= s;
    if (int64_t(t.bytes.size()) != n * es)
      fail(fn, path, "tensor '" + name + "' holds " + std::to_string(t.bytes.size()) + " bytes, its shape needs " +
                         std::to_string(n * es));
    header[name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.bytes.size()}}};
    offset += t.bytes.size();
  }
  std::string hs = header.dump();
  hs.append((8 - hs.size() % 8) % 8, ' ');  // pad so the data starts 8-byte aligned
  const uint64_t hlen = hs.size();

  std::string bytes;
  bytes.reserve(8 + hs.size() + offset);
  bytes.append(reinterpret_cast<const char*>(&hlen), 8);
  bytes += hs;
  for (const auto& [name, t] : file.tensors) bytes.append(reinterpret_cast<const char*>(t.bytes.data()), t.bytes.size());
  write_file_atomic(path, bytes, "attn::nn::write_safetensors");
}

void write_file_atomic(const std::string& path, const std::string& bytes, const char* who) {
  // Write a temporary file next to the target, flush it to disk, rename it over.
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) throw Error(std::string(who) + ": '" + path + "': cannot create a temporary file: " + std::strerror(errno));
  bool ok = bytes.empty() || std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
  ok = ok && std::fflush(f) == 0 && ::fsync(::fileno(f)) == 0;
  const int err = errno;
  ok = (std::fclose(f) == 0) && ok;
  if (!ok) {
    std::remove(tmp.c_str());
    throw Error(std::string(who) + ": '" + path + "': write failed: " + std::strerror(err));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = errno;
    std::remove(tmp.c_str());
    throw Error(std::string(who) + ": '" + path + "': cannot rename the temporary file into place: " + std::strerror(e));
  }
}

SafetensorsFile read_safetensors(const std::string& path) {
  const char* fn = "read_safetensors";
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(fn, path, "cannot open file");
  in.seekg(0, std::ios::end);
  const uint64_t size = uint64_t(in.tellg());
  in.seekg(0);
  uint64_t hlen = 0;
  if (size < 8 || !in.read(reinterpret_cast<char*>(&hlen), 8)) fail(fn, path, "file is shorter than the 8-byte header length");
  if (hlen > size - 8) fail(fn, path, "header length " + std::to_string(hlen) + " exceeds the file size");
  std::string hs(size_t(hlen), '\0');
  if (!in.read(hs.data(), std::streamsize(hlen))) fail(fn, path, "cannot read the header");
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(hs);
  } catch (const std::exception& e) {
    fail(fn, path, std::string("header is not valid JSON: ") + e.what());
  }
  if (!header.is_object()) fail(fn, path, "header is not a JSON object");
  const uint64_t data_size = size - 8 - hlen;
  SafetensorsFile out;
  try {
    for (auto it = header.begin(); it != header.end(); ++it) {
      if (it.key() == "__metadata__") {
        for (auto m = it.value().begin(); m != it.value().end(); ++m) out.metadata[m.key()] = m.value().get<std::string>();
        continue;
      }
      const auto& e = it.value();
      StoredTensor t;
      t.dtype = e.at("dtype").get<std::string>();
      t.shape = e.at("shape").get<std::vector<int64_t>>();
      const auto off = e.at("data_offsets").get<std::vector<uint64_t>>();
      const int64_t es = dtype_size(t.dtype);
      if (es == 0) fail(fn, path, "tensor '" + it.key() + "' has dtype '" + t.dtype + "'; only F32 and F64 are supported");
      int64_t n = 1;
      for (auto s : t.shape) {
        if (s < 0) fail(fn, path, "tensor '" + it.key() + "' has a negative dimension");
        n *= s;
      }
      if (off.size() != 2 || off[0] > off[1] || off[1] > data_size || off[1] - off[0] != uint64_t(n * es))
        fail(fn, path, "tensor '" + it.key() + "' has data_offsets that do not match its shape and dtype or the file size");
      t.bytes.resize(size_t(off[1] - off[0]));
      in.seekg(std::streamoff(8 + hlen + off[0]));
      if (!t.bytes.empty() && !in.read(reinterpret_cast<char*>(t.bytes.data()), std::streamsize(t.bytes.size())))
        fail(fn, path, "cannot read the data of tensor '" + it.key() + "'");
      out.tensors.emplace(it.key(), std::move(t));
    }
  } catch (const nlohmann::json::exception& e) {
    fail(fn, path, std::string("malformed header entry: ") + e.what());
  }
  return out;
}

template <class T>
StoredTensor to_stored(const Tensor<T>& t) {
  StoredTensor s;
  s.dtype = sizeof(T) == 4 ? "F32" : "F64";
  s.shape = t.shape();
  s.bytes.resize(t.size() * sizeof(T));
  if (t.size()) std::memcpy(s.bytes.data(), t.data(), s.bytes.size());
  return s;
}

template <class T>
void from_stored(const StoredTensor& s, Tensor<T>& out, const std::string& name) {
  if (s.shape != out.shape()) {
    std::string a, b;
    for (auto v : s.shape) a += (a.empty() ? "" : ", ") + std::to_string(v);
    for (auto v : out.shape()) b += (b.empty() ? "" : ", ") + std::to_string(v);
    throw Error("attn::nn::from_stored: tensor '" + name + "' has shape (" + a + "), expected (" + b + ")");
  }
  if (s.dtype == "F32") {
    for (size_t i = 0; i < out.size(); ++i) {
      float v;
      std::memcpy(&v, s.bytes.data() + 4 * i, 4);
      out[i] = T(v);
    }
  } else if (s.dtype == "F64") {
    for (size_t i = 0; i < out.size(); ++i) {
      double v;
      std::memcpy(&v, s.bytes.data() + 8 * i, 8);
      out[i] = T(v);
    }
  } else {
    throw Error("attn::nn::from_stored: tensor '" + name + "' has dtype '" + s.dtype + "', expected F32 or F64");
  }
}

template StoredTensor to_stored<float>(const Tensor<float>&);
template StoredTensor to_stored<double>(const Tensor<double>&);
template void from_stored<float>(const StoredTensor&, Tensor<float>&, const std::string&);
template void from_stored<double>(const StoredTensor&, Tensor<double>&, const std::string&);

}  // namespace attn::nn
