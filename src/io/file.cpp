// Whole-file reads with a size cap, and atomic writes (temporary file in the
// destination directory, fsync, rename).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "attn/io.hpp"
#include "io/io_detail.hpp"

namespace attn::io {

const char* dtype_name(DType d) { return d == DType::f32 ? "float32" : "float64"; }

std::vector<unsigned char> read_file(const std::string& path, uint64_t max_bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) detail::fail_errno(path, "cannot open for reading");
  struct FdCloser {
    int fd;
    ~FdCloser() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) detail::fail_errno(path, "cannot stat");
  if (!S_ISREG(st.st_mode)) detail::fail(path, "not a regular file");
  const uint64_t size = uint64_t(st.st_size);
  if (size > max_bytes)
    detail::fail(path, "file is " + std::to_string(size) + " bytes, over the limit of " + std::to_string(max_bytes));
  std::vector<unsigned char> bytes(size);
  size_t got = 0;
  while (got < size) {
    const ssize_t r = ::read(fd, bytes.data() + got, size - got);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) detail::fail_errno(path, "read failed");
    if (r == 0) break;
    got += size_t(r);
  }
  if (got != size) detail::fail(path, "file shrank while being read");
  return bytes;
}

void write_file_atomic(const std::string& path, const void* bytes, size_t size) {
  namespace fs = std::filesystem;
  const fs::path dest(path);
  if (dest.filename().empty()) detail::fail(path, "output path names a directory, not a file");
  std::string tmpl = (dest.parent_path().empty() ? fs::path(".") : dest.parent_path()).string() + "/." +
                     dest.filename().string() + ".tmp.XXXXXX";
  std::vector<char> name(tmpl.begin(), tmpl.end());
  name.push_back('\0');
  const int fd = ::mkstemp(name.data());
  if (fd < 0) detail::fail_errno(path, "cannot create a temporary file next to it");
  const std::string tmp(name.data());
  auto abandon = [&](const std::string& what) {
    const int err = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    detail::fail(path, what + ": " + std::strerror(err), err);
  };
  const auto* p = static_cast<const unsigned char*>(bytes);
  size_t done = 0;
  while (done < size) {
    const ssize_t w = ::write(fd, p + done, size - done);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) abandon("write failed");
    done += size_t(w);
  }
  (void)::fchmod(fd, 0644);  // mkstemp creates 0600; outputs are ordinary files
  if (::fsync(fd) != 0) abandon("fsync failed");
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    detail::fail(path, std::string("close failed: ") + std::strerror(err), err);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    detail::fail(path, std::string("cannot rename the temporary file into place: ") + std::strerror(err), err);
  }
}

}  // namespace attn::io
