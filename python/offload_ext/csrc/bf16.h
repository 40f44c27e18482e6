// bfloat16 bit conversions with c10::BFloat16's rounding (nearest even, NaN -> 0x7fc0). Internal
// linkage on purpose: each translation unit, whatever ISA it is compiled for, gets its own copy.
#pragma once

#include <cstdint>

namespace offload_ext {
namespace {

inline uint16_t bf16_round_bits(float x) {
  uint32_t u;
  __builtin_memcpy(&u, &x, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN, as c10::BFloat16 does
  u += 0x7fffu + ((u >> 16) & 1u);                      // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

inline float bf16_to_float(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  __builtin_memcpy(&f, &u, sizeof(f));
  return f;
}

}  // namespace
}  // namespace offload_ext
