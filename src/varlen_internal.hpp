// Internals of the packed variable-length forward (varlen.cpp) that the
// tests reach: not part of the public API.
#pragma once

#include <cstdint>

namespace attn::detail {

// The bytes of Q, K and V per group of sequences in the fused forward of a
// packed batch whose rows are not adjacent (varlen.cpp, "the forward in
// groups of sequences"); 16 MiB. Tests lower it to run many groups on a
// small batch. Not thread-safe to change while a call runs.
extern int64_t varlen_group_bytes;

}  // namespace attn::detail
