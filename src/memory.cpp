// Up-front checks of allocations whose size a request fixes, and the
// allocator of streamed buffers (attn/detail/memory.hpp).
#include "attn/detail/memory.hpp"

#include <unistd.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <cstdio>
#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "attn/error.hpp"

namespace attn::detail {

uint64_t checked_bytes(std::initializer_list<int64_t> dims, uint64_t elem_bytes) {
  uint64_t n = elem_bytes;
  for (int64_t d : dims) {
    if (d < 0 || __builtin_mul_overflow(n, uint64_t(d), &n)) return UINT64_MAX;
  }
  return n;
}

uint64_t physical_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return 0;
  return uint64_t(pages) * uint64_t(page);
}

std::string format_bytes(uint64_t bytes) {
  if (bytes == UINT64_MAX) return "more than 2^64 bytes";
  static const char* const units[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (bytes < 1024) return std::to_string(bytes) + " bytes";
  double v = double(bytes) / 1024;
  int u = 0;
  while (v >= 1024 && u < 5) v /= 1024, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f %s", v, units[u]);
  return buf;
}

void check_fits_in_memory(uint64_t bytes, const std::string& what) {
  const uint64_t phys = physical_memory_bytes();
  if (phys == 0 || bytes <= phys) return;
  const std::string need = bytes == UINT64_MAX ? format_bytes(bytes) : std::to_string(bytes) + " bytes (" + format_bytes(bytes) + ")";
  throw InvalidArgument(what + " would need " + need + ", more than the " + format_bytes(phys) + " of memory of this machine");
}

namespace {
constexpr std::size_t kHuge = std::size_t(2) << 20;
std::size_t streamed_size(std::size_t bytes, std::size_t align) {
  return (std::max<std::size_t>(bytes, 1) + align - 1) / align * align;  // a whole number of `align`
}
}  // namespace

// On Linux a buffer of 2 MiB or more is its own mapping: pages that no one
// touched before, so the first touch after madvise can take a huge page.
// Through malloc, in one run of attn-decode-bench the cache that came third
// (16 MiB, whichever dtype) read 20-25% slower than the first (1.20-1.31
// against 0.97-1.01 ms), and the mappings removed that. The likely reason,
// not confirmed page by page: glibc raises its mmap threshold after a large
// block is freed and serves the next blocks from heap memory that was
// already touched in 4 KiB pages.
void* allocate_streamed(std::size_t bytes) {
  if (bytes > SIZE_MAX / 2) throw std::bad_alloc();  // (the rounding below would wrap)
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (bytes >= kHuge) {
    const std::size_t size = streamed_size(bytes, kHuge), span = size + kHuge;
    void* m = ::mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) throw std::bad_alloc();
    const auto base = reinterpret_cast<uintptr_t>(m), a = (base + kHuge - 1) / kHuge * kHuge;
    if (a > base) ::munmap(m, a - base);  // the mapping keeps [a, a + size) only
    if (base + span > a + size) ::munmap(reinterpret_cast<void*>(a + size), base + span - (a + size));
    (void)::madvise(reinterpret_cast<void*>(a), size, MADV_HUGEPAGE);  // a hint: refused = 4 KiB pages
    return reinterpret_cast<void*>(a);
  }
#endif
  const std::size_t align = bytes >= kHuge ? kHuge : 64;
  void* p = std::aligned_alloc(align, streamed_size(bytes, align));
  if (!p) throw std::bad_alloc();
  return p;
}

void free_streamed(void* p, std::size_t bytes) noexcept {
  if (!p) return;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (bytes >= kHuge) {
    ::munmap(p, streamed_size(bytes, kHuge));
    return;
  }
#endif
  (void)bytes;
  std::free(p);
}

}  // namespace attn::detail
