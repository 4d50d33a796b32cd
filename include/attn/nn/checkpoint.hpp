// attn/nn/checkpoint.hpp — parameters and optimizer state as safetensors.
//
// The file format (https://github.com/huggingface/safetensors): an 8-byte
// little-endian header length n, n bytes of JSON mapping each tensor name to
// {"dtype", "shape", "data_offsets": [begin, end)} (offsets into the data
// that follows the header) plus an optional "__metadata__" object of strings,
// then the raw little-endian data. Writes are atomic: the file is written
// under a temporary name in the same folder, flushed to disk, and renamed
// over the target, so a crash never leaves a half-written checkpoint.
//
// This is a small self-contained reader/writer for the nn layer (F32 and F64
// only); a general one for the library lives with the other file formats.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "attn/tensor.hpp"

namespace attn::nn {

struct StoredTensor {
  std::string dtype;           // "F32" or "F64"
  std::vector<int64_t> shape;
  std::vector<unsigned char> bytes;
};

struct SafetensorsFile {
  std::map<std::string, std::string> metadata;
  std::map<std::string, StoredTensor> tensors;
};

// Throws attn::Error (naming the path and the problem) on I/O failure or a
// malformed file.
void write_safetensors(const std::string& path, const SafetensorsFile& file);
SafetensorsFile read_safetensors(const std::string& path);

// Writes `bytes` to `path` atomically (temporary file, fsync, rename);
// errors name `who` and the path.
void write_file_atomic(const std::string& path, const std::string& bytes, const char* who);

// Conversions between owned tensors and their stored form (the dtype follows T).
template <class T>
StoredTensor to_stored(const Tensor<T>& t);
// Copies a stored tensor into `out`, whose shape must match; F32 and F64 both
// load into float or double.
template <class T>
void from_stored(const StoredTensor& s, Tensor<T>& out, const std::string& name);

}  // namespace attn::nn
