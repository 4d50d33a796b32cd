// Shared pieces of the attn command-line tool: exit codes, a small dense
// matrix for the step-by-step printouts, tensor <-> file helpers, progress.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "attn/attn.hpp"
#include "attn/io.hpp"

namespace attn::cli {

// Exit codes (documented in `attn --help`).
enum Exit : int {
  kOk = 0,
  kBadInput = 1,     // inputs attn rejects: mismatched shapes, bad values
  kUsage = 2,        // command-line usage error
  kFileError = 3,    // unreadable, malformed or unwritable file
  kUnavailable = 4,  // the requested feature is not built (e.g. attn-bench)
  kInternal = 5,     // unexpected internal error (a bug)
};
inline constexpr const char* kExitCodesHelp =
    "Exit codes: 0 success; 1 invalid input (shapes, values); 2 usage error; 3 file error (missing, "
    "malformed, unwritable); 4 feature not available; 5 internal error.";

// A usage problem detected after parsing (exit code 2).
class UsageError : public Error {
 public:
  using Error::Error;
};

// A feature that is not built into this tree (exit code 4).
class Unavailable : public Error {
 public:
  using Error::Error;
};

// Row-major dense matrix of doubles (for the explain steps and experiments).
struct Mat {
  int64_t rows = 0, cols = 0;
  std::vector<double> a;
  Mat() = default;
  Mat(int64_t r, int64_t c, double fill = 0) : rows(r), cols(c), a(size_t(r * c), fill) {}
  Mat(int64_t r, int64_t c, std::vector<double> v) : rows(r), cols(c), a(std::move(v)) {}
  double& operator()(int64_t i, int64_t j) { return a[size_t(i * cols + j)]; }
  double operator()(int64_t i, int64_t j) const { return a[size_t(i * cols + j)]; }
};
Mat matmul(const Mat& x, const Mat& y);   // x · y
Mat transpose(const Mat& x);
Mat columns(const Mat& x, int64_t c0, int64_t c1);  // columns [c0, c1)
// softmax(q kᵀ · scale) v through attn::scaled_dot_product_attention (double,
// reference backend); optional mask (L x S, true = may attend).
void attention(const Mat& q, const Mat& k, const Mat& v, double scale, Mat& out, Mat* weights,
               const std::vector<bool>* mask = nullptr, bool causal = false);

// Prints "title  shape" then the matrix with row labels.
void print_mat(const std::string& title, const Mat& m, const std::vector<std::string>& row_labels = {},
               int decimals = 3);

// Progress for long steps: a bar redrawn in place on a terminal, otherwise one
// plain line at the start and one at the end.
class Progress {
 public:
  Progress(std::string label, int64_t total);
  void tick(int64_t done);
  void finish(const std::string& result = "");

 private:
  std::string label_;
  int64_t total_;
  bool tty_;
  int last_ = -1;
};
bool stdout_is_tty();

}  // namespace attn::cli
