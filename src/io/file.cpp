// Whole-file reads with a size cap, and the one way outputs are written
// (attn/detail/output.hpp): a temporary file next to the destination, fsync,
// rename; temporaries registered so that errors and termination signals
// remove them; OutputTransaction for the outputs of one command.
#include <fcntl.h>
#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "attn/detail/output.hpp"
#include "attn/io.hpp"
#include "io/io_detail.hpp"

namespace attn::io {

const char* dtype_name(DType d) {
  switch (d) {
    case DType::f32: return "float32";
    case DType::f64: return "float64";
    case DType::b1: return "bool";
    case DType::f16: return "float16";
  }
  return "?";
}

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

namespace {

namespace fs = std::filesystem;

// ---- temporaries a signal must remove ------------------------------------------
// A fixed table the signal handler can walk without locks or allocation: a
// slot's path is valid while its state is kReady. More temporaries at once
// than slots is allowed; the extra ones are then only removed on errors.
constexpr int kSlots = 256;
constexpr size_t kMaxPath = 4096;
enum : int { kFree = 0, kFilling = 1, kReady = 2 };
struct Slot {
  std::atomic<int> state{kFree};
  char path[kMaxPath];
};
static_assert(std::atomic<int>::is_always_lock_free, "the signal handler needs lock-free atomics");
Slot g_slots[kSlots];

int register_temporary(const std::string& p) {
  if (p.size() >= kMaxPath) return -1;
  for (int i = 0; i < kSlots; ++i) {
    int expected = kFree;
    if (g_slots[i].state.compare_exchange_strong(expected, kFilling)) {
      std::memcpy(g_slots[i].path, p.c_str(), p.size() + 1);
      g_slots[i].state.store(kReady);
      return i;
    }
  }
  return -1;
}

void unregister_temporary(int slot) {
  if (slot >= 0) g_slots[slot].state.store(kFree);
}

// A signal runs its handler on any one thread while the others go on, so
// a thread may be creating a temporary while the handler scans. Creation
// happens inside a Creating section (with the handled signals blocked on
// that thread, so the handler never interrupts its own section): the
// handler first sets g_dying, then waits until no section is open, then
// removes what is registered; a section that starts after g_dying stops
// there and waits for the process to end. Sequentially consistent atomics:
// either the handler sees the section open and waits, or the section sees
// g_dying and creates nothing.
std::atomic<int> g_dying{0}, g_creating{0};
static_assert(std::atomic<int>::is_always_lock_free, "the signal handler needs lock-free atomics");

struct Creating {
  sigset_t old{};
  Creating() {
    sigset_t set;
    sigemptyset(&set);
    for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&set, sig);
    pthread_sigmask(SIG_BLOCK, &set, &old);
    g_creating.fetch_add(1);
    if (g_dying.load()) {
      g_creating.fetch_sub(1);
      for (;;) ::pause();  // the process is being terminated by another thread
    }
  }
  ~Creating() {
    g_creating.fetch_sub(1);
    pthread_sigmask(SIG_SETMASK, &old, nullptr);
  }
  Creating(const Creating&) = delete;
  Creating& operator=(const Creating&) = delete;
};

// Only async-signal-safe calls: atomics, unlink, signal, raise.
extern "C" void remove_temporaries_and_die(int sig) {
  g_dying.store(1);
  while (g_creating.load() != 0) {
  }
  for (auto& s : g_slots)
    if (s.state.load() == kReady) ::unlink(s.path);
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

// ---- modes ---------------------------------------------------------------------
mode_t current_umask() {
  // Linux reports it in /proc/self/status ("Umask:\t0022") without changing it;
  // elsewhere it can only be read by setting it, briefly, under a lock.
  if (FILE* f = std::fopen("/proc/self/status", "re")) {
    char line[256];
    unsigned mask = 0;
    bool found = false;
    while (!found && std::fgets(line, sizeof line, f)) found = std::sscanf(line, "Umask: %o", &mask) == 1;
    std::fclose(f);
    if (found) return mode_t(mask);
  }
  static std::mutex m;
  const std::lock_guard<std::mutex> lock(m);
  const mode_t u = ::umask(022);
  ::umask(u);
  return u;
}

// A replaced file keeps its permission bits; a new one gets 0666 minus the umask.
mode_t mode_for(const std::string& dest) {
  struct stat st {};
  if (::stat(dest.c_str(), &st) == 0 && S_ISREG(st.st_mode)) return st.st_mode & 07777;
  return 0666 & ~current_umask();
}

fs::path directory_of(const std::string& path) {
  const fs::path parent = fs::path(path).parent_path();
  return parent.empty() ? fs::path(".") : parent;
}

// <dir>/<name>.attn-tmp.XXXXXX (mode 0600), registered for the signal
// handler *before* it exists: a signal can reach any thread (OpenMP's too)
// at any moment, and a file created first and registered after would
// survive one that lands in between. So the name is drawn here (6 random
// characters, as mkstemp does), registered, then created with O_EXCL; on a
// clash the next name is tried. The caller unregisters `slot` once the file
// is renamed or removed.
struct CreatedTemp {
  int fd;
  std::string name;
  int slot;
};
CreatedTemp create_temporary(const std::string& path, const std::string& who) {
  const fs::path dest(path);
  if (dest.filename().empty()) detail::fail(who, "output path names a directory, not a file");
  const std::string stem = (directory_of(path) / (dest.filename().string() + ".attn-tmp.")).string();
  static const char kChars[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
  static std::atomic<uint64_t> counter{0};
  std::random_device rd;
  for (int attempt = 0; attempt < 100; ++attempt) {
    uint64_t x = (uint64_t(rd()) << 32) ^ rd() ^ (uint64_t(::getpid()) << 20) ^ counter.fetch_add(1);
    std::string name = stem;
    for (int i = 0; i < 6; ++i, x /= 62) name += kChars[x % 62];
    int slot = -1, fd = -1, err = 0;
    {
      const Creating section;
      slot = register_temporary(name);
      fd = ::open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
      err = errno;
    }
    if (fd >= 0) return {fd, name, slot};
    unregister_temporary(slot);
    if (err != EEXIST) {
      errno = err;
      break;
    }
  }
  detail::fail_errno(who, "cannot create a file in directory '" + directory_of(path).string() + "'");
}

// Writes all bytes, sets the mode, flushes to disk and closes; on failure
// closes, unlinks `name` and throws naming `who`.
void write_and_close(int fd, const std::string& name, const std::string& who, const void* bytes, size_t size,
                     mode_t mode) {
  auto abandon = [&](const std::string& what) {
    const int err = errno;
    ::close(fd);
    ::unlink(name.c_str());
    detail::fail(who, what + ": " + std::strerror(err), err);
  };
  const auto* p = static_cast<const unsigned char*>(bytes);
  size_t done = 0;
  while (done < size) {
    const ssize_t w = ::write(fd, p + done, size - done);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) abandon("write failed");
    done += size_t(w);
  }
  if (::fchmod(fd, mode) != 0) abandon("cannot set the file mode");
  if (::fsync(fd) != 0) abandon("fsync failed");
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(name.c_str());
    detail::fail(who, std::string("close failed: ") + std::strerror(err), err);
  }
}

// Makes a rename durable (best effort: some file systems refuse fsync on a directory).
void sync_directory(const std::string& path) {
  const int fd = ::open(directory_of(path).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  (void)::fsync(fd);
  ::close(fd);
}

void rename_into_place(const std::string& tmp, const std::string& path) {
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    detail::fail(path, std::string("cannot rename the temporary file into place: ") + std::strerror(err), err);
  }
  sync_directory(path);
}

// ---- names staged by an OutputTransaction ----------------------------------------
struct Staged {
  std::string dest;
  int slot = -1;
  bool written = false;
};
std::mutex g_staged_mutex;
std::map<std::string, Staged> g_staged;  // staged name -> its destination

bool same_file(const std::string& a, const std::string& b) {
  std::error_code e1, e2;
  const fs::path ca = fs::weakly_canonical(fs::absolute(a, e1), e1), cb = fs::weakly_canonical(fs::absolute(b, e2), e2);
  if (!e1 && !e2 && ca == cb) return true;
  std::error_code e3;
  return fs::exists(a, e3) && fs::exists(b, e3) && fs::equivalent(a, b, e3);
}

std::string who_for(const std::string& path, const std::string& what) {
  return what.empty() ? path : what + " " + path;
}

// The checks of check_output_path(); returns the (removed) probe's name, a
// fresh name in the destination's directory.
std::string probe_output_path(const std::string& path, const std::string& what) {
  const std::string who = who_for(path, what);
  if (path.empty()) detail::fail(who, "the output path is empty");
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) detail::fail(who, "is a directory, expected a file name");
    if (!S_ISREG(st.st_mode)) detail::fail(who, "exists and is not a regular file");
    if (::access(path.c_str(), W_OK) != 0) detail::fail(who, "exists and is not writable");
  }
  const CreatedTemp t = create_temporary(path, who);
  ::close(t.fd);
  ::unlink(t.name.c_str());
  unregister_temporary(t.slot);  // the caller registers the name again while it stages the file
  return t.name;
}

}  // namespace

void write_file_atomic(const std::string& path, const void* bytes, size_t size) {
  {
    // A name staged by an OutputTransaction is written in place; commit() renames it.
    std::unique_lock<std::mutex> lock(g_staged_mutex);
    auto it = g_staged.find(path);
    if (it != g_staged.end()) {
      const std::string dest = it->second.dest;
      lock.unlock();
      int fd = -1, err = 0;
      {
        const Creating section;  // registered since OutputTransaction::add
        fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
        err = errno;
      }
      errno = err;
      if (fd < 0) detail::fail_errno(dest, "cannot create the temporary file '" + path + "'");
      write_and_close(fd, path, dest, bytes, size, mode_for(dest));
      lock.lock();
      it = g_staged.find(path);
      if (it != g_staged.end()) it->second.written = true;
      return;
    }
  }
  const CreatedTemp t = create_temporary(path, path);
  struct Unregister {
    int slot;
    ~Unregister() { unregister_temporary(slot); }
  } unregister{t.slot};
  write_and_close(t.fd, t.name, path, bytes, size, mode_for(path));
  rename_into_place(t.name, path);
}

namespace detail {

void check_output_path(const std::string& path, const std::string& what) { (void)probe_output_path(path, what); }

void OutputTransaction::claim(const std::string& path, const std::string& what) {
  for (const auto& o : outputs_)
    if (same_file(o.path, path))
      throw InvalidArgument(o.what + " and " + what + " both name the file '" + path + "'; give each output its own path");
}

std::string OutputTransaction::add(const std::string& path, const std::string& what) {
  claim(path, what);
  const std::string staged = probe_output_path(path, what);
  Staged s;
  s.dest = path;
  s.slot = register_temporary(staged);  // so that a signal during the write removes it
  {
    const std::lock_guard<std::mutex> lock(g_staged_mutex);
    g_staged[staged] = s;
  }
  outputs_.push_back({path, what, staged});
  return staged;
}

void OutputTransaction::check(const std::string& path, const std::string& what) {
  claim(path, what);
  check_output_path(path, what);
  outputs_.push_back({path, what, ""});
}

void OutputTransaction::commit() {
  {
    const std::lock_guard<std::mutex> lock(g_staged_mutex);
    for (const auto& o : outputs_)
      if (!o.staged.empty() && !o.done && !g_staged[o.staged].written)
        fail(who_for(o.path, o.what), "was never written (nothing to commit)");
  }
  for (auto& o : outputs_) {
    if (o.staged.empty() || o.done) continue;
    rename_into_place(o.staged, o.path);
    o.done = true;
    const std::lock_guard<std::mutex> lock(g_staged_mutex);
    unregister_temporary(g_staged[o.staged].slot);
    g_staged.erase(o.staged);
  }
}

OutputTransaction::~OutputTransaction() {
  for (const auto& o : outputs_) {
    if (o.staged.empty() || o.done) continue;
    ::unlink(o.staged.c_str());  // ENOENT when it was never written
    const std::lock_guard<std::mutex> lock(g_staged_mutex);
    auto it = g_staged.find(o.staged);
    if (it != g_staged.end()) {
      unregister_temporary(it->second.slot);
      g_staged.erase(it);
    }
  }
}

void remove_temporaries_on_signal() {
  struct sigaction sa {};
  sa.sa_handler = remove_temporaries_and_die;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESETHAND;
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) ::sigaction(sig, &sa, nullptr);
}

}  // namespace detail
}  // namespace attn::io
