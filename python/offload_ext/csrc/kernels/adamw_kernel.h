// The AdamW span loops, written once over a vector type V and compiled per ISA by the
// adamw_<isa>.cpp files. Everything here has internal linkage: each ISA's copy stays in its
// own translation unit, so no AVX-512 instance can leak into code that runs on older CPUs.
// The arithmetic follows torch's fused CPU AdamW operation for operation, including where its
// compiler fuses a multiply-add, so results match it bit for bit (the build uses -ffp-contract=off
// so that only the fmas written here exist).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "adamw.h"
#include "adamw_update.h"
#include "bf16.h"
#include "stochastic_rounding.h"

namespace offload_ext {
namespace {

struct ScalarVec {
  using F = float;
  static constexpr int W = 1;
  static F set1(float x) { return x; }
  static F load_f32(const float* p) { return *p; }
  static void store_f32(float* p, F x) { *p = x; }
  static void stream_f32(float* p, F x) { *p = x; }
  static F load_bf16(const uint16_t* p) { return bf16_to_float(*p); }
  static void store_bf16(uint16_t* p, F x) { *p = bf16_round_bits(x); }
  static void stream_bf16(uint16_t* p, F x) { *p = bf16_round_bits(x); }
  static void fence() {}
  static void prefetch(const void*, int) {}
  static F add(F a, F b) { return a + b; }
  static F sub(F a, F b) { return a - b; }
  static F mul(F a, F b) { return a * b; }
  static F div(F a, F b) { return a / b; }
  static F sqrt(F a) { return __builtin_sqrtf(a); }
  static F fmadd(F a, F b, F c) { return __builtin_fmaf(a, b, c); }
  static F round_bf16(F x) { return bf16_to_float(bf16_round_bits(x)); }
  // 32-bit integer lanes for stochastic rounding's random stream, and its rounding (r in [0, 65536)).
  using I = uint32_t;
  static I iset1(uint32_t x) { return x; }
  static I iota(uint32_t base) { return base; }  // base + lane
  static I iadd(I a, I b) { return a + b; }
  static I ixor(I a, I b) { return a ^ b; }
  static I iand(I a, I b) { return a & b; }
  static I imul(I a, I b) { return a * b; }
  template <int k>
  static I shr(I a) { return a >> k; }
  static void store_bf16_sr(uint16_t* p, F x, I r) { *p = bf16_sr_bits(x, r); }
  static void stream_bf16_sr(uint16_t* p, F x, I r) { *p = bf16_sr_bits(x, r); }
  // For the 8-bit loops (adamw8bit_kernel.h): code indices, map and bucket lookups, a search step, NaN lanes,
  // the bits of floats and of their magnitudes.
  static I load_u8(const uint8_t* p) { return *p; }
  static void store_u8(uint8_t* p, I x) { *p = static_cast<uint8_t>(x); }
  static F gather(const float* table, I i) { return table[i]; }
  static F lookup256(const float* table, I i) { return table[i]; }  // a table of 256
  static I gather_u8(const uint8_t* table, I i) { return table[i]; }
  static I bits(F x) { return float_bits(x); }
  static I where_nan(I a, F x, uint32_t k) { return x != x ? k : a; }
  static I add_where_not_ge(I a, F x, F y, uint32_t k) { return x >= y ? a : a + k; }  // a + k where !(x >= y)
  static I abs_bits(F x) { return float_bits(x) & 0x7fffffffu; }
  static I imax(I a, I b) { return a > b ? a : b; }
  static constexpr bool kLinearEncode = false;
  static constexpr bool kByteDecode = false;
  static void store_i(uint32_t* p, I x) { *p = x; }
  // Float64 sums of squares, in two accumulators of lanes (one lane each here). Each square is taken in float64:
  // exact for a bf16 or an fp32 value, and finite (a bf16 value over 2^64 squared overflows a float).
  using D = double;
  static D dzero() { return 0.0; }
  static void add_squares(D& lo, D&, F x) { lo += static_cast<double>(x) * static_cast<double>(x); }
  static constexpr int DW = 1;
  static void store_d(double* p, D x) { *p = x; }
};

// Each loop runs whole vectors from `i` and returns where it stopped; the scalar instance
// finishes the tail with identical arithmetic.
// What the step does to the gradient it reads: nothing, add the accumulator (bf16(accum + grad): the
// last micro-batch), or scale it (bf16(grad * scale): clipping), each rounded once as torch does.
enum GradMode { kGradPlain = 0, kGradAdd = 1, kGradScale = 2 };

template <class V, int kGrad>
inline typename V::F load_grad_bf16(const uint16_t* g, const uint16_t* add, float scale, int64_t i) {
  if (kGrad == kGradAdd) return V::round_bf16(V::add(V::load_bf16(add + i), V::load_bf16(g + i)));
  if (kGrad == kGradScale) return V::round_bf16(V::mul(V::load_bf16(g + i), V::set1(scale)));
  return V::load_bf16(g + i);
}

// An fp32 gradient as the step reads it: as stored, or fp32(grad * scale) (clipping), as torch's in-place
// multiply of an fp32 .grad rounds it.
template <class V, int kGrad>
inline typename V::F load_grad_f32(const float* g, float scale, int64_t i) {
  if (kGrad == kGradScale) return V::mul(V::load_f32(g + i), V::set1(scale));
  return V::load_f32(g + i);
}

// Stores to a buffer other than the one read (a pass out of place) bypass the cache when kStream: the
// line is not read for ownership first, and the next pass over it comes a whole step later.
template <class V, bool kStream>
inline void put_bf16(uint16_t* p, typename V::F x) {
  kStream ? V::stream_bf16(p, x) : V::store_bf16(p, x);
}
template <class V, bool kStream>
inline void put_f32(float* p, typename V::F x) {
  kStream ? V::stream_f32(p, x) : V::store_f32(p, x);
}
template <class V, bool kStream>
inline void put_bf16_sr(uint16_t* p, typename V::F x, typename V::I r) {
  kStream ? V::stream_bf16_sr(p, x, r) : V::store_bf16_sr(p, x, r);
}

// Which stores a pass makes (adamw.h's Parts, as a template argument).
constexpr int kAllParts = static_cast<int>(Parts::kAll);
constexpr int kParamsPart = static_cast<int>(Parts::kParams);
constexpr int kMomentsPart = static_cast<int>(Parts::kMoments);
constexpr bool stores_param(int parts) { return parts != kMomentsPart; }
constexpr bool stores_moments(int parts) { return parts != kParamsPart; }

// The stores of a bf16 pass at element i (those of `kParts`): to nearest even, or (kSR) param and exp_avg_sq
// by stochastic_rounding.h's rule, `counter` holding the hash inputs of elements i .. i + W - 1.
template <class V, bool kStream, bool kSR, int kParts>
inline void store_state_bf16(const Bf16Pass& a, int64_t i, typename V::I counter, typename V::F P, typename V::F M,
                             typename V::F S) {
  if (!kSR) {
    if (stores_param(kParts)) put_bf16<V, kStream>(a.param + i, P);
    if (stores_moments(kParts)) {
      put_bf16<V, kStream>(a.exp_avg + i, M);
      put_bf16<V, kStream>(a.exp_avg_sq + i, S);
    }
    return;
  }
  const auto word = sr_hash32<V>(counter);
  if (stores_param(kParts)) put_bf16_sr<V, kStream>(a.param + i, P, V::iand(word, V::iset1(0xffffu)));
  if (stores_moments(kParts)) {
    put_bf16<V, kStream>(a.exp_avg + i, M);
    put_bf16_sr<V, kStream>(a.exp_avg_sq + i, S, V::template shr<16>(word));
  }
}

template <class V, int kGrad, bool kStream, bool kSR, int kParts>
inline int64_t bf16_loop(const Bf16Pass& a, int64_t i, int64_t n, const AdamWCoef& c) {
  const int64_t pf = c.prefetch;
  const int lvl = c.prefetch_level;
  // Stochastic rounding's hash inputs, uint32(index) + uint32(K) (stochastic_rounding.h), counted along.
  auto counter = V::iota(c.sr_key + c.sr_index + static_cast<uint32_t>(i));
  for (; i + V::W <= n; i += V::W, counter = V::iadd(counter, V::iset1(V::W))) {
    if (pf) {
      if (stores_param(kParts)) V::prefetch(a.param_in + i + pf, lvl);
      V::prefetch(a.grad + i + pf, lvl);
      if (kGrad == kGradAdd) V::prefetch(a.grad_add + i + pf, lvl);
      V::prefetch(a.exp_avg_in + i + pf, lvl);
      V::prefetch(a.exp_avg_sq_in + i + pf, lvl);
    }
    // The moments never depend on the param: a moments pass does not read it (its update is dead code).
    auto P = stores_param(kParts) ? V::load_bf16(a.param_in + i) : V::set1(0.0f);
    auto M = V::load_bf16(a.exp_avg_in + i);
    auto S = V::load_bf16(a.exp_avg_sq_in + i);
    adamw_update<V>(P, load_grad_bf16<V, kGrad>(a.grad, a.grad_add, a.grad_scale, i), M, S, c);
    store_state_bf16<V, kStream, kSR, kParts>(a, i, counter, P, M, S);
  }
  if (kStream) V::fence();
  return i;
}

enum OutMode { kNoOut = 0, kStoreOut = 1, kStreamOut = 2 };

template <class V, bool kGradBF16, int kGrad, int kOut, bool kStream, int kParts>
inline int64_t fp32_loop(const Fp32Pass& a, int64_t i, int64_t n, const AdamWCoef& c) {
  const int64_t pf = c.prefetch;
  const int lvl = c.prefetch_level;
  const auto* g16 = static_cast<const uint16_t*>(a.grad);
  const auto* g32 = static_cast<const float*>(a.grad);
  for (; i + V::W <= n; i += V::W) {
    if (pf) {
      if (stores_param(kParts)) V::prefetch(a.param_in + i + pf, lvl);
      V::prefetch(a.exp_avg_in + i + pf, lvl);
      V::prefetch(a.exp_avg_sq_in + i + pf, lvl);
      if (kGradBF16) {
        V::prefetch(g16 + i + pf, lvl);
        if (kGrad == kGradAdd) V::prefetch(a.grad_add + i + pf, lvl);
      } else {
        V::prefetch(g32 + i + pf, lvl);
      }
    }
    auto P = stores_param(kParts) ? V::load_f32(a.param_in + i) : V::set1(0.0f);
    auto M = V::load_f32(a.exp_avg_in + i);
    auto S = V::load_f32(a.exp_avg_sq_in + i);
    auto G = kGradBF16 ? load_grad_bf16<V, kGrad>(g16, a.grad_add, a.grad_scale, i)
                       : load_grad_f32<V, kGrad>(g32, a.grad_scale, i);
    adamw_update<V>(P, G, M, S, c);
    if (stores_param(kParts)) {
      put_f32<V, kStream>(a.param + i, P);
      if (kOut == kStoreOut) V::store_bf16(a.param_out + i, P);
      if (kOut == kStreamOut) V::stream_bf16(a.param_out + i, P);
    }
    if (stores_moments(kParts)) {
      put_f32<V, kStream>(a.exp_avg + i, M);
      put_f32<V, kStream>(a.exp_avg_sq + i, S);
    }
  }
  if (kOut == kStreamOut || kStream) V::fence();
  return i;
}

// Elements before `p` reaches an `align`-byte boundary (n if it never does within n).
inline int64_t head_elements(const void* p, size_t elem, size_t align, int64_t n) {
  const uintptr_t mis = reinterpret_cast<uintptr_t>(p) % align;
  if (mis == 0) return 0;
  if ((align - mis) % elem) return n;
  return std::min<int64_t>(n, static_cast<int64_t>((align - mis) / elem));
}

inline bool aligned(const void* p, size_t align) { return reinterpret_cast<uintptr_t>(p) % align == 0; }

template <class V, int kGrad, bool kSR, int kParts>
inline void bf16_span_mode(const Bf16Pass& a, int64_t n, const AdamWCoef& c) {
  // Out of place (every output in a buffer other than its input), streamed once the stores are
  // vector-aligned.
  constexpr size_t kA = V::W * sizeof(uint16_t);
  const bool out_of_place = a.exp_avg != a.exp_avg_in && a.param != a.param_in;
  const int64_t h = out_of_place ? head_elements(a.exp_avg, sizeof(uint16_t), kA, n) : 0;
  const bool stream = c.stream_out && out_of_place && V::W > 1 && h < n && aligned(a.exp_avg_sq + h, kA) &&
                      aligned(a.param + h, kA);
  if (!stream) {
    const int64_t i = bf16_loop<V, kGrad, false, kSR, kParts>(a, 0, n, c);
    bf16_loop<ScalarVec, kGrad, false, kSR, kParts>(a, i, n, c);
    return;
  }
  bf16_loop<ScalarVec, kGrad, false, kSR, kParts>(a, 0, h, c);
  const int64_t i = bf16_loop<V, kGrad, true, kSR, kParts>(a, h, n, c);
  bf16_loop<ScalarVec, kGrad, false, kSR, kParts>(a, i, n, c);
}

// Calls fn(std::integral_constant<int, parts>) for the pass's Parts: one instance per kind of stores. A pass in
// two parts is a step after the norm, never one summing micro-batches (kGradAdd) or reading an fp32 gradient.
template <class Fn>
inline void with_parts(Parts parts, const Fn& fn) {
  switch (parts) {
    case Parts::kParams: return fn(std::integral_constant<int, kParamsPart>{});
    case Parts::kMoments: return fn(std::integral_constant<int, kMomentsPart>{});
    case Parts::kAll: break;
  }
  fn(std::integral_constant<int, kAllParts>{});
}

template <class V, int kGrad, bool kSR>
inline void bf16_span_parts(const Bf16Pass& a, int64_t n, const AdamWCoef& c) {
  with_parts(a.parts, [&](auto parts) { bf16_span_mode<V, kGrad, kSR, decltype(parts)::value>(a, n, c); });
}

template <class V, bool kSR>
inline void bf16_span_rounded(const Bf16Pass& a, int64_t n, const AdamWCoef& c) {
  if (a.grad_add != nullptr) {
    bf16_span_mode<V, kGradAdd, kSR, kAllParts>(a, n, c);
  } else if (a.grad_scale != 1.0f) {
    bf16_span_parts<V, kGradScale, kSR>(a, n, c);
  } else {
    bf16_span_parts<V, kGradPlain, kSR>(a, n, c);
  }
}

template <class V>
inline void bf16_span(const Bf16Pass& a, int64_t n, const AdamWCoef& c) {
  c.stochastic ? bf16_span_rounded<V, true>(a, n, c) : bf16_span_rounded<V, false>(a, n, c);
}

template <class V, bool kGradBF16, int kGrad, int kOut, int kParts>
inline void fp32_span_impl(const Fp32Pass& a, int64_t n, const AdamWCoef& c) {
  constexpr int kTailOut = kOut == kNoOut ? kNoOut : kStoreOut;
  constexpr size_t kA = V::W * sizeof(float);
  const bool out_of_place = a.exp_avg != a.exp_avg_in;
  const int64_t h = out_of_place ? head_elements(a.exp_avg, sizeof(float), kA, n) : 0;
  const bool stream = c.stream_out && out_of_place && V::W > 1 && h < n && aligned(a.exp_avg_sq + h, kA) &&
                      aligned(a.param + h, kA) &&
                      (kOut != kStreamOut || aligned(a.param_out + h, V::W * sizeof(uint16_t)));
  if (!stream) {
    const int64_t i = fp32_loop<V, kGradBF16, kGrad, kOut, false, kParts>(a, 0, n, c);
    fp32_loop<ScalarVec, kGradBF16, kGrad, kTailOut, false, kParts>(a, i, n, c);
    return;
  }
  fp32_loop<ScalarVec, kGradBF16, kGrad, kTailOut, false, kParts>(a, 0, h, c);
  const int64_t i = fp32_loop<V, kGradBF16, kGrad, kOut, true, kParts>(a, h, n, c);
  fp32_loop<ScalarVec, kGradBF16, kGrad, kTailOut, false, kParts>(a, i, n, c);
}

template <class V, bool kGradBF16, int kGrad, int kParts>
inline void fp32_span_out(const Fp32Pass& a, int64_t n, const AdamWCoef& c) {
  // Non-temporal stores need the vector store width's alignment.
  constexpr uintptr_t kOutAlign = V::W * sizeof(uint16_t);
  if (!a.param_out || !stores_param(kParts)) {
    fp32_span_impl<V, kGradBF16, kGrad, kNoOut, kParts>(a, n, c);
  } else if (c.stream_out && reinterpret_cast<uintptr_t>(a.param_out) % kOutAlign == 0) {
    fp32_span_impl<V, kGradBF16, kGrad, kStreamOut, kParts>(a, n, c);
  } else {
    fp32_span_impl<V, kGradBF16, kGrad, kStoreOut, kParts>(a, n, c);
  }
}

template <class V, int kGrad>
inline void fp32_span_parts(const Fp32Pass& a, int64_t n, const AdamWCoef& c) {
  with_parts(a.parts, [&](auto parts) { fp32_span_out<V, true, kGrad, decltype(parts)::value>(a, n, c); });
}

template <class V>
inline void fp32_span(const Fp32Pass& a, int64_t n, const AdamWCoef& c) {
  if (a.grad_type == GradType::kFP32) {
    a.grad_scale != 1.0f ? fp32_span_out<V, false, kGradScale, kAllParts>(a, n, c)
                         : fp32_span_out<V, false, kGradPlain, kAllParts>(a, n, c);
  } else if (a.grad_add != nullptr) {
    fp32_span_out<V, true, kGradAdd, kAllParts>(a, n, c);
  } else if (a.grad_scale != 1.0f) {
    fp32_span_parts<V, kGradScale>(a, n, c);
  } else {
    fp32_span_parts<V, kGradPlain>(a, n, c);
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

// The lanes of both accumulators summed in a fixed order.
template <class V>
inline double dsum(typename V::D lo, typename V::D hi) {
  double l[V::DW], h[V::DW];
  V::store_d(l, lo);
  V::store_d(h, hi);
  double s = 0.0;
  for (int k = 0; k < V::DW; ++k) s += l[k] + h[k];
  return s;
}

template <class V, bool kAdd, bool kNorm>
inline double accumulate_impl(uint16_t* acc, const uint16_t* g, int64_t n) {
  auto lo = V::dzero(), hi = V::dzero();
  const int64_t i = accumulate_loop<V, kAdd, kNorm>(acc, g, 0, n, lo, hi);
  double tail = 0.0, unused = 0.0;
  accumulate_loop<ScalarVec, kAdd, kNorm>(acc, g, i, n, tail, unused);
  return dsum<V>(lo, hi) + tail;
}

// An fp32 span's float64 sum of squares.
template <class V>
inline double squares_f32_span(const float* x, int64_t n) {
  auto lo = V::dzero(), hi = V::dzero();
  int64_t i = 0;
  for (; i + V::W <= n; i += V::W) V::add_squares(lo, hi, V::load_f32(x + i));
  double tail = 0.0, unused = 0.0;
  for (; i < n; ++i) ScalarVec::add_squares(tail, unused, x[i]);
  return dsum<V>(lo, hi) + tail;
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
  double squares_f32_span_##isa(const float* x, int64_t n) { return squares_f32_span<VEC>(x, n); } \
  }
