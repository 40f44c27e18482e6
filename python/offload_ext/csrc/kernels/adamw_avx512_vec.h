// The AVX-512F vector type the AdamW span loops and 8-bit block loops are written over (adamw_kernel.h,
// adamw8bit_kernel.h). Included only by translation units compiled for AVX-512, after their target pragma.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "adamw8bit.h"
#include "adamw_kernel.h"
#include "prefetch.h"

namespace offload_ext {
namespace {

struct Avx512Vec {
  using F = __m512;
  static constexpr int W = 16;
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F load_f32(const float* p) { return _mm512_loadu_ps(p); }
  static void store_f32(float* p, F x) { _mm512_storeu_ps(p, x); }
  static void stream_f32(float* p, F x) { _mm512_stream_ps(p, x); }
  static F load_bf16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  // The upper halves of x's bits with a rounding increment added (NaN: 0x7fc0), packed to 16-bit lanes.
  static __m256i pack_bf16(F x, __m512i increment) {
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(x), increment), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(r);
  }
  static __m256i to_bf16(F x) {
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(x), 16), _mm512_set1_epi32(1));
    return pack_bf16(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  }
  static void store_bf16(uint16_t* p, F x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(x)); }
  static void stream_bf16(uint16_t* p, F x) { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), to_bf16(x)); }
  using I = __m512i;
  static I iset1(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
  static I iota(uint32_t base) {
    return _mm512_add_epi32(iset1(base), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  }
  static I iadd(I a, I b) { return _mm512_add_epi32(a, b); }
  static I ixor(I a, I b) { return _mm512_xor_si512(a, b); }
  static I iand(I a, I b) { return _mm512_and_si512(a, b); }
  static I imul(I a, I b) { return _mm512_mullo_epi32(a, b); }
  template <int k>
  static I shr(I a) { return _mm512_srli_epi32(a, k); }
  static void store_bf16_sr(uint16_t* p, F x, I r) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), pack_bf16(x, r));
  }
  static void stream_bf16_sr(uint16_t* p, F x, I r) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), pack_bf16(x, r));
  }
  // For the 8-bit loops: 16 code indices (bytes) widened to lanes and packed back, map and bucket lookups (a
  // byte table read 4 bytes a lane), a search step (a + k in the lanes where !(x >= y)), k where x is NaN, the
  // bits of x and of |x| (ordered as |x| is, NaN past all), their maximum.
  static I load_u8(const uint8_t* p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store_u8(uint8_t* p, I x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(x)); }
  static F gather(const float* table, I i) { return _mm512_i32gather_ps(i, table, 4); }
  // table[i] for a table of 256 floats: in-register permutes of its 32-float pieces, then the piece by i's
  // three high bits, which costs less than a gather.
  static F lookup256(const float* table, I i) {
    const auto piece = [&](int k) {
      return _mm512_permutex2var_ps(_mm512_loadu_ps(table + 32 * k), i, _mm512_loadu_ps(table + 32 * k + 16));
    };
    const auto pick = [&](uint32_t bit, F low, F high) {
      return _mm512_mask_mov_ps(low, _mm512_test_epi32_mask(i, iset1(bit)), high);
    };
    const F low = pick(64, pick(32, piece(0), piece(1)), pick(32, piece(2), piece(3)));
    const F high = pick(64, pick(32, piece(4), piece(5)), pick(32, piece(6), piece(7)));
    return pick(128, low, high);
  }
  static I gather_u8(const uint8_t* table, I i) {
    return _mm512_and_si512(_mm512_i32gather_epi32(i, table, 1), iset1(0xffu));
  }
  static I bits(F x) { return _mm512_castps_si512(x); }
  static I where_nan(I a, F x, uint32_t k) {
    return _mm512_mask_mov_epi32(a, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), iset1(k));
  }
  static I add_where_not_ge(I a, F x, F y, uint32_t k) {
    return _mm512_mask_add_epi32(a, _mm512_cmp_ps_mask(x, y, _CMP_NGE_UQ), a, iset1(k));
  }
  static I abs_bits(F x) { return _mm512_and_si512(_mm512_castps_si512(x), iset1(0x7fffffffu)); }
  static I imax(I a, I b) { return _mm512_max_epi32(a, b); }  // the bits of a magnitude are non-negative int32s
  static void store_i(uint32_t* p, I x) { _mm512_storeu_si512(p, x); }
  // The rule's index of x by the map's LinearEncoder (adamw8bit.h), but for the lanes set in `searched`, whose
  // pos lies too near an integer to tell.
  static constexpr bool kLinearEncode = true;
  static constexpr bool kByteDecode = false;  // adamw8bit_avx512vbmi.cpp's vector type: true
  // kNonNegative: a map with no midpoint below 0 (l.zero == 0, exp_avg_sq's), where every negative x takes code 0.
  template <bool kNonNegative>
  static I linear_code(const LinearEncoder& l, F x, uint32_t& searched) {
    // A float compare: a NaN goes the way of a positive x past every anchor, to code kCodes - 1 as the rule's
    // search finds it (zero + #P), and -0 the way of +0, to the same code.
    const __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    // A negative x counts the p <= |x|, i.e. those below the float after |x| (the midpoints below x are the
    // negatives of the others). Infinities and NaNs fall in the last binade, past every anchor, where the slope is
    // 0: their pos is a NaN, and the min below (a NaN in its first operand gives its second) makes it the limit.
    const __m512i above = kNonNegative ? abs_bits(x) : _mm512_mask_add_epi32(abs_bits(x), negative, abs_bits(x), iset1(1));
    const __m512 a = _mm512_castsi512_ps(above);
    // The binade's exponent clamped to the 32 of the table, which the permute reads modulo 32.
    const __m512i binade = shr<23>(_mm512_min_epi32(_mm512_max_epi32(above, iset1(kLinearBinade0 << 23)),
                                                    iset1(((kLinearBinade0 + 32) << 23) - 1)));
    __m512i s = _mm512_permutex2var_epi32(_mm512_loadu_si512(l.segment_of_exponent), binade,
                                          _mm512_loadu_si512(l.segment_of_exponent + 16));
    const __m512 anchor = _mm512_permutexvar_ps(s, _mm512_loadu_ps(l.anchor));
    s = _mm512_mask_add_epi32(s, _mm512_cmp_ps_mask(anchor, a, _CMP_LT_OQ), s, iset1(1));
    const __m512 pos = _mm512_min_ps(_mm512_fmadd_ps(a, _mm512_permutexvar_ps(s, _mm512_loadu_ps(l.slope)),
                                                     _mm512_permutexvar_ps(s, _mm512_loadu_ps(l.offset))),
                                     _mm512_permutexvar_ps(s, _mm512_loadu_ps(l.limit)));
    const __m512i count = _mm512_cvttps_epi32(pos);
    const __m512 off = _mm512_sub_ps(pos, _mm512_roundscale_ps(pos, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    searched = _mm512_cmp_ps_mask(_mm512_abs_ps(off), set1(kLinearMargin), _CMP_LT_OQ);
    if constexpr (kNonNegative) {
      searched &= static_cast<uint32_t>(static_cast<__mmask16>(~negative));
      return _mm512_maskz_mov_epi32(static_cast<__mmask16>(~negative), count);
    }
    const __m512i zero = iset1(static_cast<uint32_t>(l.zero));
    return _mm512_mask_sub_epi32(_mm512_add_epi32(zero, count), negative, zero, _mm512_min_epi32(count, zero));
  }
  static void fence() { _mm_sfence(); }
  static void prefetch(const void* p, int level) { prefetch_line(p, level); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  // bf16 rounding kept in 32-bit lanes (no pack and unpack): the float with the low half rounded off.
  static F round_bf16(F x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))),
                                 _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc00000));
    return _mm512_castsi512_ps(r);
  }
  using D = __m512d;  // float64 sums of squares: the low and the high 8 lanes
  static D dzero() { return _mm512_setzero_pd(); }
  static void add_squares(D& lo, D& hi, F x) {  // squared in float64, as ScalarVec's
    const __m512d l = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d h = _mm512_cvtps_pd(_mm256_castsi256_ps(_mm512_extracti64x4_epi64(_mm512_castps_si512(x), 1)));
    lo = _mm512_add_pd(lo, _mm512_mul_pd(l, l));
    hi = _mm512_add_pd(hi, _mm512_mul_pd(h, h));
  }
  static constexpr int DW = 8;
  static void store_d(double* p, D x) { _mm512_storeu_pd(p, x); }
};


}  // namespace
}  // namespace offload_ext
