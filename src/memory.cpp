// Up-front checks of allocations whose size a request fixes, and the
// allocator of streamed buffers (attn/detail/memory.hpp).
#include "attn/detail/memory.hpp"

#include <unistd.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include <cstdio>
#include <algorithm>
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

void* allocate_streamed(std::size_t bytes) {
  constexpr std::size_t huge = std::size_t(2) << 20;
  const std::size_t align = bytes >= huge ? huge : 64;
  const std::size_t size = (std::max<std::size_t>(bytes, 1) + align - 1) / align * align;  // aligned_alloc wants a multiple
  void* p = std::aligned_alloc(align, size);
  if (!p) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (align == huge) (void)::madvise(p, size, MADV_HUGEPAGE);  // a hint: refused = 4 KiB pages
#endif
  return p;
}

void free_streamed(void* p) noexcept { std::free(p); }

}  // namespace attn::detail
