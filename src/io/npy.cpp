// NumPy .npy: a magic string, a format version, a little-endian header length,
// a Python-literal dict {'descr': '<f4', 'fortran_order': False, 'shape': (..)}
// and the raw elements. The reader trusts nothing in the header: the dict is
// parsed by a small strict parser, the header length and the data length are
// checked against the bytes actually present, and the element count is
// computed with overflow checks before anything is allocated.
#include <bit>
#include <cctype>
#include <cstring>
#include <string>
#include <vector>

#include "attn/io.hpp"
#include "io/io_detail.hpp"
#include "validate.hpp"

namespace attn::io {
namespace {

static_assert(std::endian::native == std::endian::little, "attn's file I/O assumes a little-endian host");

using detail::fail;

constexpr unsigned char kMagic[6] = {0x93, 'N', 'U', 'M', 'P', 'Y'};

struct NpyHeader {
  std::string descr;
  bool fortran = false;
  std::vector<int64_t> shape;
};

// A strict parser for the header dict: string keys; values are strings,
// True/False, or tuples of non-negative integers.
class DictParser {
 public:
  DictParser(std::string_view s, const std::string& name, int max_rank) : s_(s), name_(name), max_rank_(max_rank) {}

  NpyHeader parse() {
    NpyHeader h;
    bool have_descr = false, have_order = false, have_shape = false;
    expect('{');
    while (true) {
      skip_ws();
      if (peek() == '}') break;
      const std::string key = string_lit();
      expect(':');
      skip_ws();
      if (key == "descr") {
        if (peek() == '[') bad("structured dtypes (a field list in 'descr') are not supported");
        h.descr = string_lit();
        have_descr = true;
      } else if (key == "fortran_order") {
        h.fortran = bool_lit();
        have_order = true;
      } else if (key == "shape") {
        h.shape = tuple_lit();
        have_shape = true;
      } else {
        bad("unexpected key '" + key + "' in the header");
      }
      skip_ws();
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      skip_ws();
      if (peek() != '}') bad("expected ',' or '}' in the header");
    }
    expect('}');
    skip_ws();
    if (pos_ != s_.size()) bad("unexpected text after the header dict");
    if (!have_descr || !have_order || !have_shape)
      bad("the header dict lacks one of 'descr', 'fortran_order', 'shape'");
    return h;
  }

 private:
  [[noreturn]] void bad(const std::string& msg) const { fail(name_, "malformed .npy header: " + msg); }
  char peek() const { return pos_ < s_.size() ? s_[pos_] : '\0'; }
  void skip_ws() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\n' || s_[pos_] == '\t' || s_[pos_] == '\r')) ++pos_;
  }
  void expect(char c) {
    skip_ws();
    if (peek() != c) bad(std::string("expected '") + c + "'");
    ++pos_;
  }
  std::string string_lit() {
    skip_ws();
    const char q = peek();
    if (q != '\'' && q != '"') bad("expected a quoted string");
    ++pos_;
    const size_t start = pos_;
    while (pos_ < s_.size() && s_[pos_] != q) {
      if (s_[pos_] == '\\') bad("escapes in header strings are not supported");
      ++pos_;
    }
    if (pos_ >= s_.size()) bad("unterminated string");
    std::string out(s_.substr(start, pos_ - start));
    ++pos_;
    return out;
  }
  bool bool_lit() {
    if (s_.substr(pos_, 4) == "True") {
      pos_ += 4;
      return true;
    }
    if (s_.substr(pos_, 5) == "False") {
      pos_ += 5;
      return false;
    }
    bad("'fortran_order' must be True or False");
  }
  std::vector<int64_t> tuple_lit() {
    expect('(');
    std::vector<int64_t> dims;
    while (true) {
      skip_ws();
      if (peek() == ')') break;
      if (!std::isdigit(static_cast<unsigned char>(peek()))) bad("'shape' must be a tuple of non-negative integers");
      int64_t v = 0;
      while (std::isdigit(static_cast<unsigned char>(peek()))) {
        if (v > (int64_t(1) << 50)) bad("a dimension in 'shape' is absurdly large");
        v = v * 10 + (peek() - '0');
        ++pos_;
      }
      if (peek() == 'L') ++pos_;  // Python 2 long suffix
      dims.push_back(v);
      if (int(dims.size()) > max_rank_) bad("'shape' has more than " + std::to_string(max_rank_) + " dimensions");
      skip_ws();
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      if (peek() != ')') bad("expected ',' or ')' in 'shape'");
    }
    expect(')');
    return dims;
  }

  std::string_view s_;
  const std::string& name_;
  int max_rank_;
  size_t pos_ = 0;
};

uint32_t le_u32(const unsigned char* p) { return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24; }

}  // namespace

template <class T>
Array<T> parse_npy(const unsigned char* bytes, size_t size, const std::string& name, const Limits& limits) {
  if (size < 10 || std::memcmp(bytes, kMagic, 6) != 0) fail(name, "not a .npy file (bad magic; expected \\x93NUMPY)");
  const unsigned major = bytes[6];
  size_t header_len = 0, start = 0;
  if (major == 1) {
    header_len = size_t(bytes[8]) | size_t(bytes[9]) << 8;
    start = 10;
  } else if (major == 2 || major == 3) {
    if (size < 12) fail(name, "truncated .npy preamble");
    header_len = le_u32(bytes + 8);
    start = 12;
  } else {
    fail(name, "unsupported .npy format version " + std::to_string(major) + "." + std::to_string(bytes[7]) +
                   " (1.0, 2.0 and 3.0 are read)");
  }
  if (header_len > limits.max_header_bytes)
    fail(name, "header length " + std::to_string(header_len) + " exceeds the limit of " +
                   std::to_string(limits.max_header_bytes) + " bytes");
  if (header_len > size - start)
    fail(name, "header length " + std::to_string(header_len) + " runs past the end of the file (" +
                   std::to_string(size) + " bytes)");
  const std::string_view text(reinterpret_cast<const char*>(bytes + start), header_len);
  const NpyHeader h = DictParser(text, name, limits.max_rank).parse();

  const std::string& d = h.descr;
  DType stored;
  bool big = false;
  if (d == "<f4" || d == "=f4" || d == ">f4") {
    stored = DType::f32;
  } else if (d == "<f8" || d == "=f8" || d == ">f8") {
    stored = DType::f64;
  } else if (d == "<f2" || d == "=f2" || d == ">f2") {
    stored = DType::f16;
  } else if (d == "|b1") {
    stored = DType::b1;
  } else {
    fail(name, "unsupported dtype '" + d +
                   "' (only float32 '<f4', float64 '<f8', float16 '<f2' and bool '|b1' are read)");
  }
  big = d[0] == '>';
  const uint64_t itemsize = detail::itemsize(stored);
  const uint64_t need = detail::checked_bytes(h.shape, itemsize, name);
  const uint64_t have = size - start - header_len;
  if (have < need)
    fail(name, "truncated: shape " + shape_str(h.shape) + " of " + dtype_name(stored) + " needs " +
                   std::to_string(need) + " data bytes, the file holds " + std::to_string(have));
  if (have > need)
    fail(name, "the file holds " + std::to_string(have - need) + " bytes beyond the data that shape " +
                   shape_str(h.shape) + " describes");

  Array<T> a;
  a.shape = h.shape;
  a.stored = stored;
  const size_t n = size_t(need / itemsize);
  a.data.resize(n);
  const unsigned char* src = bytes + start + header_len;
  if (n == 0) return a;  // no elements: nothing to decode, and the other axes may be huge
  if (!h.fortran || h.shape.size() < 2) {
    detail::decode_any(stored, src, n, big, a.data.data(), name);
  } else {
    // Fortran order: the first axis varies fastest in the file. Every axis is
    // >= 1 here, so each C stride is at most n and the products cannot overflow.
    std::vector<T> f(n);
    detail::decode_any(stored, src, n, big, f.data(), name);
    const size_t r = h.shape.size();
    std::vector<int64_t> idx(r, 0), cstride(r, 1);
    for (size_t i = r - 1; i > 0; --i) cstride[i - 1] = cstride[i] * h.shape[i];
    for (size_t fi = 0; fi < n; ++fi) {
      int64_t off = 0;
      for (size_t i = 0; i < r; ++i) off += idx[i] * cstride[i];
      a.data[size_t(off)] = f[fi];
      for (size_t i = 0; i < r; ++i) {
        if (++idx[i] < h.shape[i]) break;
        idx[i] = 0;
      }
    }
  }
  return a;
}

template <class T>
Array<T> read_npy(const std::string& path, const Limits& limits) {
  const std::vector<unsigned char> bytes = read_file(path, limits.max_file_bytes);
  return parse_npy<T>(bytes.data(), bytes.size(), path, limits);
}

template <class T>
std::vector<unsigned char> encode_npy(const std::vector<int64_t>& shape, const T* data) {
  const attn::detail::Checker c{"io::write_npy"};
  const int64_t n = c.count(shape, "shape");
  if (n > 0 && data == nullptr)
    c.fail("argument 'data' is a null pointer, but shape " + shape_str(shape) + " has " + std::to_string(n) +
           " elements");
  std::string header = std::string("{'descr': '") + (std::is_same_v<T, float> ? "<f4" : "<f8") +
                       "', 'fortran_order': False, 'shape': " + shape_str(shape) + ", }";
  // Pad with spaces and end with '\n' so the data starts on a 64-byte boundary.
  const size_t unpadded = 10 + header.size() + 1;
  header.append((64 - unpadded % 64) % 64, ' ');
  header += '\n';
  uint64_t nbytes = 0;
  if (__builtin_mul_overflow(uint64_t(n), uint64_t(sizeof(T)), &nbytes))
    c.fail("argument 'shape' " + shape_str(shape) + " has more bytes than memory can hold");
  if (header.size() > 65535) c.fail("argument 'shape' has " + std::to_string(shape.size()) + " dimensions, too many for a .npy header");
  std::vector<unsigned char> out(10 + header.size() + nbytes);
  std::memcpy(out.data(), kMagic, 6);
  out[6] = 1;
  out[7] = 0;
  out[8] = static_cast<unsigned char>(header.size() & 0xff);
  out[9] = static_cast<unsigned char>(header.size() >> 8);
  std::memcpy(out.data() + 10, header.data(), header.size());
  if (nbytes) std::memcpy(out.data() + 10 + header.size(), data, nbytes);
  return out;
}

template <class T>
void write_npy(const std::string& path, const std::vector<int64_t>& shape, const T* data) {
  const auto bytes = encode_npy(shape, data);
  write_file_atomic(path, bytes.data(), bytes.size());
}

#define ATTN_IO_NPY(T)                                                                                      \
  template Array<T> parse_npy<T>(const unsigned char*, size_t, const std::string&, const Limits&);        \
  template Array<T> read_npy<T>(const std::string&, const Limits&);                                        \
  template std::vector<unsigned char> encode_npy<T>(const std::vector<int64_t>&, const T*);                \
  template void write_npy<T>(const std::string&, const std::vector<int64_t>&, const T*);
ATTN_IO_NPY(float)
ATTN_IO_NPY(double)
#undef ATTN_IO_NPY

}  // namespace attn::io
