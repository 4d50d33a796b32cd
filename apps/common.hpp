// Shared pieces of the attn command-line tool: exit codes, a small dense
// matrix for the step-by-step printouts, tensor <-> file helpers, progress.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "attn/attn.hpp"
#include "attn/detail/output.hpp"
#include "attn/io.hpp"
#include "lesson.hpp"

namespace attn::cli {

// Exit codes (documented in `attn --help` and docs/cli.md).
enum Exit : int {
  kOk = 0,
  kBadInput = 1,     // inputs attn rejects: mismatched shapes, bad values, sizes over the machine's memory
  kUsage = 2,        // command-line usage error
  kFileError = 3,    // unreadable, malformed or unwritable file
  kUnavailable = 4,  // the requested feature is not built (e.g. attn-bench)
  kInternal = 5,     // unexpected internal error (a bug)
  kOutOfMemory = 6,  // an allocation failed (std::bad_alloc): a resource error, not a bug
  kDiverged = 7,     // training stopped: the loss became NaN or infinite
};
inline constexpr const char* kExitCodesHelp =
    "Exit codes: 0 success; 1 invalid input (shapes, values, sizes); 2 usage error; 3 file error (missing, "
    "malformed, unwritable); 4 feature not available; 5 internal error; 6 out of memory; 7 training diverged "
    "(non-finite loss); 8 --context-parallel: a rank waited past ATTN_DIST_TIMEOUT for another.";

// A usage problem detected after parsing (exit code 2).
class UsageError : public Error {
 public:
  explicit UsageError(const std::string& what) : Error(what) {}
};

// A feature that is not built into this tree (exit code 4).
class Unavailable : public Error {
 public:
  explicit Unavailable(const std::string& what) : Error(what) {}
};

// The output files of one command, written as one transaction
// (io::detail::OutputTransaction): each path is checked when added, before
// anything is computed; outputs are written to the names add() returns and
// renamed into place together by commit(). An error or a signal before
// commit() leaves every destination as it was and no temporary behind.
// Two outputs naming one file are a usage error.
class Outputs {
 public:
  // Where to write the output `flag` (e.g. "--out") whose destination is
  // `path`; "" when `path` is empty (the output was not asked for).
  std::string add(const std::string& flag, const std::string& path);
  // Checks `path` (and its distinctness) for a file written by someone else.
  void check(const std::string& flag, const std::string& path);
  void commit() { tx_.commit(); }

 private:
  io::detail::OutputTransaction tx_;
};

// CLI11 checks whose messages name the value given ("expected a finite
// number > 0, got 'abc'"): a finite number > 0, or >= 0, or a probability
// 0 <= p < 1; an integer (>= min when given) that fits int64 (a longer one is
// refused, not clamped). Values out of a rule's range are left to the library
// (exit 1).
CLI::Validator positive_number();
CLI::Validator non_negative_number();
CLI::Validator probability_below_one();
CLI::Validator integer_value(std::optional<int64_t> min = std::nullopt);
// An option taking comma-separated numbers into `out`; an empty or malformed
// element is a usage error naming it (never dropped).
CLI::Option* add_number_list(CLI::App* app, const std::string& name, std::vector<double>& out, const std::string& help);

// A per-head list from the command line: H values, or one for every head;
// otherwise an InvalidArgument naming `cmd` and `flag`.
std::vector<double> per_head_values(const std::vector<double>& v, int64_t H, const std::string& cmd, const char* flag);

// Refuses a bool .npy where numbers are expected (masks may be bool).
void require_float(const io::Array<double>& a, const std::string& flag, const std::string& path);

// The explainers' matrices and their operations (apps/lesson).
using lesson::Mat;
using lesson::matmul;
using lesson::transpose;
using lesson::columns;
using lesson::attention;

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
