// attn/error.hpp — the exceptions the library throws.
//
//   attn::Error                 base of both; never thrown by itself
//   ├── attn::InvalidArgument   an argument is invalid (shape, value, option)
//   └── attn::FileError         a file could not be read or written, or its
//                               contents are malformed
//
// Messages name the function, the argument (or the file), what it got and
// what was expected, e.g.
//   "attn::scaled_dot_product_attention: argument 'k' has shape (1, 3, 5, 8),
//    expected (1, Hkv, S, 8) with Hkv dividing H = 4"
//   "data/q.npy: cannot open for reading: No such file or directory"
// The Python bindings raise ValueError for InvalidArgument and OSError for
// FileError (FileNotFoundError when the file does not exist); the CLI exits
// with code 1 and 3 respectively (docs/cli.md).
#pragma once

#include <cerrno>
#include <stdexcept>
#include <string>

namespace attn {

class Error : public std::runtime_error {
 protected:
  using std::runtime_error::runtime_error;
};

class InvalidArgument : public Error {
 public:
  explicit InvalidArgument(const std::string& what) : Error(what) {}
};

class FileError : public Error {
 public:
  // The message is "<path>: <problem>". `error_code` is the errno of the
  // failed system call, or 0 when the file was read but is malformed.
  FileError(const std::string& path, const std::string& problem, int error_code = 0)
      : Error(path + ": " + problem), path_(path), code_(error_code) {}

  const std::string& path() const { return path_; }
  int error_code() const { return code_; }
  bool not_found() const { return code_ == ENOENT; }

 private:
  std::string path_;
  int code_ = 0;
};

}  // namespace attn
