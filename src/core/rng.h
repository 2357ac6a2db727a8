// Deterministic random numbers that are the same on every platform and compiler
// (std:: distributions are implementation-defined, so dstrain never uses them).
#pragma once

#include <cmath>
#include <cstdint>
#include <string_view>

namespace dstrain {

inline uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// FNV-1a of a string: to derive independent streams from names ("h.3.attn.c_attn.weight").
inline uint64_t hash_name(std::string_view text) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (unsigned char c : text) hash = (hash ^ c) * 0x100000001b3ull;
  return hash;
}

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  Rng(uint64_t seed, uint64_t stream) : state_(seed) {
    uint64_t mix = stream ^ 0x5851f42d4c957f2dull;
    state_ ^= splitmix64(mix);
  }
  uint64_t next_u64() { return splitmix64(state_); }
  // Advances the stream as `draws` calls of next_u64 would (splitmix64 adds a constant per
  // call), so that chunks of one stream can be drawn in parallel.
  void skip(uint64_t draws) { state_ += draws * 0x9e3779b97f4a7c15ull; }
  // Uniform in [0, 1) with 53 bits.
  double uniform() { return static_cast<double>(next_u64() >> 11) * 0x1p-53; }
  // Uniform integer in [0, n). REQUIRES: n > 0. (Multiply-shift; bias < n / 2^64.)
  uint64_t below(uint64_t n) {
    return static_cast<uint64_t>((static_cast<unsigned __int128>(next_u64()) * n) >> 64);
  }
  // Standard normal by Box-Muller (one value per call, the second is dropped for simplicity).
  // Two draws per value, unless the first is 0 (probability 2^-53 a value), which is redrawn.
  double normal() {
    double u1 = uniform();
    while (u1 <= 0.0) u1 = uniform();
    return box_muller(u1, uniform());
  }
  // The normal of two uniforms, u1 in (0, 1): what normal() returns for its draws u1, u2.
  static double box_muller(double u1, double u2) {
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  uint64_t state() const { return state_; }
  void set_state(uint64_t state) { state_ = state; }

 private:
  uint64_t state_;
};

}  // namespace dstrain
