// The 8-bit AdamW block loops, written once over a vector type V and compiled per ISA by the adamw_<isa>.cpp
// files beside the bf16 loops (adamw_kernel.h, whose vector types they share). Each block is decoded, stepped
// and its moments kept in fp32 on the stack, then re-encoded against the block's new absmax: two passes over
// 2 KiB that stays in L1. Every operation is the reference's (offload_ext/optim/eight_bit.py) in the same
// order, and the build's -ffp-contract=off keeps it so.
#pragma once

#include <algorithm>
#include <cstdint>

#include "adamw8bit.h"
#include "adamw_kernel.h"
#include "adamw_update.h"
#include "stochastic_rounding.h"

namespace offload_ext {
namespace {

inline float float_of_bits(uint32_t u) {
  float f;
  __builtin_memcpy(&f, &u, sizeof(f));
  return f;
}

// The gradient at element e: fp32 as it is, bf16 by the pass's GradMode (adamw_kernel.h: plain, + grad_add, or
// * grad_scale, each rounded to bf16 once).
template <class V, int kGrad>
inline typename V::F grad_at(const float* g, const EightBitPass&, int64_t e) {
  return V::load_f32(g + e);
}
template <class V, int kGrad>
inline typename V::F grad_at(const uint16_t* g, const EightBitPass& a, int64_t e) {
  return load_grad_bf16<V, kGrad>(g, a.grad_add, a.grad_scale, e);
}

// The rule's index of x: how many of the 255 sorted midpoints fail mid >= x (a NaN fails them all). A branchless
// binary search: the steps add up to 255 and the highest midpoint read is mid[254].
template <class V>
inline typename V::I searched_code(const float* mid, typename V::F x) {
  auto q = V::iset1(0);
  for (uint32_t step = 128; step != 0; step >>= 1) q = V::add_where_not_ge(q, V::gather(mid + step - 1, q), x, step);
  return q;
}

// The same index from x's bucket (MapTables): the midpoints below it, and the one that may lie within it.
template <class V>
inline typename V::I bucketed_code(const MapTables& t, typename V::F x) {
  auto q = V::gather_u8(t.below, V::template shr<16>(V::bits(x)));
  q = V::add_where_not_ge(q, V::gather(t.mid, q), x, 1);
  return V::where_nan(q, x, kCodes - 1);
}

// A moment of elements e.. (i.. of the block): code[q] * absmax, decoded here or (kDecoded) already in `decoded`.
template <class V, bool kDecoded>
inline typename V::F moment_at(const float* decoded, const float* code, const uint8_t* q, float absmax, int64_t i,
                               int64_t e) {
  if constexpr (kDecoded) {
    return V::load_f32(decoded + i);
  } else {
    return V::mul(V::lookup256(code, V::load_u8(q + e)), V::set1(absmax));
  }
}

// Elements [i, end) of the block at element `at`, as many whole vectors as fit: decode (from `in`, unless
// kDecoded: m and v hold the decoded moments), update, store the param (kParts permitting), keep the moments in m,
// v (indexed from the block's start) and their largest magnitudes' bits in max_m, max_v. `counter` is stochastic
// rounding's hash input of element i.
template <class V, bool kDecoded, bool kSR, int kGrad, int kParts, class G>
inline int64_t update_loop(const EightBitPass& a, const EightBitState& in, const G* grad, int64_t at, int64_t i,
                           int64_t end, uint32_t counter, float absmax_m, float absmax_v, float* m, float* v,
                           typename V::I& max_m, typename V::I& max_v, const AdamWCoef& c) {
  for (; i + V::W <= end; i += V::W, counter += V::W) {
    const int64_t e = at + i;
    auto P = V::load_bf16(in.param + e);
    auto M = moment_at<V, kDecoded>(m, a.exp_avg_code, in.exp_avg, absmax_m, i, e);
    auto S = moment_at<V, kDecoded>(v, a.exp_avg_sq_code, in.exp_avg_sq, absmax_v, i, e);
    adamw_update<V>(P, grad_at<V, kGrad>(grad, a, e), M, S, c);
    if constexpr (stores_param(kParts)) {
      if (kSR) {
        V::store_bf16_sr(a.param + e, P, V::iand(sr_hash32<V>(V::iota(counter)), V::iset1(0xffffu)));
      } else {
        V::store_bf16(a.param + e, P);
      }
    }
    if constexpr (stores_moments(kParts)) {
      V::store_f32(m + i, M);
      V::store_f32(v + i, S);
      max_m = V::imax(max_m, V::abs_bits(M));
      max_v = V::imax(max_v, V::abs_bits(S));
    }
  }
  return i;
}

// One block between its two passes: its fp32 moments, and their largest magnitudes' bits so far in V's lanes
// and in the scalar tail's (set by step_block: a vector member initializer would build outside the ISA's target).
template <class V>
struct BlockMoments {
  float m[kBlock];
  float v[kBlock];
  typename V::I max_m;
  typename V::I max_v;
  uint32_t tail_max_m;
  uint32_t tail_max_v;
};

// The block's first pass over [i, end), all under one stochastic rounding key: whole vectors, then the rest.
template <class V, bool kSR, int kGrad, int kParts, class G>
inline void update_range(const EightBitPass& a, const EightBitState& in, const G* grad, int64_t at, int64_t i,
                         int64_t end, uint32_t counter, float absmax_m, float absmax_v, BlockMoments<V>& out,
                         const AdamWCoef& c) {
  constexpr bool kDecoded = V::kByteDecode;
  const int64_t j = update_loop<V, kDecoded, kSR, kGrad, kParts>(a, in, grad, at, i, end, counter, absmax_m,
                                                                 absmax_v, out.m, out.v, out.max_m, out.max_v, c);
  update_loop<ScalarVec, kDecoded, kSR, kGrad, kParts>(a, in, grad, at, j, end,
                                                       counter + static_cast<uint32_t>(j - i), absmax_m, absmax_v,
                                                       out.m, out.v, out.tail_max_m, out.tail_max_v, c);
}

// A block's n moments decoded into `out`: 64 at a time by V's byte decoder, the rest one by one (the same
// product, code[q] * absmax).
template <class V>
inline void decode_block(const uint8_t* q, int64_t n, const MapTables& t, const float* code, float absmax,
                         float* out) {
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) V::decode64(q + i, t.planes, absmax, out + i);
  for (; i < n; ++i) out[i] = code[q[i]] * absmax;
}

// The largest of V's lanes and `tail`.
template <class V>
inline uint32_t max_lane(typename V::I x, uint32_t tail) {
  uint32_t lanes[V::W];
  V::store_i(lanes, x);
  for (uint32_t lane : lanes) tail = lane > tail ? lane : tail;
  return tail;
}

template <class V, bool kBucketed>
inline typename V::I nearest_code(const MapTables& t, typename V::F x) {
  return kBucketed ? bucketed_code<V>(t, x) : searched_code<V>(t.mid, x);
}

// Encodes n fp32 moments against their block's new absmax (given as its bits).
template <class V, bool kBucketed>
inline void encode_loop(const float* x, int64_t n, uint32_t absmax_bits, const MapTables& t, uint8_t* q) {
  const float absmax = float_of_bits(absmax_bits);
  const float scale = absmax == 0.0f ? 0.0f : 1.0f / absmax;
  int64_t i = 0;
  for (; i + V::W <= n; i += V::W) {
    V::store_u8(q + i, nearest_code<V, kBucketed>(t, V::mul(V::load_f32(x + i), V::set1(scale))));
  }
  for (; i < n; ++i) ScalarVec::store_u8(q + i, nearest_code<ScalarVec, kBucketed>(t, x[i] * scale));
}

// encode_loop by the map's LinearEncoder: no table lookups but in the rare lanes it leaves to the search.
template <class V, bool kNonNegative>
inline void linear_encode_loop(const float* x, int64_t n, uint32_t absmax_bits, const MapTables& t, uint8_t* q) {
  const float absmax = float_of_bits(absmax_bits);
  const float scale = absmax == 0.0f ? 0.0f : 1.0f / absmax;
  int64_t i = 0;
  for (; i + V::W <= n; i += V::W) {
    uint32_t searched;
    V::store_u8(q + i, V::template linear_code<kNonNegative>(t.linear, V::mul(V::load_f32(x + i), V::set1(scale)),
                                                             searched));
    for (; searched != 0; searched &= searched - 1) {
      const int64_t at = i + __builtin_ctz(searched);
      q[at] = static_cast<uint8_t>(searched_code<ScalarVec>(t.mid, x[at] * scale));
    }
  }
  for (; i < n; ++i) ScalarVec::store_u8(q + i, searched_code<ScalarVec>(t.mid, x[i] * scale));
}

template <class V>
inline void encode_block(const float* x, int64_t n, uint32_t absmax_bits, const MapTables& t, uint8_t* q) {
  if constexpr (V::kLinearEncode) {
    if (t.linear.usable) {
      return t.linear.zero == 0 ? linear_encode_loop<V, true>(x, n, absmax_bits, t, q)
                                : linear_encode_loop<V, false>(x, n, absmax_bits, t, q);
    }
  }
  t.bucketed ? encode_loop<V, true>(x, n, absmax_bits, t, q) : encode_loop<V, false>(x, n, absmax_bits, t, q);
}

// Stochastic rounding's hash input of stream index `index`: uint32(index) + uint32(K), K the key of its 2^32.
inline uint32_t sr_counter(const EightBitTables& t, int64_t index) {
  const uint64_t u = static_cast<uint64_t>(index);
  return static_cast<uint32_t>(u) + static_cast<uint32_t>(sr_key(t.sr_seed, t.sr_stream, t.step, u >> 32));
}

// Of `len` elements from stream index `first`, how many share its key: a block of a span whose offset no block
// divides may cross a multiple of 2^32.
inline int64_t same_key(int64_t first, int64_t len) {
  const uint64_t to_next = (uint64_t{1} << 32) - (static_cast<uint64_t>(first) & 0xffffffffu);
  return static_cast<int64_t>(std::min<uint64_t>(static_cast<uint64_t>(len), to_next));
}

// One block: its first pass (cut where the stochastic rounding key changes), its new absmaxes, its second pass
// (kParts permitting).
template <class V, bool kSR, int kGrad, int kParts, class G>
inline void step_block(const EightBitPass& a, const EightBitState& in, const G* grad, int64_t n, int64_t b,
                       const EightBitTables& t, const AdamWCoef& c) {
  const int64_t at = b * kBlock;
  const int64_t len = n - at < kBlock ? n - at : kBlock;
  BlockMoments<V> out;
  out.max_m = out.max_v = V::iset1(0);
  out.tail_max_m = out.tail_max_v = 0;
  const float absmax_m = in.exp_avg_absmax[b], absmax_v = in.exp_avg_sq_absmax[b];
  if constexpr (V::kByteDecode) {
    decode_block<V>(in.exp_avg + at, len, *t.exp_avg, a.exp_avg_code, absmax_m, out.m);
    decode_block<V>(in.exp_avg_sq + at, len, *t.exp_avg_sq, a.exp_avg_sq_code, absmax_v, out.v);
  }
  const int64_t cut = kSR ? same_key(t.sr_index + at, len) : len;
  update_range<V, kSR, kGrad, kParts>(a, in, grad, at, 0, cut, kSR ? sr_counter(t, t.sr_index + at) : 0, absmax_m,
                                      absmax_v, out, c);
  if (cut < len) {
    update_range<V, kSR, kGrad, kParts>(a, in, grad, at, cut, len, sr_counter(t, t.sr_index + at + cut), absmax_m,
                                        absmax_v, out, c);
  }
  if constexpr (stores_moments(kParts)) {
    const uint32_t new_m = max_lane<V>(out.max_m, out.tail_max_m), new_v = max_lane<V>(out.max_v, out.tail_max_v);
    encode_block<V>(out.m, len, new_m, *t.exp_avg, a.exp_avg + at);
    encode_block<V>(out.v, len, new_v, *t.exp_avg_sq, a.exp_avg_sq + at);
    a.exp_avg_absmax[b] = float_of_bits(new_m);
    a.exp_avg_sq_absmax[b] = float_of_bits(new_v);
  }
}

template <class V, int kGrad, int kParts, class G>
inline void step_blocks(const EightBitPass& a, const G* grad, int64_t n, int64_t first, int64_t last,
                        const EightBitTables& t, const AdamWCoef& c) {
  const EightBitState in = a.in ? *a.in
                                : EightBitState{a.param, a.exp_avg, a.exp_avg_sq, a.exp_avg_absmax, a.exp_avg_sq_absmax};
  for (int64_t b = first; b < last; ++b) {
    t.stochastic ? step_block<V, true, kGrad, kParts>(a, in, grad, n, b, t, c)
                 : step_block<V, false, kGrad, kParts>(a, in, grad, n, b, t, c);
  }
}

// The bf16 gradient's mode and the pass's parts, as bf16_span_rounded picks them (a sum is stored whole).
template <class V>
inline void bf16_grad_blocks(const EightBitPass& a, int64_t n, int64_t first, int64_t last, const EightBitTables& t,
                             const AdamWCoef& c) {
  const auto* g = static_cast<const uint16_t*>(a.grad);
  if (a.grad_add != nullptr) return step_blocks<V, kGradAdd, kAllParts>(a, g, n, first, last, t, c);
  with_parts(a.parts, [&](auto parts) {
    constexpr int kParts = decltype(parts)::value;
    a.grad_scale != 1.0f ? step_blocks<V, kGradScale, kParts>(a, g, n, first, last, t, c)
                         : step_blocks<V, kGradPlain, kParts>(a, g, n, first, last, t, c);
  });
}

template <class V>
inline void adamw8bit_blocks(const EightBitPass& a, int64_t n, int64_t first, int64_t last, const EightBitTables& t,
                             const AdamWCoef& c) {
  if (a.grad_type == GradType::kFP32) {  // CPUAdamW's fp32 gradients: read as they are, every store made
    step_blocks<V, kGradPlain, kAllParts>(a, static_cast<const float*>(a.grad), n, first, last, t, c);
  } else {
    bf16_grad_blocks<V>(a, n, first, last, t, c);
  }
}

}  // namespace
}  // namespace offload_ext

// Defines the exported 8-bit block loops of one ISA on top of vector type VEC.
#define OFFLOAD_EXT_DEFINE_8BIT_BLOCKS(isa, VEC)                                                   \
  namespace offload_ext {                                                                         \
  void adamw8bit_blocks_##isa(const EightBitPass& pass, int64_t n, int64_t first, int64_t last,    \
                              const EightBitTables& t, const AdamWCoef& c) {                      \
    adamw8bit_blocks<VEC>(pass, n, first, last, t, c);                                            \
  }                                                                                               \
  }
