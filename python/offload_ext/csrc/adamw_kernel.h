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
  static F round_bf16(F x) { return bf16_to_float(bf16_round_bits(x)); }
  // Float64 sums of squares, in two accumulators of lanes (one lane each here).
  using D = double;
  static D dzero() { return 0.0; }
  static void add_squares(D& lo, D&, F x) { lo += static_cast<double>(x * x); }
  static double dsum(D lo, D hi) { return lo + hi; }
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
template <class V, bool kAdd>
inline typename V::F load_grad_bf16(const uint16_t* g, const uint16_t* add, int64_t i) {
  if (!kAdd) return V::load_bf16(g + i);
  return V::round_bf16(V::add(V::load_bf16(add + i), V::load_bf16(g + i)));
}

template <class V, bool kAdd, bool kSave>
inline int64_t bf16_loop(const Bf16Pass& a, int64_t i, int64_t n, const AdamWCoef& c) {
  const int64_t pf = c.prefetch;
  for (; i + V::W <= n; i += V::W) {
    if (pf) {
      V::prefetch(a.param_in + i + pf);
      V::prefetch(a.grad + i + pf);
      if (kAdd) V::prefetch(a.grad_add + i + pf);
      V::prefetch(a.exp_avg_in + i + pf);
      V::prefetch(a.exp_avg_sq_in + i + pf);
    }
    auto P = V::load_bf16(a.param_in + i);
    auto M = V::load_bf16(a.exp_avg_in + i);
    auto S = V::load_bf16(a.exp_avg_sq_in + i);
    if (kSave) V::store_bf16(a.param_save + i, P);  // exact: P came from bf16
    adamw_update<V>(P, load_grad_bf16<V, kAdd>(a.grad, a.grad_add, i), M, S, c);
    V::store_bf16(a.param + i, P);
    V::store_bf16(a.exp_avg + i, M);
    V::store_bf16(a.exp_avg_sq + i, S);
  }
  return i;
}

enum OutMode { kNoOut = 0, kStoreOut = 1, kStreamOut = 2 };

template <class V, bool kGradBF16, bool kAdd, int kOut>
inline int64_t fp32_loop(const Fp32Pass& a, int64_t i, int64_t n, const AdamWCoef& c) {
  const int64_t pf = c.prefetch;
  const auto* g16 = static_cast<const uint16_t*>(a.grad);
  const auto* g32 = static_cast<const float*>(a.grad);
  for (; i + V::W <= n; i += V::W) {
    if (pf) {
      V::prefetch(a.param_in + i + pf);
      V::prefetch(a.exp_avg_in + i + pf);
      V::prefetch(a.exp_avg_sq_in + i + pf);
      if (kGradBF16) {
        V::prefetch(g16 + i + pf);
        if (kAdd) V::prefetch(a.grad_add + i + pf);
      } else {
        V::prefetch(g32 + i + pf);
      }
    }
    auto P = V::load_f32(a.param_in + i);
    auto M = V::load_f32(a.exp_avg_in + i);
    auto S = V::load_f32(a.exp_avg_sq_in + i);
    auto G = kGradBF16 ? load_grad_bf16<V, kAdd>(g16, a.grad_add, i) : V::load_f32(g32 + i);
    adamw_update<V>(P, G, M, S, c);
    V::store_f32(a.param + i, P);
    V::store_f32(a.exp_avg + i, M);
    V::store_f32(a.exp_avg_sq + i, S);
    if (kOut == kStoreOut) V::store_bf16(a.param_out + i, P);
    if (kOut == kStreamOut) V::stream_bf16(a.param_out + i, P);
  }
  if (kOut == kStreamOut) V::fence();
  return i;
}

template <class V, bool kAdd, bool kSave>
inline void bf16_span_impl(const Bf16Pass& a, int64_t n, const AdamWCoef& c) {
  const int64_t i = bf16_loop<V, kAdd, kSave>(a, 0, n, c);
  bf16_loop<ScalarVec, kAdd, kSave>(a, i, n, c);
}

template <class V>
inline void bf16_span(const Bf16Pass& a, int64_t n, const AdamWCoef& c) {
  const bool add = a.grad_add != nullptr, save = a.param_save != nullptr;
  if (add && save) {
    bf16_span_impl<V, true, true>(a, n, c);
  } else if (add) {
    bf16_span_impl<V, true, false>(a, n, c);
  } else if (save) {
    bf16_span_impl<V, false, true>(a, n, c);
  } else {
    bf16_span_impl<V, false, false>(a, n, c);
  }
}

template <class V, bool kGradBF16, bool kAdd, int kOut>
inline void fp32_span_impl(const Fp32Pass& a, int64_t n, const AdamWCoef& c) {
  const int64_t i = fp32_loop<V, kGradBF16, kAdd, kOut>(a, 0, n, c);
  fp32_loop<ScalarVec, kGradBF16, kAdd, kOut == kNoOut ? kNoOut : kStoreOut>(a, i, n, c);
}

template <class V, bool kGradBF16, bool kAdd>
inline void fp32_span_out(const Fp32Pass& a, int64_t n, const AdamWCoef& c) {
  // Non-temporal stores need the vector store width's alignment.
  constexpr uintptr_t kOutAlign = V::W * sizeof(uint16_t);
  if (!a.param_out) {
    fp32_span_impl<V, kGradBF16, kAdd, kNoOut>(a, n, c);
  } else if (c.stream_out && reinterpret_cast<uintptr_t>(a.param_out) % kOutAlign == 0) {
    fp32_span_impl<V, kGradBF16, kAdd, kStreamOut>(a, n, c);
  } else {
    fp32_span_impl<V, kGradBF16, kAdd, kStoreOut>(a, n, c);
  }
}

template <class V>
inline void fp32_span(const Fp32Pass& a, int64_t n, const AdamWCoef& c) {
  if (a.grad_type == GradType::kFP32) {
    fp32_span_out<V, false, false>(a, n, c);
  } else if (a.grad_add != nullptr) {
    fp32_span_out<V, true, true>(a, n, c);
  } else {
    fp32_span_out<V, true, false>(a, n, c);
  }
}

template <class V, bool kAdd, bool kNorm>
inline int64_t accumulate_loop(uint16_t* acc, const uint16_t* g, int64_t i, int64_t n, typename V::D& lo,
                               typename V::D& hi) {
  for (; i + V::W <= n; i += V::W) {
    auto A = V::load_bf16(acc + i);
    if (kAdd) {
      A = V::round_bf16(V::add(A, V::load_bf16(g + i)));
      V::store_bf16(acc + i, A);
    }
    if (kNorm) V::add_squares(lo, hi, A);
  }
  return i;
}

template <class V, bool kAdd, bool kNorm>
inline double accumulate_impl(uint16_t* acc, const uint16_t* g, int64_t n) {
  auto lo = V::dzero(), hi = V::dzero();
  const int64_t i = accumulate_loop<V, kAdd, kNorm>(acc, g, 0, n, lo, hi);
  double tail = 0.0, unused = 0.0;
  accumulate_loop<ScalarVec, kAdd, kNorm>(acc, g, i, n, tail, unused);
  return V::dsum(lo, hi) + tail;
}

template <class V>
inline double accumulate_span(uint16_t* acc, const uint16_t* g, int64_t n, bool norm) {
  if (g != nullptr) return norm ? accumulate_impl<V, true, true>(acc, g, n) : accumulate_impl<V, true, false>(acc, g, n);
  return norm ? accumulate_impl<V, false, true>(acc, g, n) : 0.0;
}

}  // namespace
}  // namespace offload_ext

// Defines the exported span entry points of one ISA on top of vector type VEC.
#define OFFLOAD_EXT_DEFINE_SPANS(isa, VEC)                                                     \
  namespace offload_ext {                                                                      \
  void adamw_bf16_span_##isa(const Bf16Pass& pass, int64_t n, const AdamWCoef& c) {            \
    bf16_span<VEC>(pass, n, c);                                                                \
  }                                                                                            \
  void adamw_fp32_span_##isa(const Fp32Pass& pass, int64_t n, const AdamWCoef& c) {            \
    fp32_span<VEC>(pass, n, c);                                                                \
  }                                                                                            \
  double accumulate_span_##isa(uint16_t* accum, const uint16_t* grad, int64_t n, bool norm) {  \
    return accumulate_span<VEC>(accum, grad, n, norm);                                         \
  }                                                                                            \
  }
