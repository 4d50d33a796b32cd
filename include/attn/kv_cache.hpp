// attn/kv_cache.hpp — a key/value cache for incremental decoding, and
// attention of new queries over it.
//
// The cache holds, for B sequences and Hkv key/value heads, the keys (E
// features) and values (Ev features) of every token appended so far. Each
// sequence has its own length (0 <= length(b) <= capacity). Keys and values
// are stored in float32, float16 or bfloat16 (converted on append, rounding
// to nearest even); attention is computed in float32 on the stored values, so
// results are exact for the stored precision (unless opt.compute_dtype is
// bfloat16 over a float32 or bfloat16 cache on a CPU where bfloat16
// products are faster: then q, k, v and the probabilities are rounded to
// bfloat16 for the products, docs/decode.md "bfloat16 compute").
//
// Layouts
// -------
//   contiguous  one block of `capacity` tokens per sequence:
//               K storage (B, Hkv, capacity, E), V (B, Hkv, capacity, Ev).
//   paged       a pool of `num_pages` pages of `page_size` tokens each:
//               K pool (num_pages, Hkv, page_size, E), V (.., Ev), plus a
//               block table per sequence (the layout of vLLM's and
//               FlashAttention's `block_table`): token t of sequence b lives
//               in page block_table(b)[t / page_size], slot t % page_size.
//               Pages are taken from the pool as a sequence grows (lowest
//               free page first), so nothing is reallocated or copied.
//               Sequences may share pages holding a common prefix
//               (set_block_table); a shared page is read-only.
// Within a page (or block) the rows of one head are contiguous, so attention
// for one key/value head streams page_size·E consecutive elements.
//
// Block-table rules (checked by set_block_table, argument errors otherwise):
// every page id is in [0, num_pages); no page appears twice in one table; a
// page a sequence may still write (the one holding position length(b) and
// every later one) belongs to that sequence alone; a page shared between
// sequences is full (entirely below the length) in every table using it.
// A table has at most min(ceil(capacity / page_size), num_pages) entries.
//
// Sizes: the constructor computes every byte the cache will hold (K and V
// storage, block tables, page counts) with overflow-checked arithmetic before
// it allocates anything, and refuses (attn::InvalidArgument naming the
// configuration and the bytes) a cache larger than the machine's physical
// memory, or whose page ids do not fit in int32.
//
// Threads: one cache may be shared by any number of threads. Every member
// function is atomic: calls that change the cache (append, reset, clear,
// truncate, set_block_table) hold it exclusively, calls that read it
// (decode_attention, read, length, block_table, free_pages,
// append_refusal, ...) hold it shared, so reads run in parallel with each
// other and never see half an append or a page that a reset gave back.
// So appends, resets and truncations of different sequences from different
// threads, and decodes alongside them, are safe and give the results of
// some order of the calls. A sequence of calls is not atomic as a whole: a
// thread that appends to sequence b and then attends over it sees what
// other threads did to b in between, so give each sequence one writer (a
// server's request owns its sequence). Moving a cache is not synchronised:
// no other thread may use it meanwhile.
#pragma once

#include <cstdint>
#include <optional>
#include <mutex>
#include <shared_mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "attn/detail/memory.hpp"
#include "attn/error.hpp"
#include "attn/sdpa.hpp"
#include "attn/tensor.hpp"

namespace attn {

namespace detail {
struct KVCacheAccess;  // the kernels' read access to the storage
}


struct KVCacheConfig {
  int64_t batch = 1;       // B sequences
  int64_t kv_heads = 1;    // Hkv
  int64_t capacity = 0;    // most tokens one sequence can hold
  int64_t head_dim = 0;    // E
  int64_t value_dim = 0;   // Ev (0 = E)
  Dtype dtype = Dtype::float32;
  int64_t page_size = 0;   // 0 = contiguous; > 0 = paged with pages of this many tokens
  int64_t num_pages = 0;   // paged: pool size (0 = B · ceil(capacity / page_size))
};

class KVCache {
 public:
  explicit KVCache(const KVCacheConfig& config);

  const KVCacheConfig& config() const { return cfg_; }
  int64_t batch() const { return cfg_.batch; }
  int64_t kv_heads() const { return cfg_.kv_heads; }
  int64_t capacity() const { return cfg_.capacity; }
  int64_t head_dim() const { return cfg_.head_dim; }
  int64_t value_dim() const { return cfg_.value_dim; }
  Dtype dtype() const { return cfg_.dtype; }
  bool paged() const { return cfg_.page_size > 0; }
  int64_t page_size() const { return page_size_; }  // capacity when contiguous
  int64_t num_pages() const { return num_pages_; }  // B when contiguous
  int64_t length(int64_t b) const;
  int64_t max_length() const;
  int64_t free_pages() const;  // pages no sequence uses
  size_t storage_bytes() const { return kstore_.size() + vstore_.size(); }

  KVCache(KVCache&&) noexcept = default;
  KVCache& operator=(KVCache&&) noexcept = default;
  KVCache(const KVCache&) = delete;
  KVCache& operator=(const KVCache&) = delete;

  // Appends n tokens to sequence b: k (Hkv, n, E), v (Hkv, n, Ev), any strides.
  void append(int64_t b, View3<const float> k, View3<const float> v);
  // Appends n tokens to every sequence: k (B, Hkv, n, E), v (B, Hkv, n, Ev).
  void append(View4<const float> k, View4<const float> v);
  // Why appending n tokens to every sequence would be refused (a sequence's
  // capacity, a page shared with another sequence, too few free pages), or
  // "" when it would not: the check both appends make before they write, for
  // callers that must refuse before they change anything else (the
  // multi-head layer's decode, a model's decoding step over its layers).
  std::string append_refusal(int64_t n) const;
  // Length of sequence b back to 0 (its pages return to the pool), or of all.
  void reset(int64_t b);
  void clear();
  // Drops the tokens of sequence b from position `length` on (0 <= length <=
  // length(b)), e.g. the rejected draft tokens of speculative decoding: the
  // next append writes at `length`. Paged: the pages past the kept tokens
  // return to the pool; a page the sequence keeps part of and shares with
  // another sequence is first copied to a free page of its own (an error
  // naming the pool when there is none), since a page a sequence may still
  // write belongs to it alone. Nothing changes when it fails.
  void truncate(int64_t b, int64_t length);

  // Paged layout only. The pages of sequence b in token order (ceil(length /
  // page_size) entries, more when set_block_table gave more).
  std::vector<int32_t> block_table(int64_t b) const;
  // Replaces sequence b's table and length (see the rules above); e.g. a
  // second sequence reusing the first one's full prefix pages.
  void set_block_table(int64_t b, std::span<const int32_t> pages, int64_t length);

  // The stored keys and values of sequence b as float32 (the rounded values):
  // k (Hkv, length(b), E), v (Hkv, length(b), Ev).
  void read(int64_t b, View3<float> k, View3<float> v) const;

 private:
  friend struct detail::KVCacheAccess;
  // The lock of the thread contract above; a moved cache gets a new one.
  struct Lock {
    mutable std::shared_mutex m;
    Lock() = default;
    Lock(Lock&&) noexcept {}
    Lock& operator=(Lock&&) noexcept { return *this; }
  };
  std::unique_lock<std::shared_mutex> exclusive() const { return std::unique_lock(lock_.m); }
  std::shared_lock<std::shared_mutex> shared() const { return std::shared_lock(lock_.m); }
  // The members below run with the lock held (public calls take it once:
  // the mutex is not recursive).
  void check_seq(const char* fn, int64_t b) const;
  int64_t free_count() const;
  void append_locked(int64_t b, const View3<const float>& k, const View3<const float>& v);
  void reset_locked(int64_t b);
  void read_locked(int64_t b, View3<float> k, View3<float> v) const;
  // Why appending n tokens to sequence b would be refused (its capacity, a
  // shared page), or ""; adds the pages it would take from the pool to
  // `pages`. Then pool_refusal(pages): too few free pages, or "".
  std::string seq_refusal(int64_t b, int64_t n, int64_t& pages) const;
  std::string pool_refusal(int64_t pages) const;
  void write(int64_t b, int64_t t, int64_t n, const View3<const float>& k, const View3<const float>& v);
  KVCacheConfig cfg_;
  int64_t page_size_ = 0, num_pages_ = 0, table_width_ = 0, elem_ = 4;
  std::vector<std::byte, detail::StreamedAllocator<std::byte>> kstore_, vstore_;  // huge pages where possible
  std::vector<int64_t> len_;
  std::vector<int32_t> table_;  // B × table_width_, −1 = no page yet
  std::vector<int32_t> refs_;   // per page: how many table entries name it
  Lock lock_;
};

// The arguments of attention over a cache: L new queries per sequence, the
// cache, and the score-rule operands (ScoreArgs, attn/sdpa.hpp) over the
// cache's key positions:
//   q     (B, H, L, E) with Hkv dividing H (query head h reads cache head
//         h / (H / Hkv))
//   cache the keys and values (not owned; must outlive the call)
//   mask  bool (B|1, H|1, L|1, C|1) over key positions 0..C−1, C = the
//         capacity: true = query i may attend to key j
//   bias  float, the same shape, added to the scores (−inf masks)
//   the per-head operands (H), as in the dense call
struct DecodeArgs : ScoreArgs<float> {
  View4<const float> q;
  const KVCache* cache = nullptr;
};

// Attention of L new queries per sequence over the cache, the dense call's
// shape (arguments, outputs, options):
//   outputs.out (B, H, L, Ev); outputs.lse (B, H, L) when given;
//   outputs.weights must be empty (the kernel never forms them).
// Positions: the new queries are the last L tokens of each sequence, so
// query i of sequence b sits at position length(b) − L + i (the
// bottom-right alignment; opt.causal_align does not apply and
// opt.position_offset is refused). Every other SdpaOptions rule applies as
// in the dense call; causal defaults to
// false as there: one new token per sequence sees every key either way, a
// block of L > 1 new tokens needs opt.causal = true to be causal.
// opt.backend: reference reads the cache back as float32 and runs the
// reference backend per sequence (for testing; it refuses compute_dtype
// bfloat16); fused/automatic run the decode kernel (chunked prefill through
// the fused kernel for many rows, exact whatever compute_dtype says).
// A sequence of length 0 (or a query that sees no key) gets output 0 and
// lse −inf (with sinks: lse = the head's sink). NaN or ±inf in a q, k or v
// row a query sees makes its output row and lse NaN; keys it does not see
// (causal, window, chunks, mask, −inf bias) never touch it. Results do not
// depend on the thread count (the chunks are fixed by the shape and merged
// in a fixed order). Figures, layouts and the kernel: docs/decode.md.
void decode_attention(const DecodeArgs& args, const SdpaOutputs<float>& outputs, const SdpaOptions& opt = {});

// One decoding step: appends the new tokens' keys k (B, Hkv, n, E) and
// values v (B, Hkv, n, Ev) to every sequence of `cache`, then the call
// above over it (the k and v of flash_attn_with_kvcache). args.cache is
// null or &cache. Every argument is checked before the cache changes, so a
// refused call leaves it as it was; so does a failure while attending (the
// new tokens are taken back).
void decode_attention(KVCache& cache, View4<const float> k, View4<const float> v, const DecodeArgs& args,
                      const SdpaOutputs<float>& outputs, const SdpaOptions& opt = {});

}  // namespace attn
