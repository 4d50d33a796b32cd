// attn/detail/memory.hpp — checks for allocations whose size a request
// fixes in advance (internal: used by the reference backend and the attn tool),
// and the allocator of large streamed buffers (the KV cache's storage).
//
// A request that would materialise more than the machine's memory (the
// reference backend's L×S matrices, `attn sdpa --weights` for L = S = 10^6)
// is refused up front as an invalid argument that names what needs the
// memory and how many bytes, instead of ending in std::bad_alloc (or in the
// kernel's out-of-memory killer) half way through.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <new>
#include <string>

namespace attn::detail {

// elem_bytes × the product of dims, or UINT64_MAX when that overflows 64 bits
// (or a dim is negative).
uint64_t checked_bytes(std::initializer_list<int64_t> dims, uint64_t elem_bytes);

// The physical memory of this machine in bytes (0 when unknown).
uint64_t physical_memory_bytes();

// "3.7 GiB", "512 bytes": for messages.
std::string format_bytes(uint64_t bytes);

// Throws attn::InvalidArgument "<what> would need N bytes (X GiB), more than the Y GiB
// of memory of this machine" when `bytes` exceeds physical_memory_bytes().
void check_fits_in_memory(uint64_t bytes, const std::string& what);

// Memory for a buffer that is streamed through again and again (a KV cache:
// every decoding step reads all of it). Buffers of 2 MiB and more are
// aligned to 2 MiB and, on Linux, marked for transparent huge pages
// (madvise MADV_HUGEPAGE, effective where the system's THP mode is "always"
// or "madvise"), before anything touches them: with 4 KiB pages a stream
// crosses a page, and misses the TLB, every 4 KiB, which costs about a
// quarter of the read rate on a virtual machine. Smaller buffers: 64-byte
// aligned. Throws std::bad_alloc when the memory is not there. Freed with
// the size it was allocated with (large buffers are mappings of their own
// on Linux: src/memory.cpp says why).
void* allocate_streamed(std::size_t bytes);
void free_streamed(void* p, std::size_t bytes) noexcept;

template <class T>
struct StreamedAllocator {
  using value_type = T;
  StreamedAllocator() = default;
  template <class U>
  StreamedAllocator(const StreamedAllocator<U>&) noexcept {}
  T* allocate(std::size_t n) {
    if (n > SIZE_MAX / sizeof(T)) throw std::bad_alloc();
    return static_cast<T*>(allocate_streamed(n * sizeof(T)));
  }
  void deallocate(T* p, std::size_t n) noexcept { free_streamed(p, n * sizeof(T)); }
  template <class U>
  bool operator==(const StreamedAllocator<U>&) const noexcept {
    return true;
  }
};

}  // namespace attn::detail
