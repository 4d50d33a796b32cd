#include "common.hpp"

#include <unistd.h>

#include <charconv>
#include <cmath>
#include <cstdlib>

#include <fmt/format.h>

namespace attn::cli {

namespace {
// The transaction refuses two outputs on one file with attn::InvalidArgument;
// on the command line that is a usage error. File errors stay file errors.
template <class F>
auto duplicates_are_usage_errors(F&& f) {
  try {
    return f();
  } catch (const InvalidArgument& e) {
    throw UsageError(e.what());
  }
}
}  // namespace

std::string Outputs::add(const std::string& flag, const std::string& path) {
  if (path.empty()) return "";
  return duplicates_are_usage_errors([&] { return tx_.add(path, flag); });
}

void Outputs::check(const std::string& flag, const std::string& path) {
  if (!path.empty()) duplicates_are_usage_errors([&] { tx_.check(path, flag); });
}

namespace {
CLI::Validator finite_number(bool zero_allowed) {
  return CLI::Validator(
      [zero_allowed](std::string& s) -> std::string {
        char* end = nullptr;
        const double x = std::strtod(s.c_str(), &end);
        if (s.empty() || end != s.c_str() + s.size() || !std::isfinite(x) || !(zero_allowed ? x >= 0 : x > 0))
          return std::string("expected a finite number ") + (zero_allowed ? ">= 0" : "> 0") + ", got '" + s + "'";
        return "";
      },
      zero_allowed ? "NONNEGATIVE" : "POSITIVE");
}
}  // namespace

CLI::Validator positive_number() { return finite_number(false); }
CLI::Validator non_negative_number() { return finite_number(true); }

CLI::Validator probability_below_one() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        char* end = nullptr;
        const double x = std::strtod(s.c_str(), &end);
        if (s.empty() || end != s.c_str() + s.size() || !(x >= 0 && x < 1))
          return "expected a probability 0 <= P < 1, got '" + s + "'";
        return "";
      },
      "P");
}

CLI::Validator integer_value(std::optional<int64_t> min) {
  return CLI::Validator(
      [min](std::string& s) -> std::string {
        int64_t x = 0;
        const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), x);
        if (s.empty() || ec != std::errc() || end != s.data() + s.size() || (min && x < *min))
          return (min ? "expected an integer from " + std::to_string(*min) + " to 2^63 - 1"
                      : std::string("expected an integer from -2^63 to 2^63 - 1")) +
                 ", got '" + s + "'";
        return "";
      },
      "INT");
}

CLI::Option* add_number_list(CLI::App* app, const std::string& name, std::vector<double>& out, const std::string& help) {
  return app->add_option_function<std::string>(
      name,
      [&out, name](const std::string& s) {
        out.clear();
        for (size_t start = 0;;) {
          const size_t comma = s.find(',', start);
          const std::string item = s.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
          char* end = nullptr;
          const double x = std::strtod(item.c_str(), &end);
          if (item.empty() || end != item.c_str() + item.size())
            throw CLI::ValidationError(name, "expected comma-separated numbers, got '" + item + "'");
          out.push_back(x);
          if (comma == std::string::npos) break;
          start = comma + 1;
        }
      },
      help);
}

void require_float(const io::Array<double>& a, const std::string& flag, const std::string& path) {
  if (a.stored == io::DType::b1)
    throw InvalidArgument(fmt::format("{} {} holds bool values; expected float32 or float64", flag, path));
}

std::vector<double> per_head_values(const std::vector<double>& v, int64_t H, const std::string& cmd, const char* flag) {
  if (v.size() != 1 && int64_t(v.size()) != H)
    throw InvalidArgument(fmt::format("{}: {} has {} values; expected 1 (every head) or H = {}", cmd, flag, v.size(), H));
  std::vector<double> out(static_cast<size_t>(H));
  for (int64_t h = 0; h < H; ++h) out[size_t(h)] = v[v.size() == 1 ? 0 : size_t(h)];
  return out;
}

void print_mat(const std::string& title, const Mat& m, const std::vector<std::string>& labels, int decimals) {
  fmt::print("{}  ({} x {})\n", title, m.rows, m.cols);
  size_t lw = 0;
  for (const auto& l : labels) lw = std::max(lw, l.size());
  for (int64_t i = 0; i < m.rows; ++i) {
    fmt::print("  {:<{}}", i < int64_t(labels.size()) ? labels[size_t(i)] : "", lw);
    for (int64_t j = 0; j < m.cols; ++j) {
      const double p = std::pow(10.0, decimals), r = std::round(m(i, j) * p) / p;
      fmt::print(" {:>{}.{}f}", r == 0 ? 0.0 : r, decimals + 5, decimals);  // no "-0.000"
    }
    fmt::print("\n");
  }
}

bool stdout_is_tty() { return ::isatty(STDOUT_FILENO) == 1; }

Progress::Progress(std::string label, int64_t total) : label_(std::move(label)), total_(total), tty_(stdout_is_tty()) {
  if (!tty_) fmt::print("  {} ...\n", label_);
  std::fflush(stdout);
  tick(0);
}

void Progress::tick(int64_t done) {
  if (!tty_) return;
  const int pct = total_ > 0 ? int(100 * done / total_) : 100;
  if (pct == last_) return;
  last_ = pct;
  const int width = 30, filled = width * pct / 100;
  fmt::print("\r  [{}{}] {:3d}% {}", std::string(size_t(filled), '#'), std::string(size_t(width - filled), '.'), pct, label_);
  std::fflush(stdout);
}

void Progress::finish(const std::string& result) {
  if (tty_) fmt::print("\r\033[K");
  fmt::print("  {}: done{}{}\n", label_, result.empty() ? "" : " - ", result);
  std::fflush(stdout);
}

}  // namespace attn::cli
