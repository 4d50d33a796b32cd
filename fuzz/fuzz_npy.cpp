// libFuzzer target for the .npy reader (the property is in checks.hpp).
#include "checks.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  attn::fuzz::check_npy(data, size);
  return 0;
}
