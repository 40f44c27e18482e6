// bfloat16 bit conversions with c10::BFloat16's rounding (nearest even, NaN -> 0x7fc0). Internal
// linkage on purpose: each translation unit, whatever ISA it is compiled for, gets its own copy.
#pragma once

#include <cstdint>

// Scalar helpers marked for both sides where nvcc compiles them (the CUDA kernels share the rules).
#if defined(__CUDACC__)
#define OFFLOAD_EXT_HD __host__ __device__
#else
#define OFFLOAD_EXT_HD
#endif

namespace offload_ext {
namespace {

OFFLOAD_EXT_HD inline uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  __builtin_memcpy(&u, &x, sizeof(u));
  return u;
#endif
}

OFFLOAD_EXT_HD inline uint16_t bf16_round_bits(float x) {
  uint32_t u = float_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN, as c10::BFloat16 does
  u += 0x7fffu + ((u >> 16) & 1u);                      // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

OFFLOAD_EXT_HD inline float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  __builtin_memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

OFFLOAD_EXT_HD inline float bf16_to_float(uint16_t bits) { return bits_float(static_cast<uint32_t>(bits) << 16); }

}  // namespace
}  // namespace offload_ext
