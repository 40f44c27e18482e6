// Stochastic rounding to bf16 (precision "bf16-sr"): the rule and its random stream, defined here once.
// The kernel (adamw_kernel.h) vectorises it; the sr_round_bf16 op (sr_round.cpp, sr_round_cuda.cu) applies
// it per element from fp32 results, on the CPU and on CUDA; offload_ext/stochastic_rounding.py is the same
// rule in integer torch ops, bit for bit. Internal linkage, as bf16.h: each ISA's translation unit has its copy.
//
// The rule. x is the fp32 result of the AdamW update, the same fp32 arithmetic as "bf16" (adamw_update).
// param and exp_avg_sq are stored as (bits(x) + r) >> 16 with r a uniform integer in [0, 65536): x moves
// away from zero to the next bf16 with probability (its low 16 bits) / 65536, so the stored value equals
// x in expectation. NaN is stored as 0x7fc0, as round-to-nearest stores it; an infinity stays one (its low
// bits are zero: no carry); a finite x past the largest bf16 rounds to the infinity of its sign with the
// probability its distance gives. exp_avg is rounded to nearest even, as in "bf16".
// Why those two: they are the ones round-to-nearest freezes. An update under half a bf16 ulp of the
// parameter never moves it (Adam's steps are about lr: lr 1e-5 on weights near 1, whose half ulp is
// 2^-8). With beta2 = 0.999, exp_avg_sq moves by 1e-3 of (grad^2 - itself) a step: a fall is at most
// 1e-3 of it, under its half ulp (at least 2^-9 of it), so it never decays, and it rises only when
// grad^2 passes ~3x it. exp_avg moves a tenth of the way to the gradient a step (beta1 = 0.9): it
// stalls only within ~2 % of it, and the error stays that small. One 32-bit hash word per element
// serves both; a second word for exp_avg made the kernel 20 % slower than "bf16" on one thread, one
// word 2-5 % with AVX-512, 11 % with AVX2 (bench_adamw --scale 0.05 --threads 1 on a shared 2-core
// host: benchmarks/results/2026-12-01_e10a34d and 2026-12-01_e370bf3).
//
// The stream. Each element draws one 32-bit word A at each step, a counter-based hash of
// (seed, stream, step, index), index being its position in its stream (an engine unit, a CPUAdamW
// parameter, a device-kept parameter):
//   K = mix64(mix64(mix64(mix64(seed) ^ stream) ^ step) ^ (index >> 32))
//   A = hash32(uint32(index) + uint32(K)),   r_param = A & 0xffff,   r_exp_avg_sq = A >> 16
// mix64 is splitmix64's step (add 0x9e3779b97f4a7c15, then its finalizer), hash32 the "lowbias32"
// integer hash (C. Wellons' hash-prospector). All arithmetic wraps (uint64, uint32). Nothing else
// enters: the bits do not depend on threads, slices, the ISA or the order units are stepped in, and a
// step redone from preserved state draws what it drew the first time.
#pragma once

#include <cstdint>

#include "bf16.h"

namespace offload_ext {
namespace {

OFFLOAD_EXT_HD inline uint64_t sr_mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// K of the rule for the elements whose index >> 32 is `high`.
OFFLOAD_EXT_HD inline uint64_t sr_key(uint64_t seed, uint64_t stream, int64_t step, uint64_t high) {
  return sr_mix64(sr_mix64(sr_mix64(sr_mix64(seed) ^ stream) ^ static_cast<uint64_t>(step)) ^ high);
}

// hash32 of the rule over V's 32-bit integer lanes (V::I), for every vector type of the kernel.
template <class V>
inline typename V::I sr_hash32(typename V::I x) {
  x = V::ixor(x, V::template shr<16>(x));
  x = V::imul(x, V::iset1(0x7feb352du));
  x = V::ixor(x, V::template shr<15>(x));
  x = V::imul(x, V::iset1(0x846ca68bu));
  return V::ixor(x, V::template shr<16>(x));
}

// hash32 of the rule on one word: sr_hash32's lanes one at a time.
OFFLOAD_EXT_HD inline uint32_t sr_hash32_word(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  return x ^ (x >> 16);
}

// The rule's rounding of one float with r in [0, 65536).
OFFLOAD_EXT_HD inline uint16_t bf16_sr_bits(float x, uint32_t r) {
  const uint32_t u = float_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return static_cast<uint16_t>((u + r) >> 16);
}

// One element's stores under the rule, from the fp32 results of its AdamW update and its word A (the
// element's index i in its stream: A = sr_hash32_word(uint32(i) + uint32(K))).
OFFLOAD_EXT_HD inline void sr_store(float param, float exp_avg, float exp_avg_sq, uint32_t word, uint16_t* param_out,
                                    uint16_t* exp_avg_out, uint16_t* exp_avg_sq_out) {
  *param_out = bf16_sr_bits(param, word & 0xffffu);
  *exp_avg_out = bf16_round_bits(exp_avg);
  *exp_avg_sq_out = bf16_sr_bits(exp_avg_sq, word >> 16);
}

}  // namespace
}  // namespace offload_ext
