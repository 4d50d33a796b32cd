// The KV cache: storage, appends, block tables and paging, and the
// kernels' read access to it (KVCacheAccess). Attention over it,
// decode_attention, is src/decode_call.cpp.
#include "attn/kv_cache.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>

#include "kernels/decode/decode.hpp"
#include "validate.hpp"

namespace attn {

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0); }  // a >= 0, b > 0; never overflows

uint64_t add_bytes(uint64_t a, uint64_t b) { return a > UINT64_MAX - b ? UINT64_MAX : a + b; }

}  // namespace

KVCache::KVCache(const KVCacheConfig& config) : cfg_(config) {
  const detail::Checker c{"KVCache"};
  auto positive = [&](int64_t v, const char* name) {
    if (v < 1) c.fail(std::string("config '") + name + "' is " + std::to_string(v) + ", expected >= 1");
  };
  positive(cfg_.batch, "batch");
  positive(cfg_.kv_heads, "kv_heads");
  positive(cfg_.capacity, "capacity");
  positive(cfg_.head_dim, "head_dim");
  if (cfg_.value_dim == 0) cfg_.value_dim = cfg_.head_dim;
  positive(cfg_.value_dim, "value_dim");
  if (cfg_.page_size < 0) c.fail("config 'page_size' is " + std::to_string(cfg_.page_size) + ", expected >= 0 (0 = contiguous)");
  if (cfg_.num_pages < 0) c.fail("config 'num_pages' is " + std::to_string(cfg_.num_pages) + ", expected >= 0");
  if (cfg_.page_size == 0 && cfg_.num_pages != 0)
    c.fail("config 'num_pages' is " + std::to_string(cfg_.num_pages) + " but the layout is contiguous (page_size = 0)");
  elem_ = cfg_.dtype == Dtype::float32 ? 4 : 2;
  const std::string what = "the cache (batch " + std::to_string(cfg_.batch) + ", kv_heads " +
                             std::to_string(cfg_.kv_heads) + ", capacity " + std::to_string(cfg_.capacity) +
                             ", head_dim " + std::to_string(cfg_.head_dim) + ", value_dim " +
                             std::to_string(cfg_.value_dim) + ", " + dtype_name(cfg_.dtype) + ", page_size " +
                             std::to_string(cfg_.page_size) + ", num_pages " + std::to_string(cfg_.num_pages) + ")";
  if (cfg_.page_size == 0) {
    page_size_ = cfg_.capacity;
    num_pages_ = cfg_.batch;
    table_width_ = 1;
  } else {
    page_size_ = cfg_.page_size;
    const int64_t per_seq = ceil_div(cfg_.capacity, page_size_);  // pages a full sequence spans
    num_pages_ = cfg_.num_pages;
    if (num_pages_ == 0 && !detail::checked_mul(cfg_.batch, per_seq, &num_pages_))
      c.fail(what + " would need more than 2^63 pages");
    table_width_ = std::min(per_seq, num_pages_);  // a table never names a page twice
  }
  if (num_pages_ > std::numeric_limits<int32_t>::max())
    c.fail(what + " has " + std::to_string(num_pages_) + " pages; page ids are int32, at most 2^31 - 1 pages");
  // Every byte the cache holds, before anything is allocated: K and V
  // storage, the block tables, the page counts and the lengths.
  const uint64_t kv_bytes = add_bytes(detail::checked_bytes({num_pages_, cfg_.kv_heads, page_size_, cfg_.head_dim}, elem_),
                                      detail::checked_bytes({num_pages_, cfg_.kv_heads, page_size_, cfg_.value_dim}, elem_));
  const uint64_t table_bytes = add_bytes(detail::checked_bytes({cfg_.batch, table_width_}, sizeof(int32_t)),
                                         add_bytes(detail::checked_bytes({num_pages_}, sizeof(int32_t)),
                                                   detail::checked_bytes({cfg_.batch}, sizeof(int64_t))));
  detail::check_fits_in_memory(add_bytes(kv_bytes, table_bytes), "attn::KVCache: " + what);
  const int64_t page_k = cfg_.kv_heads * page_size_ * cfg_.head_dim;
  const int64_t page_v = cfg_.kv_heads * page_size_ * cfg_.value_dim;
  kstore_.assign(size_t(num_pages_ * page_k * elem_), std::byte{0});
  vstore_.assign(size_t(num_pages_ * page_v * elem_), std::byte{0});
  len_.assign(size_t(cfg_.batch), 0);
  table_.assign(size_t(cfg_.batch * table_width_), -1);
  refs_.assign(size_t(num_pages_), 0);
  if (!paged())
    for (int64_t b = 0; b < cfg_.batch; ++b) table_[size_t(b)] = int32_t(b), refs_[size_t(b)] = 1;
}

void KVCache::check_seq(const char* fn, int64_t b) const {
  if (b < 0 || b >= cfg_.batch)
    detail::Checker{fn}.fail("argument 'b' is " + std::to_string(b) + ", expected 0 <= b < batch = " +
                             std::to_string(cfg_.batch));
}

int64_t KVCache::length(int64_t b) const {
  check_seq("KVCache::length", b);
  const auto lock = shared();
  return len_[size_t(b)];
}

int64_t KVCache::max_length() const {
  const auto lock = shared();
  return *std::max_element(len_.begin(), len_.end());
}

int64_t KVCache::free_pages() const {
  const auto lock = shared();
  return free_count();
}

int64_t KVCache::free_count() const { return int64_t(std::count(refs_.begin(), refs_.end(), 0)); }

// Copies n tokens (positions t..t+n) of k/v into sequence b's pages, taking
// fresh pages from the pool where the table has none yet.
void KVCache::write(int64_t b, int64_t t, int64_t n, const View3<const float>& k, const View3<const float>& v) {
  const auto st = cfg_.dtype;
  const int64_t Hkv = cfg_.kv_heads, E = cfg_.head_dim, Ev = cfg_.value_dim;
  for (int64_t i = 0; i < n;) {
    const int64_t pos = t + i, slot = pos / page_size_, off = pos % page_size_;
    int32_t& page = table_[size_t(b * table_width_ + slot)];
    if (page < 0) {  // there is one: seq_refusal() counted it
      const auto it = std::find(refs_.begin(), refs_.end(), 0);
      page = int32_t(it - refs_.begin());
      ++*it;
    }
    const int64_t run = std::min(n - i, page_size_ - off);
    for (int64_t hk = 0; hk < Hkv; ++hk)
      for (int64_t r = 0; r < run; ++r) {
        const int64_t kofs = ((int64_t(page) * Hkv + hk) * page_size_ + off + r) * E;
        const int64_t vofs = ((int64_t(page) * Hkv + hk) * page_size_ + off + r) * Ev;
        detail::convert_to_storage(st, &k(hk, i + r, 0), k.strides[2], E, kstore_.data() + kofs * elem_);
        detail::convert_to_storage(st, &v(hk, i + r, 0), v.strides[2], Ev, vstore_.data() + vofs * elem_);
      }
    i += run;
  }
}

std::string KVCache::seq_refusal(int64_t b, int64_t n, int64_t& pages) const {
  const int64_t len = len_[size_t(b)];
  if (n > cfg_.capacity - len)
    return "sequence " + std::to_string(b) + " holds " + std::to_string(len) + " tokens; appending " +
           std::to_string(n) + " exceeds the capacity " + std::to_string(cfg_.capacity);
  if (!paged() || n == 0) return {};
  if ((len + n - 1) / page_size_ >= table_width_)  // the pool is smaller than the capacity
    return "sequence " + std::to_string(b) + " holds " + std::to_string(len) + " tokens; appending " +
           std::to_string(n) + " needs more pages than the pool's " + std::to_string(num_pages_) + " of " +
           std::to_string(page_size_) + " tokens";
  for (int64_t slot = len / page_size_; slot <= (len + n - 1) / page_size_; ++slot) {
    const int32_t page = table_[size_t(b * table_width_ + slot)];
    if (page < 0)
      ++pages;
    else if (refs_[size_t(page)] > 1)
      return "sequence " + std::to_string(b) + " would write page " + std::to_string(page) +
             ", which is shared with another sequence";
  }
  return {};
}

std::string KVCache::pool_refusal(int64_t pages) const {
  const int64_t free = free_count();
  if (pages <= free) return {};
  return "the page pool is exhausted: appending needs " + std::to_string(pages) + " new pages of " +
         std::to_string(page_size_) + " tokens, " + std::to_string(free) + " of " +
         std::to_string(num_pages_) + " are free";
}

std::string KVCache::append_refusal(int64_t n) const {
  if (n < 0) return "cannot append a negative number of tokens (" + std::to_string(n) + ")";
  const auto lock = shared();
  int64_t pages = 0;
  for (int64_t b = 0; b < cfg_.batch; ++b)
    if (std::string why = seq_refusal(b, n, pages); !why.empty()) return why;
  return pool_refusal(pages);
}

void KVCache::append(int64_t b, View3<const float> k, View3<const float> v) {
  const detail::Checker c{"KVCache::append"};
  check_seq(c.fn.c_str(), b);
  c.require(k, "k");
  c.require(v, "v");
  const int64_t n = k.dim(1);
  if (k.dim(0) != cfg_.kv_heads || k.dim(2) != cfg_.head_dim)
    c.fail("argument 'k' has shape " + shape_str(k.shape) + ", expected (Hkv, n, E) = (" +
           std::to_string(cfg_.kv_heads) + ", n, " + std::to_string(cfg_.head_dim) + ")");
  c.shape(v, "v", {cfg_.kv_heads, n, cfg_.value_dim},
          "(Hkv, n, Ev) = " + shape_str({cfg_.kv_heads, n, cfg_.value_dim}) + " (n of 'k')");
  const auto lock = exclusive();
  int64_t pages = 0;
  if (std::string why = seq_refusal(b, n, pages); !why.empty()) c.fail(why);
  if (std::string why = pool_refusal(pages); !why.empty()) c.fail(why);
  append_locked(b, k, v);
}

// Feature strides other than 1 go through the conversion's stride; the
// conversion writes one row at a time, so any view layout works.
void KVCache::append_locked(int64_t b, const View3<const float>& k, const View3<const float>& v) {
  const int64_t len = len_[size_t(b)], n = k.dim(1);
  write(b, len, n, k, v);
  len_[size_t(b)] = len + n;
}

void KVCache::append(View4<const float> k, View4<const float> v) {
  const detail::Checker c{"KVCache::append"};
  c.require(k, "k");
  c.require(v, "v");
  const int64_t n = k.dim(2);
  c.shape(k, "k", {cfg_.batch, cfg_.kv_heads, n, cfg_.head_dim},
          "(B, Hkv, n, E) = " + shape_str({cfg_.batch, cfg_.kv_heads, n, cfg_.head_dim}));
  c.shape(v, "v", {cfg_.batch, cfg_.kv_heads, n, cfg_.value_dim},
          "(B, Hkv, n, Ev) = " + shape_str({cfg_.batch, cfg_.kv_heads, n, cfg_.value_dim}) + " (n of 'k')");
  // Check every sequence before writing any (capacity, shared pages, the
  // pool's free pages), so an error leaves the cache unchanged.
  const auto lock = exclusive();
  int64_t pages = 0;
  for (int64_t b = 0; b < cfg_.batch; ++b)
    if (std::string why = seq_refusal(b, n, pages); !why.empty()) c.fail(why);
  if (std::string why = pool_refusal(pages); !why.empty()) c.fail(why);
  for (int64_t b = 0; b < cfg_.batch; ++b) {
    const View3<const float> kb(k.data + b * k.strides[0], {k.dim(1), k.dim(2), k.dim(3)},
                                {k.strides[1], k.strides[2], k.strides[3]});
    const View3<const float> vb(v.data + b * v.strides[0], {v.dim(1), v.dim(2), v.dim(3)},
                                {v.strides[1], v.strides[2], v.strides[3]});
    append_locked(b, kb, vb);
  }
}

void KVCache::reset(int64_t b) {
  check_seq("KVCache::reset", b);
  const auto lock = exclusive();
  reset_locked(b);
}

void KVCache::reset_locked(int64_t b) {
  len_[size_t(b)] = 0;
  if (!paged()) return;
  for (int64_t s = 0; s < table_width_; ++s) {
    int32_t& page = table_[size_t(b * table_width_ + s)];
    if (page >= 0) --refs_[size_t(page)];
    page = -1;
  }
}

void KVCache::truncate(int64_t b, int64_t length) {
  const detail::Checker c{"KVCache::truncate"};
  check_seq(c.fn.c_str(), b);
  const auto lock = exclusive();
  const int64_t len = len_[size_t(b)];
  if (length < 0 || length > len)
    c.fail("argument 'length' is " + std::to_string(length) + ", expected 0 <= length <= length(" +
           std::to_string(b) + ") = " + std::to_string(len));
  if (paged()) {
    int32_t* row = table_.data() + b * table_width_;
    const int64_t keep = ceil_div(length, page_size_);  // table entries that hold kept tokens
    const int64_t part = length % page_size_;           // tokens kept in the last of them (0: all of it)
    const int32_t last = keep > 0 ? row[keep - 1] : -1;
    int32_t own = -1;  // the private copy of a shared, partly kept last page
    if (part != 0 && refs_[size_t(last)] > 1) {
      const auto it = std::find(refs_.begin(), refs_.end(), 0);
      if (it == refs_.end())
        c.fail("the page pool is exhausted: sequence " + std::to_string(b) + " keeps " + std::to_string(part) +
               " tokens of page " + std::to_string(last) +
               ", which it shares with another sequence, and needs a free page for a copy of its own");
      own = int32_t(it - refs_.begin());
    }
    for (int64_t s = keep; s < table_width_; ++s) {
      if (row[s] >= 0) --refs_[size_t(row[s])];
      row[s] = -1;
    }
    if (own >= 0) {  // per head, the kept rows of K and of V
      for (int64_t hk = 0; hk < cfg_.kv_heads; ++hk)
        for (auto [store, width] : {std::pair{&kstore_, cfg_.head_dim}, std::pair{&vstore_, cfg_.value_dim}}) {
          const int64_t rows = width * elem_ * page_size_;  // bytes of one head's rows in a page
          std::memcpy(store->data() + (int64_t(own) * cfg_.kv_heads + hk) * rows,
                      store->data() + (int64_t(last) * cfg_.kv_heads + hk) * rows, size_t(part * width * elem_));
        }
      --refs_[size_t(last)];
      ++refs_[size_t(own)];
      row[keep - 1] = own;
    }
  }
  len_[size_t(b)] = length;
}

void KVCache::clear() {
  const auto lock = exclusive();
  for (int64_t b = 0; b < cfg_.batch; ++b) reset_locked(b);
}

std::vector<int32_t> KVCache::block_table(int64_t b) const {
  check_seq("KVCache::block_table", b);
  if (!paged())
    detail::Checker{"KVCache::block_table"}.fail("the cache is contiguous (page_size = 0); it has no block table");
  const auto lock = shared();
  std::vector<int32_t> t;
  for (int64_t s = 0; s < table_width_; ++s) {
    const int32_t page = table_[size_t(b * table_width_ + s)];
    if (page < 0) break;
    t.push_back(page);
  }
  return t;
}

void KVCache::set_block_table(int64_t b, std::span<const int32_t> pages, int64_t length) {
  const detail::Checker c{"KVCache::set_block_table"};
  check_seq(c.fn.c_str(), b);
  if (!paged()) c.fail("the cache is contiguous (page_size = 0); it has no block table");
  const int64_t n = int64_t(pages.size());
  if (n > table_width_)
    c.fail("argument 'pages' has " + std::to_string(n) + " entries, expected at most min(ceil(capacity / page_size), "
           "num_pages) = " + std::to_string(table_width_));
  if (length < 0 || length > n * page_size_ || length > cfg_.capacity)
    c.fail("argument 'length' is " + std::to_string(length) + ", expected 0 <= length <= min(" +
           std::to_string(n) + " pages · " + std::to_string(page_size_) + ", capacity " +
           std::to_string(cfg_.capacity) + ")");
  const int64_t full = length / page_size_;  // entries below this are read-only
  const auto lock = exclusive();
  // Who uses each page, leaving sequence b's current table out.
  std::vector<int32_t> other(size_t(num_pages_), 0);
  std::vector<char> other_writable(size_t(num_pages_), 0);
  for (int64_t seq = 0; seq < cfg_.batch; ++seq) {
    if (seq == b) continue;
    for (int64_t s = 0; s < table_width_; ++s) {
      const int32_t page = table_[size_t(seq * table_width_ + s)];
      if (page < 0) continue;
      ++other[size_t(page)];
      if (s >= len_[size_t(seq)] / page_size_) other_writable[size_t(page)] = 1;
    }
  }
  std::vector<char> seen(size_t(num_pages_), 0);
  for (int64_t s = 0; s < n; ++s) {
    const int32_t page = pages[size_t(s)];
    const std::string at = "argument 'pages' entry " + std::to_string(s) + " is page " + std::to_string(page);
    if (page < 0 || page >= num_pages_)
      c.fail(at + ", expected 0 <= page < num_pages = " + std::to_string(num_pages_));
    if (seen[size_t(page)]) c.fail(at + ", which appears earlier in the same table");
    seen[size_t(page)] = 1;
    if (other[size_t(page)] > 0 && s >= full)
      c.fail(at + ", which another sequence uses; a page this sequence may still write (entry >= length / page_size = " +
             std::to_string(full) + ") cannot be shared");
    if (other_writable[size_t(page)])
      c.fail(at + ", which another sequence may still write (it is not full there); only full pages can be shared");
  }
  reset_locked(b);
  for (int64_t s = 0; s < n; ++s) {
    table_[size_t(b * table_width_ + s)] = pages[size_t(s)];
    ++refs_[size_t(pages[size_t(s)])];
  }
  len_[size_t(b)] = length;
}

void KVCache::read(int64_t b, View3<float> k, View3<float> v) const {
  const detail::Checker c{"KVCache::read"};
  check_seq(c.fn.c_str(), b);
  const auto lock = shared();
  const int64_t len = len_[size_t(b)], Hkv = cfg_.kv_heads, E = cfg_.head_dim, Ev = cfg_.value_dim;
  c.require(k, "k");
  c.require(v, "v");
  c.shape(k, "k", {Hkv, len, E}, "(Hkv, length, E) = " + shape_str({Hkv, len, E}));
  c.shape(v, "v", {Hkv, len, Ev}, "(Hkv, length, Ev) = " + shape_str({Hkv, len, Ev}));
  const std::vector<detail::Extent> written{c.extent(k, "k"), c.extent(v, "v")};
  for (const auto& e : written) c.writable(e);
  c.disjoint(written, {});
  read_locked(b, k, v);
}

void KVCache::read_locked(int64_t b, View3<float> k, View3<float> v) const {
  const int64_t len = len_[size_t(b)], Hkv = cfg_.kv_heads, E = cfg_.head_dim, Ev = cfg_.value_dim;
  const auto st = cfg_.dtype;
  std::vector<float> row(size_t(std::max(E, Ev)));
  for (int64_t t = 0; t < len; ++t) {
    const int64_t page = table_[size_t(b * table_width_ + t / page_size_)], off = t % page_size_;
    for (int64_t hk = 0; hk < Hkv; ++hk) {
      const int64_t slot = (page * Hkv + hk) * page_size_ + off;
      detail::widen_from_storage(st, kstore_.data() + slot * E * elem_, E, row.data());
      for (int64_t e = 0; e < E; ++e) k(hk, t, e) = row[size_t(e)];
      detail::widen_from_storage(st, vstore_.data() + slot * Ev * elem_, Ev, row.data());
      for (int64_t e = 0; e < Ev; ++e) v(hk, t, e) = row[size_t(e)];
    }
  }
}

namespace detail {

KVLayout KVCacheAccess::layout(const KVCache& c) {
  KVLayout kv;
  kv.type = c.cfg_.dtype;
  kv.k = c.kstore_.data();
  kv.v = c.vstore_.data();
  kv.page_size = c.page_size_;
  kv.table = c.table_.data();
  kv.table_stride = c.table_width_;
  const int64_t Hkv = c.cfg_.kv_heads, P = c.page_size_;
  kv.k_row = c.cfg_.head_dim;
  kv.k_head = P * kv.k_row;
  kv.k_page = Hkv * kv.k_head;
  kv.v_row = c.cfg_.value_dim;
  kv.v_head = P * kv.v_row;
  kv.v_page = Hkv * kv.v_head;
  return kv;
}

}  // namespace detail

}  // namespace attn
