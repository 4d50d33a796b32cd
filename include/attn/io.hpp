// attn/io.hpp — reading and writing arrays: NumPy .npy and .safetensors.
//
// Supported element types: float32 and float64 (little- or big-endian .npy,
// C or Fortran order; safetensors F32 / F64), float16 ('<f2', .npy only, read
// exactly), and NumPy's bool ('|b1', read as 0 and 1; masks are saved that way). Other dtypes are refused with a message
// that names the dtype found.
//
// Reading is defensive: a file is checked against its actual size before any
// allocation, so a header that lies about lengths, a shape whose element count
// overflows, data offsets outside the file, or a truncated file all end in
// attn::FileError with the path and the problem, never a crash or an
// allocation larger than the file. `Limits` caps what a reader accepts at all.
// Invalid arguments to a writer (a null data pointer, a shape that does not
// match the data) are attn::InvalidArgument.
//
// Writing is atomic: data goes to a temporary file in the destination's
// directory (<destination>.attn-tmp.XXXXXX), is flushed to disk and then
// renamed over the destination, so an interrupted run never leaves a
// half-written file behind; a new file gets 0666 minus the umask, a replaced
// one keeps its mode. attn/detail/output.hpp has the details (signals, and
// transactions over several outputs).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "attn/error.hpp"
#include "attn/tensor.hpp"

namespace attn::io {

// The library's file error (attn/error.hpp), under its older name.
using FileError = attn::FileError;

// b1: NumPy bool, one byte 0 or 1; f16: IEEE half (both .npy only).
enum class DType { f32, f64, b1, f16 };
const char* dtype_name(DType d);  // "float32", "float64", "bool", "float16"

// A dense, C-order (row-major) array of any rank (rank 0 is a scalar).
template <class T>
struct Array {
  std::vector<int64_t> shape;
  std::vector<T> data;
  DType stored = DType::f32;  // the element type found in the file

  // The product of the shape: 0 when any axis is 0 (the other axes of an
  // empty array read from a file may be huge), saturated at INT64_MAX.
  int64_t numel() const {
    for (auto s : shape)
      if (s == 0) return 0;
    int64_t n = 1;
    for (auto s : shape)
      if (__builtin_mul_overflow(n, s, &n)) return INT64_MAX;
    return n;
  }
};

// What a reader accepts (defaults suit the CLI).
struct Limits {
  uint64_t max_file_bytes = uint64_t(4) << 30;  // 4 GiB
  uint64_t max_header_bytes = uint64_t(1) << 24;  // 16 MiB (.npy dict / safetensors JSON)
  int max_rank = 8;
  int max_tensors = 4096;  // safetensors
};

// ---- .npy ------------------------------------------------------------------
// Reads a float32/float64/bool .npy and converts the elements to T (a bool
// becomes 0 or 1; `stored` says which type the file held).
template <class T>
Array<T> read_npy(const std::string& path, const Limits& limits = {});
// Parses .npy bytes already in memory; `name` is used in error messages.
template <class T>
Array<T> parse_npy(const unsigned char* bytes, size_t size, const std::string& name,
                   const Limits& limits = {});
// Writes `data` (numel(shape) elements, C order) as little-endian .npy of
// element type T (format version 1.0), atomically. `data` may be null only
// when the shape has no elements.
template <class T>
void write_npy(const std::string& path, const std::vector<int64_t>& shape, const T* data);
template <class T>
void write_npy(const std::string& path, const Array<T>& a) {
  if (a.numel() != int64_t(a.data.size()))
    throw InvalidArgument("attn::io::write_npy: argument 'a' has shape " + shape_str(a.shape) + " but " +
                          std::to_string(a.data.size()) + " elements");
  write_npy(path, a.shape, a.data.data());
}
// The serialised bytes write_npy would store.
template <class T>
std::vector<unsigned char> encode_npy(const std::vector<int64_t>& shape, const T* data);

// ---- .safetensors --------------------------------------------------------------
// The file's optional "__metadata__" entry: a flat JSON object whose values
// are all strings (the format allows nothing else).
using Metadata = std::map<std::string, std::string>;

// Reads every tensor of a safetensors file (F32/F64), converted to T, by name.
// When `metadata` is given it receives the "__metadata__" entry (empty when
// the file has none). Either way a "__metadata__" that is not an object of
// strings is refused.
template <class T>
std::map<std::string, Array<T>> read_safetensors(const std::string& path, const Limits& limits = {},
                                                 Metadata* metadata = nullptr);
template <class T>
std::map<std::string, Array<T>> parse_safetensors(const unsigned char* bytes, size_t size,
                                                  const std::string& name, const Limits& limits = {},
                                                  Metadata* metadata = nullptr);
// Writes the tensors as type T (F32 or F64), atomically, with `metadata` as
// "__metadata__" (omitted when empty). No tensor may be named "__metadata__".
template <class T>
void write_safetensors(const std::string& path, const std::map<std::string, Array<T>>& tensors,
                       const Metadata& metadata = {});
template <class T>
std::vector<unsigned char> encode_safetensors(const std::map<std::string, Array<T>>& tensors,
                                              const Metadata& metadata = {});

// ---- atomic writes -------------------------------------------------------------
// Writes bytes to `path` via a temporary file in the same directory + rename:
// the guarantee every attn writer gives (above), public so that front ends
// writing other formats (the CLI's PNG and CSV files) give it too.
// Throws attn::FileError.
void write_file_atomic(const std::string& path, const void* bytes, size_t size);

}  // namespace attn::io
