// libFuzzer target for the KV cache's configurations and operation sequences
// (the property is in kv_cache_ops.hpp).
#include "kv_cache_ops.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  attn::fuzz::check_kv_cache(data, size);
  return 0;
}
