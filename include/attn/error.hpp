// attn/error.hpp — the one exception type the library throws for bad input.
#pragma once

#include <stdexcept>
#include <string>

namespace attn {

// Thrown by every public entry point when an argument is invalid. The message
// names the function, the argument, what it got and what was expected, e.g.
//   "attn::scaled_dot_product_attention: k has shape (1, 3, 5, 8), expected
//    (1, Hkv, S, 8) with Hkv dividing H = 4".
class Error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

}  // namespace attn
