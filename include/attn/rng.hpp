// attn/rng.hpp — the one random generator of the library: parameter
// initialisation (attn::MultiheadAttention, the attn::nn layers) and the
// synthetic tasks' data all draw from it.
#pragma once

#include <cstdint>

namespace attn {

// A small counter-based generator (splitmix64): the same seed gives the same
// numbers on every platform and standard library, which the std::
// distributions do not promise. Normals come from Box–Muller.
class Rng {
 public:
  explicit Rng(uint64_t seed = 0) : state_(seed) {}
  uint64_t next();
  double uniform();                  // [0, 1), from the top 53 bits
  double uniform(double a, double b);
  double normal();                   // N(0, 1)
  int64_t below(int64_t n);          // uniform integer in [0, n)
  uint64_t state() const { return state_; }

 private:
  uint64_t state_;
};

// Seed of an independent stream `stream` derived from `seed` (for per-step
// data, per-layer init, ...).
uint64_t derive_seed(uint64_t seed, uint64_t stream);

}  // namespace attn
