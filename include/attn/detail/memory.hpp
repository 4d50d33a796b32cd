// attn/detail/memory.hpp — checks for allocations whose size a request
// fixes in advance (internal: used by the reference backend and the attn tool).
//
// A request that would materialise more than the machine's memory (the
// reference backend's L×S matrices, `attn sdpa --weights` for L = S = 10^6)
// is refused up front as an invalid argument that names what needs the
// memory and how many bytes, instead of ending in std::bad_alloc (or in the
// kernel's out-of-memory killer) half way through.
#pragma once

#include <cstdint>
#include <initializer_list>
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

}  // namespace attn::detail
