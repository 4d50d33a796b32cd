// splitmix64 and the draws built on it (attn/rng.hpp).
#include "attn/rng.hpp"

#include <cmath>
#include <numbers>
#include <string>

#include "attn/error.hpp"

namespace attn {

uint64_t Rng::next() {
  // splitmix64 (Steele, Lea, Flood 2014)
  uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
double Rng::uniform() { return double(next() >> 11) * 0x1.0p-53; }
double Rng::uniform(double a, double b) { return a + (b - a) * uniform(); }
double Rng::normal() {
  const double u1 = 1.0 - uniform();  // (0, 1]: log is finite
  const double u2 = uniform();
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}
int64_t Rng::below(int64_t n) {
  if (n <= 0) throw InvalidArgument("attn::Rng::below: argument 'n' is " + std::to_string(n) + ", expected > 0");
  return int64_t(next() % uint64_t(n));
}

uint64_t derive_seed(uint64_t seed, uint64_t stream) {
  Rng r(seed ^ (0xD1B54A32D192ED03ull * (stream + 1)));
  r.next();
  return r.next();
}

}  // namespace attn
