// How much of the bf16 params pass after clipping (p, g, m, v read, p written) is the divider's (a sqrt and two
// divisions a vector of 16), on this CPU: the pass as the kernel does it (adamw_update.h's arithmetic with
// clipping's scaled gradient), replacements of its divisions (a float64 multiply by 1/c for the constant divisor; a
// float64 reciprocal by rcp14 and two Newton steps for the other, lanes out of the proven range through the
// divider; in float, the product by RN(1/c) and one Markstein correction for the constant divisor, and the same
// after an rcp14 reciprocal with two Newton steps for the other), checked bit for bit against the first on random
// state, and two inexact bounds (no division; no sqrt either) that say what the divider costs. Built with the
// kernel's sources (for make_coef), no torch; AVX-512 only:
//   K=python/offload_ext/csrc; g++ -O3 -march=native -ffp-contract=off -pthread -I$K/kernels -I$K \
//     benchmarks/bench_divider.cpp $K/kernels/adamw*.cpp $K/common/thread_pool.cpp -o /tmp/bench_divider
//   /tmp/bench_divider N THREADS REPS [INNER]   (N elements, split over THREADS; INNER > 1 with a cache-sized N)
//   /tmp/bench_divider check COUNT SEED          (the float correction against the division, below)
// Why the float64 multiply is exact: s / c for floats s, c is never a float midpoint and lies more than 2^-49
// (relative) from every one, while s * RN64(1/c) rounded to float64 is within 2^-52 of s / c, so both round to the
// same float; the Newton reciprocal's product is within ~1.5 * 2^-52. The float correction for the constant divisor
// gave the division's bits for every float x in [2^-100, 2^64) (sqrt(v)'s range for a finite v of bf16 state: its
// remainder is never subnormal there) at nine step counts' c, checked exhaustively on the CPU machine, and for
// every x significand at 200,000 random c significands (`check 200000 7`); the one for
// the varying divisor is only checked on the random state below (it is a speed probe, not a proven rule).
#include <immintrin.h>

#include "adamw_avx512_vec.h"

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <random>
#include <thread>
#include <vector>

using V = offload_ext::Avx512Vec;  // the kernel's own loads, roundings and stores

// x * r in float64 rounded once to float: equal to x / c for every float x when r = RN64(1/c).
static inline __m512 mul_f64(__m512 x, __m512d r) {
  const __m512d lo = _mm512_mul_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(x)), r);
  const __m512d hi = _mm512_mul_pd(_mm512_cvtps_pd(_mm256_castsi256_ps(_mm512_extracti64x4_epi64(_mm512_castps_si512(x), 1))), r);
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtpd_ps(lo)), _mm512_cvtpd_ps(hi), 1);
}
// n / d in float64 via rcp14 and two Newton steps, rounded once to float.
static inline __m256 div_f64_half(__m256 n, __m256 d) {
  const __m512d D = _mm512_cvtps_pd(d);
  const __m512d one = _mm512_set1_pd(1.0);
  __m512d y = _mm512_rcp14_pd(D);
  __m512d e = _mm512_fnmadd_pd(D, y, one);
  y = _mm512_fmadd_pd(y, e, y);
  e = _mm512_fnmadd_pd(D, y, one);
  y = _mm512_fmadd_pd(y, e, y);
  return _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_cvtps_pd(n), y));
}
static inline __m512 div_f64(__m512 n, __m512 d) {
  const __m256 lo = div_f64_half(_mm512_castps512_ps256(n), _mm512_castps512_ps256(d));
  const __m256 hi = div_f64_half(_mm256_castsi256_ps(_mm512_extracti64x4_epi64(_mm512_castps_si512(n), 1)),
                                 _mm256_castsi256_ps(_mm512_extracti64x4_epi64(_mm512_castps_si512(d), 1)));
  __m512 q = _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
  // lanes outside the proven range go through the divider
  const __m512 aq = _mm512_abs_ps(q);
  const __mmask16 ok = _mm512_cmp_ps_mask(aq, _mm512_set1_ps(0x1p-125f), _CMP_GE_OQ) &
                       _mm512_cmp_ps_mask(aq, _mm512_set1_ps(0x1p+126f), _CMP_LE_OQ) &
                       _mm512_cmp_ps_mask(d, _mm512_set1_ps(0x1p-125f), _CMP_GE_OQ) &
                       _mm512_cmp_ps_mask(d, _mm512_set1_ps(0x1p+126f), _CMP_LE_OQ);
  const __mmask16 zero = _mm512_cmp_ps_mask(n, _mm512_setzero_ps(), _CMP_EQ_OQ) &
                         _mm512_cmp_ps_mask(d, _mm512_set1_ps(0x1p-125f), _CMP_GE_OQ);
  const __mmask16 good = ok | zero;
  if (__builtin_expect(good != 0xffff, 0)) q = _mm512_mask_div_ps(q, static_cast<__mmask16>(~good), n, d);
  return q;
}

// x / c for the constant c in float, with y = RN(1/c): the product, then one correction by the exact remainder
// (Markstein's step); the lanes where x is infinite (the remainder a NaN) take the product's infinity.
static inline __m512 div_const_fma(__m512 x, __m512 c, __m512 y) {
  const __m512 q = _mm512_mul_ps(x, y);
  const __m512 q1 = _mm512_fmadd_ps(_mm512_fnmadd_ps(q, c, x), y, q);
  return _mm512_mask_mov_ps(q1, _mm512_fpclass_ps_mask(q, 0x18), q);
}
// n / d in float: rcp14 and two Newton steps for 1/d, the product, one correction by the exact remainder.
static inline __m512 div_fma(__m512 n, __m512 d) {
  const __m512 one = _mm512_set1_ps(1.0f);
  __m512 y = _mm512_rcp14_ps(d);
  y = _mm512_fmadd_ps(y, _mm512_fnmadd_ps(d, y, one), y);
  y = _mm512_fmadd_ps(y, _mm512_fnmadd_ps(d, y, one), y);
  const __m512 q = _mm512_mul_ps(n, y);
  return _mm512_fmadd_ps(_mm512_fnmadd_ps(q, d, n), y, q);
}

struct Coef {
  // the kernel's coefficients and memory tuning, as its dispatcher makes them
  offload_ext::AdamWCoef k = offload_ext::make_coef({1e-4, 0.9, 0.999, 1e-8, 0.01, 7});
  float scale = 0.37f;  // clipping's gradient scale
  double rbc2s = 0.0;          // RN64(1 / bias_correction2_sqrt)
  float rbc2s_f32 = 0.0f;      // RN(1 / bias_correction2_sqrt)
};

// Variant 0 is the kernel's own update (adamw_update.h) on the kernel's scaled-gradient read; the others spell
// the same arithmetic with the divisions replaced.
template <int kVar>
static void pass(uint16_t* P, const uint16_t* G, const uint16_t* M, const uint16_t* S, int64_t n, const Coef& c) {
  const offload_ext::AdamWCoef& k = c.k;
  const __m512d rbc = _mm512_set1_pd(c.rbc2s);
  for (int64_t i = 0; i + V::W <= n; i += V::W) {
    for (const uint16_t* a : {static_cast<const uint16_t*>(P), G, M, S}) V::prefetch(a + i + k.prefetch, k.prefetch_level);
    __m512 p = V::load_bf16(P + i);
    __m512 g = offload_ext::load_grad_bf16<V, offload_ext::kGradScale>(G, nullptr, c.scale, i);
    __m512 m = V::load_bf16(M + i);
    __m512 v = V::load_bf16(S + i);
    if (kVar == 0) {
      offload_ext::adamw_update<V>(p, g, m, v, k);
    } else {
      p = V::mul(p, V::set1(k.decay));
      m = V::fmadd(V::set1(k.lerp_coef), V::sub(g, m), m);
      v = V::fmadd(V::mul(V::set1(k.one_minus_beta2), g), g, V::mul(v, V::set1(k.beta2)));
      const __m512 s = kVar == 4 ? V::mul(v, _mm512_rsqrt14_ps(v)) : V::sqrt(v);
      const __m512 d1 = kVar <= 2   ? mul_f64(s, rbc)
                        : kVar >= 5 ? div_const_fma(s, V::set1(k.bias_correction2_sqrt), V::set1(c.rbc2s_f32))
                                    : V::mul(s, V::set1(1.0f / k.bias_correction2_sqrt));
      const __m512 denom = V::add(d1, V::set1(k.eps));
      const __m512 num = V::mul(V::set1(k.neg_step_size), m);
      const __m512 u = kVar == 1 || kVar == 5 ? V::div(num, denom)
                       : kVar == 2             ? div_f64(num, denom)
                       : kVar == 6             ? div_fma(num, denom)
                                               : V::mul(num, _mm512_rcp14_ps(denom));
      p = V::add(p, u);
    }
    V::store_bf16(P + i, p);
  }
}

using PassFn = void (*)(uint16_t*, const uint16_t*, const uint16_t*, const uint16_t*, int64_t, const Coef&);
static PassFn kPasses[] = {pass<0>, pass<1>, pass<2>, pass<3>, pass<4>, pass<5>, pass<6>};
static const char* kNames[] = {"exact(sqrt,div,div)", "A(sqrt,f64mul,div)", "AB(sqrt,f64mul,f64nr)",
                               "bound(sqrt,mul,rcp)", "bound(rsqrt,mul,rcp)", "C(sqrt,fmadiv,div)",
                               "CD(sqrt,fmadiv,fmanr)"};
constexpr int kVariants = static_cast<int>(std::size(kPasses));

using offload_ext::bf16_round_bits;

// The float correction for the constant divisor against the division, for COUNT random significands of c (the
// first 1 - 2^-24) and every significand of x: both sides scale exactly by powers of two where nothing is
// subnormal or overflows, so this covers every x in that range for those c. Returns the lanes that differ.
static int64_t check_div_const(int count, unsigned seed) {
  std::mt19937 rng(seed);
  int64_t differ = 0;
  for (int k = 0; k < count; ++k) {
    const uint32_t bits = k == 0 ? 0x3f7fffffu : 0x3f000000u | (rng() & 0x7fffffu);  // c in [0.5, 1)
    float c;
    std::memcpy(&c, &bits, sizeof(c));
    const __m512 C = _mm512_set1_ps(c), Y = _mm512_set1_ps(static_cast<float>(1.0 / static_cast<double>(c)));
    for (uint32_t x0 = 0x3f800000u; x0 < 0x40000000u; x0 += 16) {
      const __m512 x = _mm512_castsi512_ps(V::iota(x0));
      differ += __builtin_popcount(_mm512_cmpneq_epi32_mask(_mm512_castps_si512(div_const_fma(x, C, Y)),
                                                            _mm512_castps_si512(_mm512_div_ps(x, C))));
    }
  }
  return differ;
}

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "check") == 0) {  // bench_divider check COUNT SEED
    const int count = argc > 2 ? std::atoi(argv[2]) : 1000;
    std::printf("float correction, %d c significands x every x significand: %lld lanes differ from the division\n",
                count, static_cast<long long>(check_div_const(count, argc > 3 ? std::atoi(argv[3]) : 1)));
    return 0;
  }
  const int64_t n = argc > 1 ? std::atoll(argv[1]) : 218103808;
  const int threads = argc > 2 ? std::atoi(argv[2]) : 14;
  const int reps = argc > 3 ? std::atoi(argv[3]) : 5;
  const int inner = argc > 4 ? std::atoi(argv[4]) : 1;  // passes over a thread's chunk: >1 with a cache-sized n
  Coef c;
  c.rbc2s = 1.0 / static_cast<double>(c.k.bias_correction2_sqrt);
  c.rbc2s_f32 = static_cast<float>(c.rbc2s);
  // Bits: the exact variants against the divider on random state, every magnitude range of v.
  {
    const int64_t k = 1 << 22;
    std::mt19937 rng(1);
    std::vector<uint16_t> p(k), g(k), m(k), v(k);
    for (int64_t i = 0; i < k; ++i) {
      const float e = std::ldexp(1.0f, static_cast<int>(rng() % 120) - 100);
      auto u = [&] { return std::uniform_real_distribution<float>(-1, 1)(rng); };
      p[i] = bf16_round_bits(u()); g[i] = bf16_round_bits(u() * e); m[i] = bf16_round_bits(u() * e * 0.3f);
      v[i] = bf16_round_bits(std::fabs(u()) * e * e);
      if (i % 97 == 0) m[i] = 0;
      if (i % 101 == 0) v[i] = 0;
    }
    for (int var : {1, 2, 5, 6}) {
      std::vector<uint16_t> a = p, b = p;
      pass<0>(a.data(), g.data(), m.data(), v.data(), k, c);
      kPasses[var](b.data(), g.data(), m.data(), v.data(), k, c);
      int64_t diff = 0;
      for (int64_t i = 0; i < k; ++i) diff += a[i] != b[i];
      std::printf("bits %s: %lld of %lld differ\n", kNames[var], static_cast<long long>(diff), static_cast<long long>(k));
    }
  }
  auto* P = static_cast<uint16_t*>(std::aligned_alloc(64, n * 2));
  auto* G = static_cast<uint16_t*>(std::aligned_alloc(64, n * 2));
  auto* M = static_cast<uint16_t*>(std::aligned_alloc(64, n * 2));
  auto* S = static_cast<uint16_t*>(std::aligned_alloc(64, n * 2));
  const int64_t per = (n / threads + 15) / 16 * 16;
  auto run = [&](auto fn) {
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t)
      ts.emplace_back([&, t] {
        const int64_t a = t * per, b = std::min<int64_t>(n, a + per);
        if (a < b) fn(a, b - a);
      });
    for (auto& t : ts) t.join();
  };
  run([&](int64_t a, int64_t len) {
    std::mt19937 rng(static_cast<unsigned>(a));
    for (int64_t i = a; i < a + len; ++i) {
      const float x = std::uniform_real_distribution<float>(-1, 1)(rng);
      P[i] = bf16_round_bits(x); G[i] = bf16_round_bits(x * 1e-3f); M[i] = bf16_round_bits(x * 1e-4f); S[i] = bf16_round_bits(x * x * 1e-7f + 1e-9f);
    }
  });
  for (int r = 0; r < reps; ++r) {
    for (int var = 0; var < kVariants; ++var) {
      const auto t0 = std::chrono::steady_clock::now();
      run([&](int64_t a, int64_t len) {
        for (int k = 0; k < inner; ++k) kPasses[var](P + a, G + a, M + a, S + a, len, c);
      });
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / inner;
      std::printf("rep %d %-24s %7.3f ms  %6.1f GB/s  %5.2f ns/elem/thread\n", r, kNames[var], ms, n * 10.0 / ms / 1e6,
                  ms * 1e6 * threads / n);
    }
  }
  return 0;
}
