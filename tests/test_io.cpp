// File I/O: .npy and safetensors round trips, the layouts NumPy may write
// (big-endian, Fortran order, format 2.0), every class of malformed file, the
// atomic writer, and a seeded mutation loop (a miniature of the fuzzers).
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "../fuzz/checks.hpp"
#include "attn/detail/output.hpp"
#include "attn/io.hpp"
#include "io/io_detail.hpp"  // io::read_file
#include "testing.hpp"

namespace {

namespace fs = std::filesystem;
using attn::io::Array;
using attn::io::DType;
using attn::testing::throws_with;
using Bytes = std::vector<unsigned char>;

Bytes npy_bytes(const std::string& header_dict, const Bytes& data, int major = 1) {
  std::string h = header_dict;
  const size_t pre = major == 1 ? 10 : 12;
  while ((pre + h.size() + 1) % 16) h += ' ';
  h += '\n';
  Bytes b = {0x93, 'N', 'U', 'M', 'P', 'Y', static_cast<unsigned char>(major), 0};
  const size_t n = h.size();
  b.push_back(static_cast<unsigned char>(n & 0xff));
  b.push_back(static_cast<unsigned char>((n >> 8) & 0xff));
  if (major != 1) {
    b.push_back(static_cast<unsigned char>((n >> 16) & 0xff));
    b.push_back(static_cast<unsigned char>((n >> 24) & 0xff));
  }
  b.insert(b.end(), h.begin(), h.end());
  b.insert(b.end(), data.begin(), data.end());
  return b;
}

template <class T>
Bytes raw(const std::vector<T>& v, bool big_endian = false) {
  Bytes b(v.size() * sizeof(T));
  std::memcpy(b.data(), v.data(), b.size());
  if (big_endian)
    for (size_t i = 0; i < v.size(); ++i) std::reverse(b.begin() + long(i * sizeof(T)), b.begin() + long((i + 1) * sizeof(T)));
  return b;
}

Array<double> parse(const Bytes& b, const attn::io::Limits& lim = {}) {
  return attn::io::parse_npy<double>(b.data(), b.size(), "x.npy", lim);
}

Bytes st_bytes(const std::string& json, const Bytes& data, uint64_t declared = UINT64_MAX) {
  const uint64_t n = declared == UINT64_MAX ? json.size() : declared;
  Bytes b(8 + json.size() + data.size());
  for (int i = 0; i < 8; ++i) b[size_t(i)] = static_cast<unsigned char>(n >> (8 * i));
  std::copy(json.begin(), json.end(), b.begin() + 8);
  std::copy(data.begin(), data.end(), b.begin() + 8 + long(json.size()));
  return b;
}

std::map<std::string, Array<double>> parse_st(const Bytes& b, const attn::io::Limits& lim = {}) {
  return attn::io::parse_safetensors<double>(b.data(), b.size(), "w.safetensors", lim);
}

struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() / ("attn_test_io_" + std::to_string(::getpid()) + "_" +
                                        std::to_string(std::random_device{}()));
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string operator/(const std::string& f) const { return (path / f).string(); }
};

TEST(Npy, RoundTripFloatAndDoubleAllRanks) {
  TempDir dir;
  std::mt19937_64 rng(1);
  std::normal_distribution<double> nd;
  for (const std::vector<int64_t>& shape :
       std::vector<std::vector<int64_t>>{{}, {5}, {2, 3}, {2, 0, 3}, {1, 2, 3, 4}, {2, 1, 2, 1, 3}}) {
    int64_t n = 1;
    for (auto s : shape) n *= s;
    std::vector<double> d(static_cast<size_t>(n));
    for (auto& x : d) x = nd(rng);
    std::vector<float> f(d.begin(), d.end());
    attn::io::write_npy(dir / "d.npy", shape, d.data());
    attn::io::write_npy(dir / "f.npy", shape, f.data());
    const auto rd = attn::io::read_npy<double>(dir / "d.npy");
    const auto rf = attn::io::read_npy<float>(dir / "f.npy");
    const auto rfd = attn::io::read_npy<double>(dir / "f.npy");  // float32 file read as double: exact
    EXPECT_EQ(rd.shape, shape);
    EXPECT_EQ(rd.stored, DType::f64);
    EXPECT_EQ(rf.stored, DType::f32);
    EXPECT_EQ(rd.data, d);
    EXPECT_EQ(rf.data, f);
    for (size_t i = 0; i < f.size(); ++i) EXPECT_EQ(rfd.data[i], double(f[i]));
  }
}

TEST(Npy, WriterMatchesNumpyLayout) {
  const std::vector<float> v = {1, 2, 3, 4, 5, 6};
  const Bytes b = attn::io::encode_npy<float>({2, 3}, v.data());
  ASSERT_GE(b.size(), 10u);
  const size_t header = size_t(b[8]) | size_t(b[9]) << 8;
  EXPECT_EQ((10 + header) % 64, 0u) << "data must start on a 64-byte boundary";
  const std::string h(b.begin() + 10, b.begin() + 10 + long(header));
  EXPECT_NE(h.find("'descr': '<f4'"), std::string::npos) << h;
  EXPECT_NE(h.find("'shape': (2, 3)"), std::string::npos) << h;
  EXPECT_EQ(h.back(), '\n');
  const Bytes one = attn::io::encode_npy<float>({6}, v.data());
  EXPECT_NE(std::string(one.begin(), one.end()).find("(6,)"), std::string::npos);
}

TEST(Npy, BigEndianFortranOrderAndVersion2) {
  const std::vector<double> c_order = {1, 2, 3, 4, 5, 6};  // (2, 3) row-major
  const auto be = parse(npy_bytes("{'descr': '>f8', 'fortran_order': False, 'shape': (2, 3), }", raw(c_order, true)));
  EXPECT_EQ(be.data, c_order);
  // Fortran order stores columns first: 1 4 2 5 3 6.
  const std::vector<float> f_order = {1, 4, 2, 5, 3, 6};
  const auto fo = parse(npy_bytes("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }", raw(f_order)));
  EXPECT_EQ(fo.data, c_order);
  EXPECT_EQ(fo.shape, (std::vector<int64_t>{2, 3}));
  const auto v2 = parse(npy_bytes("{\"descr\": \"<f8\", \"fortran_order\": False, \"shape\": (6,)}", raw(c_order), 2));
  EXPECT_EQ(v2.data, c_order);
}

// Issue 10 §8.1: masks saved with np.save from a NumPy bool array ('|b1').
TEST(Npy, BoolArraysReadAsZeroAndOne) {
  const auto c = parse(npy_bytes("{'descr': '|b1', 'fortran_order': False, 'shape': (2, 3), }", Bytes{1, 0, 1, 1, 0, 0}));
  EXPECT_EQ(c.stored, DType::b1);
  EXPECT_EQ(c.data, (std::vector<double>{1, 0, 1, 1, 0, 0}));
  EXPECT_STREQ(attn::io::dtype_name(c.stored), "bool");
  // Fortran order: columns first in the file.
  const auto f = parse(npy_bytes("{'descr': '|b1', 'fortran_order': True, 'shape': (2, 3), }", Bytes{1, 1, 0, 0, 1, 0}));
  EXPECT_EQ(f.data, (std::vector<double>{1, 0, 1, 1, 0, 0}));
  EXPECT_TRUE(throws_with([&] { parse(npy_bytes("{'descr': '|b1', 'fortran_order': False, 'shape': (2, 3), }", Bytes{1, 0, 1})); },
                          {"truncated", "of bool needs 6 data bytes, the file holds 3"}));
}

TEST(Npy, MalformedFilesGetClearErrors) {
  const std::string good = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
  const Bytes data = raw(std::vector<float>(6, 1.0f));
  auto bad = [](const Bytes& b, std::initializer_list<std::string> parts, const attn::io::Limits& lim = {}) {
    return throws_with([&] { parse(b, lim); }, parts);
  };
  Bytes b = npy_bytes(good, data);
  b[1] = 'X';
  EXPECT_TRUE(bad(b, {"x.npy", "bad magic"}));
  EXPECT_TRUE(bad(Bytes{0x93, 'N', 'U'}, {"bad magic"}));
  b = npy_bytes(good, data);
  b[6] = 9;
  EXPECT_TRUE(bad(b, {"unsupported .npy format version 9"}));
  b = npy_bytes(good, data);
  b[8] = 0xff, b[9] = 0xff;  // header length lies: 65535 bytes
  EXPECT_TRUE(bad(b, {"header length 65535 runs past the end"}));
  attn::io::Limits small;
  small.max_header_bytes = 32;
  EXPECT_TRUE(bad(npy_bytes(good, data), {"exceeds the limit"}, small));
  EXPECT_TRUE(bad(npy_bytes("{'descr': '<i4', 'fortran_order': False, 'shape': (2, 3), }", data),
                  {"unsupported dtype '<i4'"}));
  EXPECT_TRUE(bad(npy_bytes("{'descr': '|u1', 'fortran_order': False, 'shape': (6,), }", data), {"unsupported dtype '|u1'"}));
  EXPECT_TRUE(bad(npy_bytes("{'descr': '|b1', 'fortran_order': False, 'shape': (3,), }", Bytes{1, 0, 2}),
                  {"x.npy", "bool element 2 is the byte 2, expected 0 (False) or 1 (True)"}));
  EXPECT_TRUE(bad(npy_bytes("{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2,), }", data),
                  {"structured dtypes"}));
  EXPECT_TRUE(bad(npy_bytes("{'descr': '<f4', 'shape': (2, 3), }", data), {"lacks one of"}));
  EXPECT_TRUE(bad(npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (2, -3), }", data),
                  {"tuple of non-negative integers"}));
  EXPECT_TRUE(bad(npy_bytes("{'descr': '<f4', 'fortran_order': Maybe, 'shape': (2, 3), }", data),
                  {"True or False"}));
  EXPECT_TRUE(bad(npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), 'x': 1}", data),
                  {"unexpected key 'x'"}));
  EXPECT_TRUE(bad(npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3)", data), {"malformed"}));
  // Element count overflows 64 bits; must fail before allocating anything.
  EXPECT_TRUE(bad(npy_bytes("{'descr': '<f8', 'fortran_order': False, 'shape': (4294967296, 4294967296, 16), }", data),
                  {"more elements than any file could hold"}));
  EXPECT_TRUE(bad(npy_bytes("{'descr': '<f8', 'fortran_order': False, 'shape': (99999999999999999999,), }", data),
                  {"absurdly large"}));
  // A plausible shape that the data does not cover: truncated.
  EXPECT_TRUE(bad(npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (1000000, 1000), }", data),
                  {"truncated", "(1000000, 1000)", "needs 4000000000 data bytes, the file holds 24"}));
  Bytes trailing = npy_bytes(good, data);
  trailing.push_back(0);
  EXPECT_TRUE(bad(trailing, {"1 bytes beyond the data"}));
  EXPECT_TRUE(bad(npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (1,1,1,1,1,1,1,1,1), }", data),
                  {"more than 8 dimensions"}));
}

// Issue 11.6: an empty array may have huge other axes; the Fortran-order
// transpose computed C strides from them (signed overflow, caught by UBSan).
TEST(Npy, EmptyArraysWithHugeAxesInEitherOrder) {
  for (const char* order : {"True", "False"})
    for (const std::string shape : {"(0, 1099511627776, 1099511627776)", "(1099511627776, 1099511627776, 0)"}) {
      const auto a = parse(npy_bytes(std::string("{'descr': '<f4', 'fortran_order': ") + order + ", 'shape': " +
                                         shape + ", }",
                                     {}));
      EXPECT_TRUE(a.data.empty()) << order << " " << shape;
      ASSERT_EQ(a.shape.size(), 3u);
      EXPECT_EQ(a.numel(), 0) << shape;  // no overflow in the product either
    }
  // Non-empty Fortran order of rank 3 still transposes: element (i, j, k) at i + 2j + 6k in the file.
  std::vector<float> f(24);
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 3; ++j)
      for (int k = 0; k < 4; ++k) f[size_t(i + 2 * j + 6 * k)] = float(100 * i + 10 * j + k);
  const auto c = parse(npy_bytes("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3, 4), }", raw(f)));
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 3; ++j)
      for (int k = 0; k < 4; ++k) EXPECT_EQ(c.data[size_t(12 * i + 4 * j + k)], double(100 * i + 10 * j + k));
}

TEST(Npy, FileErrorsNameThePath) {
  TempDir dir;
  EXPECT_TRUE(throws_with([&] { attn::io::read_npy<float>(dir / "missing.npy"); }, {"missing.npy", "cannot open"}));
  EXPECT_TRUE(throws_with([&] { attn::io::read_npy<float>(dir.path.string()); }, {"not a regular file"}));
  attn::io::Limits lim;
  lim.max_file_bytes = 16;
  const std::vector<float> v(100, 1.f);
  attn::io::write_npy(dir / "big.npy", {100}, v.data());
  EXPECT_TRUE(throws_with([&] { attn::io::read_npy<float>(dir / "big.npy", lim); }, {"over the limit of 16"}));
  try {
    attn::io::read_npy<float>(dir / "missing.npy");
    FAIL() << "no throw";
  } catch (const attn::io::FileError&) {
  }
}

TEST(Safetensors, RoundTripAndForeignLayout) {
  TempDir dir;
  std::map<std::string, Array<double>> t;
  t["in_proj_weight"] = {{6, 2}, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, DType::f64};
  t["out_proj.bias"] = {{2}, {-1, 1}, DType::f64};
  t["scalar"] = {{}, {3.5}, DType::f64};
  attn::io::write_safetensors(dir / "w.safetensors", t);
  const auto back = attn::io::read_safetensors<double>(dir / "w.safetensors");
  ASSERT_EQ(back.size(), 3u);
  for (const auto& [k, a] : t) {
    EXPECT_EQ(back.at(k).shape, a.shape) << k;
    EXPECT_EQ(back.at(k).data, a.data) << k;
  }
  // A file laid out like the Python writer's: metadata, F32, offsets not in name order.
  const Bytes data = raw(std::vector<float>{1, 2, 3, 4, 5});
  const auto f = parse_st(st_bytes(R"({"__metadata__":{"format":"pt"},"b":{"dtype":"F32","shape":[3],"data_offsets":[8,20]},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", data));
  EXPECT_EQ(f.at("a").data, (std::vector<double>{1, 2}));
  EXPECT_EQ(f.at("b").data, (std::vector<double>{3, 4, 5}));
  EXPECT_EQ(f.at("b").stored, DType::f32);
  // Empty tensors take no bytes and may share an offset with a real one.
  const auto e = parse_st(st_bytes(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"e":{"dtype":"F64","shape":[0,3],"data_offsets":[0,0]}})", raw(std::vector<float>{1, 2})));
  EXPECT_EQ(e.at("e").shape, (std::vector<int64_t>{0, 3}));
  EXPECT_TRUE(e.at("e").data.empty());
}

// The "__metadata__" entry, written by hand-checked layout and read back.
TEST(Safetensors, MetadataRoundTripsAndHeaderLayout) {
  TempDir dir;
  std::map<std::string, Array<float>> t;
  t["a"] = {{2, 3}, {-1, -0.5f, 0, 0.5f, 1, 1.5f}, DType::f32};
  t["b.x"] = {{4}, {1, 0.5f, 0.25f, 0.125f}, DType::f32};
  const attn::io::Metadata meta = {{"format", "pt"},
                                   {"config", R"({"dim": 32, "name": "a\"b"})"},
                                   {"empty", ""},
                                   {"unicode", "\xc3\xbc\xe2\x86\x92\xe2\x88\x9e"}};
  const std::string p = dir / "m.safetensors";
  attn::io::write_safetensors(p, t, meta);
  // 8-byte little-endian length, the JSON header padded to 8 bytes, the data in name order
  const Bytes bytes = attn::io::read_file(p, 1 << 20);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[size_t(i)];
  EXPECT_EQ(n % 8, 0u);
  ASSERT_EQ(bytes.size(), 8 + n + 40);
  const auto j = nlohmann::json::parse(std::string(bytes.begin() + 8, bytes.begin() + 8 + long(n)));
  EXPECT_EQ(j["a"]["dtype"], "F32");
  EXPECT_EQ(j["a"]["shape"], nlohmann::json({2, 3}));
  EXPECT_EQ(j["a"]["data_offsets"], nlohmann::json({0, 24}));
  EXPECT_EQ(j["b.x"]["data_offsets"], nlohmann::json({24, 40}));
  EXPECT_EQ(j["__metadata__"], nlohmann::json(meta));
  float second;
  std::memcpy(&second, bytes.data() + 8 + n + 24 + 4, 4);
  EXPECT_EQ(second, 0.5f);  // b.x[1]
  // Read back; whatever the out-parameter held before is replaced.
  attn::io::Metadata back = {{"stale", "x"}};
  const auto r = attn::io::read_safetensors<float>(p, {}, &back);
  EXPECT_EQ(back, meta);
  EXPECT_EQ(r.at("a").data, t.at("a").data);
  EXPECT_EQ(r.at("b.x").data, t.at("b.x").data);
  EXPECT_EQ(r.at("b.x").shape, (std::vector<int64_t>{4}));
  // Without metadata the file has no "__metadata__" entry and the out-parameter comes back empty.
  const Bytes plain = attn::io::encode_safetensors(t);
  EXPECT_EQ(std::string(plain.begin(), plain.end()).find("__metadata__"), std::string::npos);
  attn::io::parse_safetensors<float>(plain.data(), plain.size(), "plain", {}, &back);
  EXPECT_TRUE(back.empty());
}

// The format allows only string values in "__metadata__"; anything else is
// refused whether or not the caller asks for the metadata.
TEST(Safetensors, MetadataMustBeAnObjectOfStrings) {
  const Bytes data = raw(std::vector<float>{1, 2});
  const std::string w = R"("w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  auto file = [&](const std::string& meta) { return st_bytes("{\"__metadata__\":" + meta + "," + w + "}", data); };
  attn::io::Metadata m;
  const Bytes good = file(R"({"k":"v"})");
  EXPECT_EQ(attn::io::parse_safetensors<double>(good.data(), good.size(), "w.safetensors", {}, &m).at("w").data,
            (std::vector<double>{1, 2}));
  EXPECT_EQ(m, (attn::io::Metadata{{"k", "v"}}));
  EXPECT_TRUE(throws_with([&] { parse_st(file(R"({"format":"pt","n":3})")); },
                          {"w.safetensors", "'__metadata__' entry 'n' is not a string (found number)"}));
  EXPECT_TRUE(throws_with([&] { parse_st(file(R"({"k":{"a":"b"}})")); }, {"w.safetensors", "entry 'k'", "found object"}));
  EXPECT_TRUE(throws_with([&] { parse_st(file(R"({"k":null})")); }, {"entry 'k'", "found null"}));
  EXPECT_TRUE(throws_with([&] { parse_st(file(R"(["k","v"])")); }, {"w.safetensors", "'__metadata__' is not a JSON object"}));
  EXPECT_TRUE(throws_with([&] { parse_st(file(R"("pt")")); }, {"'__metadata__' is not a JSON object"}));
  EXPECT_THROW(parse_st(file("3")), attn::io::FileError);
  // Writing: "__metadata__" is no tensor name, and text must be valid UTF-8.
  TempDir dir;
  std::map<std::string, Array<double>> t;
  t["__metadata__"] = {{1}, {1}, DType::f64};
  EXPECT_TRUE(throws_with([&] { attn::io::encode_safetensors(t); }, {"'__metadata__' is not a tensor name"}));
  const std::string p = dir / "x.safetensors";
  EXPECT_TRUE(throws_with([&] { attn::io::write_safetensors(p, t); }, {p, "'__metadata__' is not a tensor name"}));
  EXPECT_FALSE(fs::exists(p));
  t.clear();
  t["w"] = {{1}, {1}, DType::f64};
  EXPECT_TRUE(throws_with([&] { attn::io::write_safetensors(p, t, {{"k", "\xff"}}); }, {p, "not valid UTF-8"}));
  EXPECT_FALSE(fs::exists(p));
}

TEST(Safetensors, MalformedFilesGetClearErrors) {
  const Bytes data = raw(std::vector<float>{1, 2, 3, 4});
  auto bad = [](const Bytes& b, std::initializer_list<std::string> parts, const attn::io::Limits& lim = {}) {
    return throws_with([&] { parse_st(b, lim); }, parts);
  };
  const std::string ok = R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})";
  EXPECT_NO_THROW(parse_st(st_bytes(ok, data)));
  EXPECT_TRUE(bad(Bytes{1, 2, 3}, {"w.safetensors", "shorter than its 8-byte header length"}));
  EXPECT_TRUE(bad(st_bytes(ok, data, uint64_t(1) << 62), {"exceeds the limit"}));
  EXPECT_TRUE(bad(st_bytes(ok, data, ok.size() + 100), {"runs past the end of the file"}));
  EXPECT_TRUE(bad(st_bytes("[1, 2]", data), {"not a JSON object"}));
  EXPECT_TRUE(bad(st_bytes("{\"w\": {\"dtype\": ", data), {"does not parse"}));
  EXPECT_TRUE(bad(st_bytes("{\"a\":" + std::string(40, '[') + std::string(40, ']') + "}", data),
                  {"nested too deeply"}));
  EXPECT_TRUE(bad(st_bytes(R"({"w":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]}})", data),
                  {"tensor 'w'", "unsupported dtype 'BF16'"}));
  EXPECT_TRUE(bad(st_bytes(R"({"w":{"dtype":"F32","shape":[2,2]}})", data), {"lacks one of"}));
  EXPECT_TRUE(bad(st_bytes(R"({"w":{"dtype":"F32","shape":[2,-2],"data_offsets":[0,16]}})", data),
                  {"non-negative integer"}));
  EXPECT_TRUE(bad(st_bytes(R"({"w":{"dtype":"F32","shape":"2x2","data_offsets":[0,16]}})", data), {"not an array"}));
  EXPECT_TRUE(bad(st_bytes(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,1600]}})", data),
                  {"data_offsets [0, 1600] outside the 16-byte data buffer"}));
  EXPECT_TRUE(bad(st_bytes(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[16,0]}})", data), {"outside"}));
  EXPECT_TRUE(bad(st_bytes(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,12]}})", data),
                  {"spans 12 bytes", "needs 16"}));
  EXPECT_TRUE(bad(st_bytes(R"({"w":{"dtype":"F64","shape":[4294967296,4294967296,16],"data_offsets":[0,16]}})", data),
                  {"more elements than any file could hold"}));
  EXPECT_TRUE(bad(st_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", data),
                  {"overlap"}));
  attn::io::Limits lim;
  lim.max_tensors = 1;
  EXPECT_TRUE(bad(st_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", data),
                  {"more than 1 tensors"}, lim));
}

// Issue 11.12: as strict as the format. The header may be padded with
// spaces (the writers do it), not NULs; the tensors must tile the data buffer.
TEST(Safetensors, HeaderPaddingHolesAndTrailingBytes) {
  const Bytes data = raw(std::vector<float>{1, 2, 3, 4});
  const std::string two = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})";
  EXPECT_EQ(parse_st(st_bytes(two + "      ", data)).at("b").data, (std::vector<double>{3, 4}));
  EXPECT_TRUE(throws_with([&] { parse_st(st_bytes(two + std::string(6, '\0'), data)); },
                          {"w.safetensors", "NUL byte at offset " + std::to_string(two.size()), "spaces"}));
  Bytes trailing = st_bytes(two, data);
  trailing.insert(trailing.end(), {0, 0, 0, 0});
  EXPECT_TRUE(throws_with([&] { parse_st(trailing); }, {"w.safetensors", "4 trailing bytes after the last tensor"}));
  const std::string hole = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})";
  EXPECT_TRUE(throws_with([&] { parse_st(st_bytes(hole, data)); },
                          {"bytes [4, 8) of the data buffer belong to no tensor", "'b'"}));
  const std::string late = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})";
  EXPECT_TRUE(throws_with([&] { parse_st(st_bytes(late, data)); }, {"bytes [0, 8)", "no tensor"}));
  // An empty tensor inside another's range overlaps it; at a boundary it is fine.
  const std::string inside = R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})";
  EXPECT_TRUE(throws_with([&] { parse_st(st_bytes(inside, data)); }, {"'a' and 'e' overlap"}));
  const std::string edge = R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"e":{"dtype":"F32","shape":[0],"data_offsets":[16,16]}})";
  EXPECT_TRUE(parse_st(st_bytes(edge, data)).at("e").data.empty());
  // No tensors at all: only an empty buffer is valid.
  EXPECT_TRUE(parse_st(st_bytes("{}", {})).empty());
  EXPECT_TRUE(throws_with([&] { parse_st(st_bytes("{}", data)); }, {"16 trailing bytes"}));
}

TEST(AtomicWrite, ReplacesOnlyWithCompleteFilesAndLeavesNoTemporaries) {
  TempDir dir;
  const std::string p = dir / "out.npy";
  const std::vector<double> a = {1, 2, 3}, b = {4, 5, 6, 7};
  attn::io::write_npy(p, {3}, a.data());
  attn::io::write_npy(p, {4}, b.data());
  EXPECT_EQ(attn::io::read_npy<double>(p).data, b);
  EXPECT_TRUE(throws_with([&] { attn::io::write_npy(dir / "no/such/dir/x.npy", {3}, a.data()); },
                          {"no/such/dir/x.npy", "cannot create a file in directory", "No such file or directory"}));
  int files = 0;
  for (const auto& e : fs::directory_iterator(dir.path)) {
    ++files;
    EXPECT_EQ(e.path().filename().string(), "out.npy");
  }
  EXPECT_EQ(files, 1);
}

// Files in `dir` whose name marks them as temporaries of the writers.
std::vector<std::string> temporaries(const fs::path& dir) {
  std::vector<std::string> t;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string().find(".attn-tmp.") != std::string::npos) t.push_back(e.path().filename());
  return t;
}

// Issue 11.9: nothing is renamed until commit(); an error (the transaction's
// destructor) leaves every destination as it was and no temporary.
TEST(OutputTransaction, CommitsAllOrNothing) {
  TempDir dir;
  const std::vector<double> a = {1, 2, 3}, b = {4, 5};
  attn::io::write_npy(dir / "y.npy", {3}, a.data());
  try {
    attn::io::detail::OutputTransaction tx;
    const std::string y = tx.add(dir / "y.npy", "--out"), w = tx.add(dir / "w.npy", "--weights");
    EXPECT_NE(y, dir / "y.npy");
    EXPECT_NE(y.find("y.npy.attn-tmp."), std::string::npos) << y;
    attn::io::write_npy(y, {2}, b.data());
    EXPECT_EQ(attn::io::read_npy<double>(dir / "y.npy").data, a);  // not yet
    throw std::runtime_error("the second output failed");
  } catch (const std::runtime_error&) {
  }
  EXPECT_EQ(attn::io::read_npy<double>(dir / "y.npy").data, a);
  EXPECT_FALSE(fs::exists(dir / "w.npy"));
  EXPECT_TRUE(temporaries(dir.path).empty());
  {
    attn::io::detail::OutputTransaction tx;
    const std::string y = tx.add(dir / "y.npy", "--out"), w = tx.add(dir / "w.npy", "--weights");
    attn::io::write_npy(y, {2}, b.data());
    EXPECT_TRUE(throws_with([&] { tx.commit(); }, {"--weights", "w.npy", "was never written"}));
    attn::io::write_npy(w, {3}, a.data());
    tx.commit();
  }
  EXPECT_EQ(attn::io::read_npy<double>(dir / "y.npy").data, b);
  EXPECT_EQ(attn::io::read_npy<double>(dir / "w.npy").data, a);
  EXPECT_TRUE(temporaries(dir.path).empty());
  // Checked when added: a missing directory, a directory, the same file twice.
  attn::io::detail::OutputTransaction tx;
  EXPECT_TRUE(throws_with([&] { tx.add(dir / "no/x.npy", "--out"); }, {"--out", "cannot create a file in directory"}));
  EXPECT_TRUE(throws_with([&] { tx.add(dir.path.string(), "--out"); }, {"is a directory"}));
  tx.add(dir / "y.npy", "--out");
  EXPECT_TRUE(throws_with([&] { tx.check(dir.path.string() + "/./y.npy", "--save"); },
                          {"--out and --save both name the file"}));
}

// Issue 11.10: a new file gets 0666 minus the umask, a replaced one keeps its mode.
TEST(AtomicWrite, ModesFollowTheUmaskAndSurviveReplacement) {
  TempDir dir;
  const std::vector<float> v = {1};
  auto mode = [&](const std::string& f) { return fs::status(dir / f).permissions() & fs::perms::mask; };
  const mode_t old = ::umask(027);
  attn::io::write_npy(dir / "a.npy", {1}, v.data());
  ::umask(old);
  EXPECT_EQ(mode("a.npy"), fs::perms(0640));
  fs::permissions(dir / "a.npy", fs::perms(0600));
  attn::io::write_npy(dir / "a.npy", {1}, v.data());
  EXPECT_EQ(mode("a.npy"), fs::perms(0600));
  attn::io::detail::OutputTransaction tx;
  attn::io::write_npy(tx.add(dir / "a.npy", "--out"), {1}, v.data());
  tx.commit();
  EXPECT_EQ(mode("a.npy"), fs::perms(0600));
}

// Issue 11.8: SIGTERM (with the CLI's handler) removes a temporary being
// written; kill -9 leaves the old file intact and one recognisable temporary.
TEST(AtomicWrite, SignalsRemoveTemporariesAndKill9LeavesTheOldFile) {
  for (const int sig : {SIGTERM, SIGINT, SIGKILL}) {
    TempDir dir;
    const std::vector<double> a = {1, 2, 3}, b = {4, 5};
    attn::io::write_npy(dir / "y.npy", {3}, a.data());
    int ready[2];
    ASSERT_EQ(::pipe(ready), 0);
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      attn::io::detail::remove_temporaries_on_signal();
      attn::io::detail::OutputTransaction tx;
      attn::io::write_npy(tx.add(dir / "y.npy", "--out"), {2}, b.data());  // written, not committed
      (void)!::write(ready[1], "x", 1);
      ::pause();
      ::_exit(0);
    }
    char c;
    ASSERT_EQ(::read(ready[0], &c, 1), 1);
    ::close(ready[0]);
    ::close(ready[1]);
    ::kill(pid, sig);
    int st = 0;
    ASSERT_EQ(::waitpid(pid, &st, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(st));
    EXPECT_EQ(WTERMSIG(st), sig);
    EXPECT_EQ(attn::io::read_npy<double>(dir / "y.npy").data, a) << "signal " << sig;
    const auto left = temporaries(dir.path);
    if (sig == SIGKILL) {
      ASSERT_EQ(left.size(), 1u);
      EXPECT_EQ(left[0].rfind("y.npy.attn-tmp.", 0), 0u) << left[0];
    } else {
      EXPECT_TRUE(left.empty()) << "signal " << sig << " left " << left[0];
    }
  }
}

// Random byte flips, truncations and insertions of valid files must either
// parse or throw attn::io::FileError: no crash, no other exception (run under
// ASan this is a small deterministic fuzzer).
TEST(Parsers, SurviveMutatedInputs) {
  std::mt19937_64 rng(12345);
  const std::vector<float> v = {1, 2, 3, 4, 5, 6};
  const Bytes npy = attn::io::encode_npy<float>({2, 3}, v.data());
  std::map<std::string, Array<float>> t;
  t["a"] = {{2, 3}, v, DType::f32};
  t["b"] = {{3}, {7, 8, 9}, DType::f32};
  const Bytes st = attn::io::encode_safetensors(t, {{"format", "pt"}, {"step", "12"}});
  attn::io::Metadata meta;
  int parsed = 0, rejected = 0;
  for (int it = 0; it < 3000; ++it) {
    Bytes b = (it % 2) ? npy : st;
    const int edits = 1 + int(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      const size_t pos = b.empty() ? 0 : rng() % b.size();
      switch (rng() % 4) {
        case 0: if (!b.empty()) b[pos] = static_cast<unsigned char>(rng()); break;
        case 1: b.resize(pos); break;
        case 2: b.insert(b.begin() + long(pos), static_cast<unsigned char>(rng())); break;
        default: if (!b.empty()) b[pos] = static_cast<unsigned char>("0123456789[]{},:\"'()"[rng() % 20]); break;
      }
    }
    try {
      if (it % 2) attn::io::parse_npy<float>(b.data(), b.size(), "m");
      else attn::io::parse_safetensors<float>(b.data(), b.size(), "m", {}, &meta);
      ++parsed;
    } catch (const attn::io::FileError&) {
      ++rejected;
    }
  }
  EXPECT_GT(rejected, 1000);
  EXPECT_GT(parsed, 10);  // some mutations only change data bytes
}

// Every entry of the fuzzers' seed corpus, through the fuzzers' own check
// (fuzz/checks.hpp): inputs that once crashed a parser stay here as
// regression tests, run under the sanitizers by `make test-sanitize`.
TEST(Parsers, ReplayTheFuzzCorpus) {
  const fs::path corpus = ATTN_FUZZ_CORPUS;
  for (const char* target : {"npy", "safetensors"}) {
    int files = 0, parsed = 0;
    for (const auto& e : fs::directory_iterator(corpus / target)) {
      const Bytes b = attn::io::read_file(e.path().string(), 1 << 20);
      const bool ok = std::string(target) == "npy" ? attn::fuzz::check_npy(b.data(), b.size())
                                                   : attn::fuzz::check_safetensors(b.data(), b.size());
      ++files;
      parsed += ok;
    }
    EXPECT_GE(files, 2) << target;
    EXPECT_GE(parsed, 1) << target;  // the seeds include valid files
  }
}

}  // namespace
