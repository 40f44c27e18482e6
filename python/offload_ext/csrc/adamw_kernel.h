// The AdamW span loops, written once over a vector type V and compiled per ISA by the
// adamw_<isa>.cpp files. Everything here has internal linkage: each ISA's copy stays in its
// own translation unit, so no AVX-512 instance can leak into code that runs on older CPUs.
// The arithmetic follows torch's fused CPU AdamW operation for operation, including where its
// compiler fuses a multiply-add, so results match it bit for bit (the build uses -ffp-contract=off
// so that only the fmas written here exist).
#pragma once

#include <cstdint>

#include "adamw.h"
#include "bf16.h"

namespace offload_ext {
namespace {

struct ScalarVec {
  using F = float;
  static constexpr int W = 1;
  static F set1(float x) { return x; }
  static F load_f32(const float* p) { return *p; }
  static void store_f32(float* p, F x) { *p = x; }
  static F load_bf16(const uint16_t* p) { return bf16_to_float(*p); }
  static void store_bf16(uint16_t* p, F x) { *p = bf16_round_bits(x); }
  static void stream_bf16(uint16_t* p, F x) { *p = bf16_round_bits(x); }
  static void fence() {}
  static void prefetch(const void*) {}
  static F add(F a, F b) { return a + b; }
  static F sub(F a, F b) { return a - b; }
  static F mul(F a, F b) { return a * b; }
  static F div(F a, F b) { return a / b; }
  static F sqrt(F a) { return __builtin_sqrtf(a); }
  static F fmadd(F a, F b, F c) { return __builtin_fmaf(a, b, c); }
};

template <class V>
inline void adamw_update(typename V::F& p, typename V::F g, typename V::F& m, typename V::F& v,
                         const AdamWCoef& c) {
  using F = typename V::F;
  if (c.apply_decay) p = V::mul(p, V::set1(c.decay));
  const F base = c.lerp_from_grad ? g : m;
  m = V::fmadd(V::set1(c.lerp_coef), V::sub(g, m), base);
  // torch's build contracts `v * beta2 + (1 - beta2) * g * g` into this one fma; matching it keeps
  // exp_avg_sq bit-identical to torch's fused AdamW.
  v = V::fmadd(V::mul(V::set1(c.one_minus_beta2), g), g, V::mul(v, V::set1(c.beta2)));
  const F denom = V::add(V::div(V::sqrt(v), V::set1(c.bias_correction2_sqrt)), V::set1(c.eps));
  p = V::add(p, V::div(V::mul(V::set1(c.neg_step_size), m), denom));
}

// Each loop runs whole vectors from `i` and returns where it stopped; the scalar instance
// finishes the tail with identical arithmetic.
template <class V>
inline int64_t bf16_loop(uint16_t* p, const uint16_t* g, uint16_t* m, uint16_t* v, int64_t i, int64_t n,
                         const AdamWCoef& c) {
  const int64_t pf = c.prefetch;
  for (; i + V::W <= n; i += V::W) {
    if (pf) {
      V::prefetch(p + i + pf);
      V::prefetch(g + i + pf);
      V::prefetch(m + i + pf);
      V::prefetch(v + i + pf);
    }
    auto P = V::load_bf16(p + i);
    auto M = V::load_bf16(m + i);
    auto S = V::load_bf16(v + i);
    adamw_update<V>(P, V::load_bf16(g + i), M, S, c);
    V::store_bf16(p + i, P);
    V::store_bf16(m + i, M);
    V::store_bf16(v + i, S);
  }
  return i;
}

enum OutMode { kNoOut = 0, kStoreOut = 1, kStreamOut = 2 };

template <class V, bool kGradBF16, int kOut>
inline int64_t fp32_loop(float* p, const void* g, float* m, float* v, uint16_t* out, int64_t i, int64_t n,
                         const AdamWCoef& c) {
  const int64_t pf = c.prefetch;
  for (; i + V::W <= n; i += V::W) {
    if (pf) {
      V::prefetch(p + i + pf);
      V::prefetch(m + i + pf);
      V::prefetch(v + i + pf);
      if (kGradBF16) {
        V::prefetch(static_cast<const uint16_t*>(g) + i + pf);
      } else {
        V::prefetch(static_cast<const float*>(g) + i + pf);
      }
    }
    auto P = V::load_f32(p + i);
    auto M = V::load_f32(m + i);
    auto S = V::load_f32(v + i);
    auto G = kGradBF16 ? V::load_bf16(static_cast<const uint16_t*>(g) + i)
                       : V::load_f32(static_cast<const float*>(g) + i);
    adamw_update<V>(P, G, M, S, c);
    V::store_f32(p + i, P);
    V::store_f32(m + i, M);
    V::store_f32(v + i, S);
    if (kOut == kStoreOut) V::store_bf16(out + i, P);
    if (kOut == kStreamOut) V::stream_bf16(out + i, P);
  }
  if (kOut == kStreamOut) V::fence();
  return i;
}

template <class V>
inline void bf16_span(uint16_t* p, const uint16_t* g, uint16_t* m, uint16_t* v, int64_t n, const AdamWCoef& c) {
  const int64_t i = bf16_loop<V>(p, g, m, v, 0, n, c);
  bf16_loop<ScalarVec>(p, g, m, v, i, n, c);
}

template <class V, bool kGradBF16, int kOut>
inline void fp32_span_impl(float* p, const void* g, float* m, float* v, uint16_t* out, int64_t n,
                           const AdamWCoef& c) {
  const int64_t i = fp32_loop<V, kGradBF16, kOut>(p, g, m, v, out, 0, n, c);
  fp32_loop<ScalarVec, kGradBF16, kOut == kNoOut ? kNoOut : kStoreOut>(p, g, m, v, out, i, n, c);
}

template <class V, bool kGradBF16>
inline void fp32_span_out(float* p, const void* g, float* m, float* v, uint16_t* out, int64_t n,
                          const AdamWCoef& c) {
  // Non-temporal stores need the vector store width's alignment.
  constexpr uintptr_t kOutAlign = V::W * sizeof(uint16_t);
  if (!out) {
    fp32_span_impl<V, kGradBF16, kNoOut>(p, g, m, v, out, n, c);
  } else if (c.stream_out && reinterpret_cast<uintptr_t>(out) % kOutAlign == 0) {
    fp32_span_impl<V, kGradBF16, kStreamOut>(p, g, m, v, out, n, c);
  } else {
    fp32_span_impl<V, kGradBF16, kStoreOut>(p, g, m, v, out, n, c);
  }
}

template <class V>
inline void fp32_span(float* p, const void* g, GradType gt, float* m, float* v, uint16_t* out, int64_t n,
                      const AdamWCoef& c) {
  if (gt == GradType::kBF16) {
    fp32_span_out<V, true>(p, g, m, v, out, n, c);
  } else {
    fp32_span_out<V, false>(p, g, m, v, out, n, c);
  }
}

}  // namespace
}  // namespace offload_ext

// Defines the two exported span entry points of one ISA on top of vector type VEC.
#define OFFLOAD_EXT_DEFINE_SPANS(isa, VEC)                                                              \
  namespace offload_ext {                                                                               \
  void adamw_bf16_span_##isa(uint16_t* p, const uint16_t* g, uint16_t* m, uint16_t* v, int64_t n,       \
                             const AdamWCoef& c) {                                                      \
    bf16_span<VEC>(p, g, m, v, n, c);                                                                   \
  }                                                                                                     \
  void adamw_fp32_span_##isa(float* p, const void* g, GradType gt, float* m, float* v, uint16_t* out,  \
                             int64_t n, const AdamWCoef& c) {                                           \
    fp32_span<VEC>(p, g, gt, m, v, out, n, c);                                                          \
  }                                                                                                     \
  }
