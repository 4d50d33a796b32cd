// The fixture of the attn command-line tests (tests/cli/*.cpp, one binary
// test_cli): each test runs the attn binary in a fresh temporary directory and
// reads what it wrote there.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "attn/io.hpp"

namespace attn_cli_test {

namespace fs = std::filesystem;

#ifdef ATTN_CLI_PATH
inline const char* const kCli = ATTN_CLI_PATH;
#else
inline const char* const kCli = nullptr;
#endif

struct Result {
  int rc = -1;
  std::string out, err;
};

inline std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

inline bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Width and height from a PNG's IHDR chunk (0, 0 when it is not a PNG).
inline std::pair<uint32_t, uint32_t> png_size(const std::string& png) {
  if (png.size() < 24 || png.substr(1, 3) != "PNG" || png.substr(12, 4) != "IHDR") return {0, 0};
  auto be32 = [&](size_t o) {
    return uint32_t(uint8_t(png[o])) << 24 | uint32_t(uint8_t(png[o + 1])) << 16 | uint32_t(uint8_t(png[o + 2])) << 8 |
           uint32_t(uint8_t(png[o + 3]));
  };
  return {be32(16), be32(20)};
}

class Cli : public ::testing::Test {
 public:
  void SetUp() override {
    if (!kCli) GTEST_SKIP() << "the attn binary is not built (ATTN_BUILD_APPS=OFF)";
    dir_ = fs::temp_directory_path() /
           ("attn_test_cli_" + std::to_string(::getpid()) + "_" + std::to_string(std::random_device{}()));
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    if (!dir_.empty()) fs::remove_all(dir_, ec);
  }
  std::string path(const std::string& f) const { return (dir_ / f).string(); }

  // Runs `attn <args>` in the temporary directory; stdout and stderr go to
  // out.txt and err.txt there. `env` is put before the command (`env` syntax:
  // NAME=value, -u NAME).
  Result run(const std::string& args, const std::string& env = "") const {
    const std::string cmd = "cd '" + dir_.string() + "' && env " + env + " '" + kCli + "' " + args +
                            " > out.txt 2> err.txt";
    const int st = std::system(cmd.c_str());
    Result r;
    r.rc = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    r.out = slurp(dir_ / "out.txt");
    r.err = slurp(dir_ / "err.txt");
    return r;
  }

  // Writes normal random numbers of this shape as f, returns them.
  template <class T>
  std::vector<T> write_random(const std::string& f, std::vector<int64_t> shape, std::mt19937_64& rng) {
    int64_t n = 1;
    for (auto s : shape) n *= s;
    std::normal_distribution<double> nd;
    std::vector<T> v(static_cast<size_t>(n));
    for (auto& x : v) x = T(nd(rng));
    attn::io::write_npy(path(f), shape, v.data());
    return v;
  }

  // q.npy (H, L, E), k.npy (H, S, E), v.npy (H, S, Ev) of random T, and their values.
  template <class T>
  struct Qkv {
    std::vector<T> q, k, v;
  };
  template <class T>
  Qkv<T> write_qkv(int64_t H, int64_t L, int64_t S, int64_t E, int64_t Ev, std::mt19937_64& rng) {
    Qkv<T> r;
    r.q = write_random<T>("q.npy", {H, L, E}, rng);
    r.k = write_random<T>("k.npy", {H, S, E}, rng);
    r.v = write_random<T>("v.npy", {H, S, Ev}, rng);
    return r;
  }

  void put(const std::string& f, const std::string& bytes) const {
    std::ofstream(path(f), std::ios::binary) << bytes;
  }

  fs::path dir_;
};

}  // namespace attn_cli_test
