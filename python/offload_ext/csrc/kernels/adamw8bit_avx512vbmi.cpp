// The 8-bit AdamW block loops for AVX-512 with VBMI: adamw_avx512.cpp's, but each block's moments decoded 64 at a
// time by byte permutes (decode64) before the update reads them. Compiled for AVX-512 VBMI here only; the
// dispatcher calls it after checking the CPU at run time.
#include <cstdint>

#include "adamw.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vbmi,avx2,fma,f16c")
#include <immintrin.h>

#include "adamw8bit_kernel.h"
#include "adamw_avx512_vec.h"

namespace offload_ext {
namespace {

// Indices put in the order in which decode64's interleave, which works within 128-bit lanes, gives its floats back
// in element order: the interleave turns byte position 16L + 4r + i (lane L) into float 4L + i of vector r, so
// position 16L + 4r + i takes the index of element 16r + 4L + i.
alignas(64) constexpr uint8_t kInterleaveOrder[64] = {
    0,  1,  2,  3,  16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51,
    4,  5,  6,  7,  20, 21, 22, 23, 36, 37, 38, 39, 52, 53, 54, 55,
    8,  9,  10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59,
    12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63};

struct Avx512VbmiVec : Avx512Vec {
  static constexpr bool kByteDecode = true;
  // out[0, 64) = the codes of q[0, 64) times absmax: each code's four bytes looked up in its byte plane (two
  // 128-byte permutes and a blend on the index's top bit), then interleaved into floats. A 256-float lookup of
  // 16 indices takes 8 permutes and 7 blends; this takes 8 permutes and 4 blends for 64.
  static void decode64(const uint8_t* q, const uint8_t (*planes)[kCodes], float absmax, float* out) {
    const __m512i index = _mm512_permutexvar_epi8(_mm512_load_si512(kInterleaveOrder), _mm512_loadu_si512(q));
    const __mmask64 high = _mm512_movepi8_mask(index);
    __m512i b[4];
    for (int k = 0; k < 4; ++k) {
      const uint8_t* p = planes[k];
      const __m512i low = _mm512_permutex2var_epi8(_mm512_loadu_si512(p), index, _mm512_loadu_si512(p + 64));
      const __m512i top = _mm512_permutex2var_epi8(_mm512_loadu_si512(p + 128), index, _mm512_loadu_si512(p + 192));
      b[k] = _mm512_mask_blend_epi8(high, low, top);
    }
    const __m512i low01 = _mm512_unpacklo_epi8(b[0], b[1]), high01 = _mm512_unpackhi_epi8(b[0], b[1]);
    const __m512i low23 = _mm512_unpacklo_epi8(b[2], b[3]), high23 = _mm512_unpackhi_epi8(b[2], b[3]);
    const __m512i floats[4] = {_mm512_unpacklo_epi16(low01, low23), _mm512_unpackhi_epi16(low01, low23),
                               _mm512_unpacklo_epi16(high01, high23), _mm512_unpackhi_epi16(high01, high23)};
    const __m512 scale = _mm512_set1_ps(absmax);
    for (int r = 0; r < 4; ++r) _mm512_storeu_ps(out + 16 * r, _mm512_mul_ps(_mm512_castsi512_ps(floats[r]), scale));
  }
};

}  // namespace
}  // namespace offload_ext

OFFLOAD_EXT_DEFINE_8BIT_BLOCKS(avx512vbmi, Avx512VbmiVec)
#pragma GCC pop_options
