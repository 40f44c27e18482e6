// AdamW span kernels (bf16 and 8-bit moments) for AVX2+FMA (8 floats a vector). Only this file is compiled
// for AVX2; the dispatchers call it after checking the CPU at run time.
#include <cstdint>

#include "adamw.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include "adamw8bit_kernel.h"
#include "adamw_kernel.h"
#include "prefetch.h"

namespace offload_ext {
namespace {

struct Avx2Vec {
  using F = __m256;
  static constexpr int W = 8;
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F load_f32(const float* p) { return _mm256_loadu_ps(p); }
  static void store_f32(float* p, F x) { _mm256_storeu_ps(p, x); }
  static void stream_f32(float* p, F x) { _mm256_stream_ps(p, x); }
  static F load_bf16(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  // The upper halves of x's bits with a rounding increment added (NaN: 0x7fc0), packed to 16-bit lanes.
  static __m128i pack_bf16(F x, __m256i increment) {
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(x), increment), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
    // packus works per 128-bit lane; the permute gathers both lanes' halves into the low lane.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
    return _mm256_castsi256_si128(packed);
  }
  static __m128i to_bf16(F x) {
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(x), 16), _mm256_set1_epi32(1));
    return pack_bf16(x, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  }
  static void store_bf16(uint16_t* p, F x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16(x)); }
  static void stream_bf16(uint16_t* p, F x) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), to_bf16(x)); }
  using I = __m256i;
  static I iset1(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
  static I iota(uint32_t base) { return _mm256_add_epi32(iset1(base), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); }
  static I iadd(I a, I b) { return _mm256_add_epi32(a, b); }
  static I ixor(I a, I b) { return _mm256_xor_si256(a, b); }
  static I iand(I a, I b) { return _mm256_and_si256(a, b); }
  static I imul(I a, I b) { return _mm256_mullo_epi32(a, b); }
  template <int k>
  static I shr(I a) { return _mm256_srli_epi32(a, k); }
  static void store_bf16_sr(uint16_t* p, F x, I r) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), pack_bf16(x, r));
  }
  static void stream_bf16_sr(uint16_t* p, F x, I r) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), pack_bf16(x, r));
  }
  // For the 8-bit loops: 8 code indices (bytes) widened to lanes and packed back, map and bucket lookups (a
  // byte table read 4 bytes a lane), a search step (a + k in the lanes where !(x >= y)), k where x is NaN, the
  // bits of x and of |x| (ordered as |x| is, NaN past all), their maximum.
  static I load_u8(const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static void store_u8(uint8_t* p, I x) {
    const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(words, words));
  }
  static F gather(const float* table, I i) { return _mm256_i32gather_ps(table, i, 4); }
  static F lookup256(const float* table, I i) { return gather(table, i); }
  static I gather_u8(const uint8_t* table, I i) {
    return _mm256_and_si256(_mm256_i32gather_epi32(reinterpret_cast<const int*>(table), i, 1), iset1(0xffu));
  }
  static I bits(F x) { return _mm256_castps_si256(x); }
  static I where_nan(I a, F x, uint32_t k) {
    return _mm256_blendv_epi8(a, iset1(k), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
  }
  static I add_where_not_ge(I a, F x, F y, uint32_t k) {
    const __m256i below = _mm256_castps_si256(_mm256_cmp_ps(x, y, _CMP_NGE_UQ));
    return _mm256_add_epi32(a, _mm256_and_si256(below, iset1(k)));
  }
  static I abs_bits(F x) { return _mm256_and_si256(_mm256_castps_si256(x), iset1(0x7fffffffu)); }
  static constexpr bool kLinearEncode = false;
  static constexpr bool kByteDecode = false;
  static I imax(I a, I b) { return _mm256_max_epi32(a, b); }  // the bits of a magnitude are non-negative int32s
  static void store_i(uint32_t* p, I x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), x); }
  static void fence() { _mm_sfence(); }
  static void prefetch(const void* p, int level) { prefetch_line(p, level); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  // bf16 rounding kept in 32-bit lanes (no pack and unpack): the float with the low half rounded off.
  static F round_bf16(F x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))),
                                 _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc00000), nan);
    return _mm256_castsi256_ps(r);
  }
  using D = __m256d;  // float64 sums of squares: the low and the high 4 lanes
  static D dzero() { return _mm256_setzero_pd(); }
  static void add_squares(D& lo, D& hi, F x) {  // squared in float64, as ScalarVec's
    const __m256d l = _mm256_cvtps_pd(_mm256_castps256_ps128(x)), h = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    lo = _mm256_add_pd(lo, _mm256_mul_pd(l, l));
    hi = _mm256_add_pd(hi, _mm256_mul_pd(h, h));
  }
  static constexpr int DW = 4;
  static void store_d(double* p, D x) { _mm256_storeu_pd(p, x); }
};

}  // namespace
}  // namespace offload_ext

OFFLOAD_EXT_DEFINE_SPANS(avx2, Avx2Vec)
OFFLOAD_EXT_DEFINE_8BIT_BLOCKS(avx2, Avx2Vec)
#pragma GCC pop_options
