// How much of the bf16 params pass after clipping (p, g, m, v read, p written) is the divider's (a sqrt and two
// divisions a vector of 16), on this CPU: the pass as the kernel does it (adamw_update.h's arithmetic with
// clipping's scaled gradient), two exact replacements of its divisions (a float64 multiply by 1/c for the constant
// divisor; a float64 reciprocal by rcp14 and two Newton steps for the other, lanes out of the proven range through
// the divider), checked bit for bit against the first, and two inexact bounds (no division; no sqrt either) that
// say what the divider costs. Standalone, AVX-512 only:
//   g++ -O3 -march=native -ffp-contract=off -pthread benchmarks/bench_divider.cpp -o /tmp/bench_divider
//   /tmp/bench_divider N THREADS REPS [INNER]   (N elements, split over THREADS; INNER > 1 with a cache-sized N)
// Why the float64 multiply is exact: s / c for floats s, c is never a float midpoint and lies more than 2^-49
// (relative) from every one, while s * RN64(1/c) rounded to float64 is within 2^-52 of s / c, so both round to the
// same float; the Newton reciprocal's product is within ~1.5 * 2^-52.
#include <immintrin.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

static inline __m512 load_bf16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __m512 round_bf16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))),
                               _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc00000));
  return _mm512_castsi512_ps(r);
}
static inline void store_bf16(uint16_t* p, __m512 x) {
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(x), 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(x), _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}

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

struct Coef {
  float scale = 0.37f, decay = 1.0f - 1e-4f * 0.01f, lerp = 0.1f, omb2 = 0.001f, b2 = 0.999f, bc2s = 0.0f,
        eps = 1e-8f, ns = -1e-4f / 0.271f;
  double rbc2s = 0.0;
};

template <int kVar>
static void pass(uint16_t* P, const uint16_t* G, const uint16_t* M, const uint16_t* V, int64_t n, const Coef& c) {
  const __m512d rbc = _mm512_set1_pd(c.rbc2s);
  for (int64_t i = 0; i + 16 <= n; i += 16) {
    _mm_prefetch(reinterpret_cast<const char*>(P + i + 512), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(G + i + 512), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(M + i + 512), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(V + i + 512), _MM_HINT_T0);
    __m512 p = load_bf16(P + i);
    const __m512 g = round_bf16(_mm512_mul_ps(load_bf16(G + i), _mm512_set1_ps(c.scale)));
    __m512 m = load_bf16(M + i);
    __m512 v = load_bf16(V + i);
    p = _mm512_mul_ps(p, _mm512_set1_ps(c.decay));
    m = _mm512_fmadd_ps(_mm512_set1_ps(c.lerp), _mm512_sub_ps(g, m), m);
    v = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(c.omb2), g), g, _mm512_mul_ps(v, _mm512_set1_ps(c.b2)));
    const __m512 s = kVar == 4 ? _mm512_mul_ps(v, _mm512_rsqrt14_ps(v)) : _mm512_sqrt_ps(v);
    __m512 d1;
    if (kVar == 0) d1 = _mm512_div_ps(s, _mm512_set1_ps(c.bc2s));
    else if (kVar == 1 || kVar == 2) d1 = mul_f64(s, rbc);
    else d1 = _mm512_mul_ps(s, _mm512_set1_ps(1.0f / c.bc2s));
    const __m512 denom = _mm512_add_ps(d1, _mm512_set1_ps(c.eps));
    const __m512 num = _mm512_mul_ps(_mm512_set1_ps(c.ns), m);
    __m512 u;
    if (kVar <= 1) u = _mm512_div_ps(num, denom);
    else if (kVar == 2) u = div_f64(num, denom);
    else u = _mm512_mul_ps(num, _mm512_rcp14_ps(denom));
    p = _mm512_add_ps(p, u);
    store_bf16(P + i, p);
  }
}

using PassFn = void (*)(uint16_t*, const uint16_t*, const uint16_t*, const uint16_t*, int64_t, const Coef&);
static PassFn kPasses[] = {pass<0>, pass<1>, pass<2>, pass<3>, pass<4>};
static const char* kNames[] = {"exact(sqrt,div,div)", "A(sqrt,f64mul,div)", "AB(sqrt,f64mul,f64nr)",
                               "bound(sqrt,mul,rcp)", "bound(rsqrt,mul,rcp)"};

static uint16_t bf16_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? std::atoll(argv[1]) : 218103808;
  const int threads = argc > 2 ? std::atoi(argv[2]) : 14;
  const int reps = argc > 3 ? std::atoi(argv[3]) : 5;
  const int inner = argc > 4 ? std::atoi(argv[4]) : 1;  // passes over a thread's chunk: >1 with a cache-sized n
  Coef c;
  c.bc2s = std::sqrt(1.0f - std::pow(0.999f, 7.0f));
  c.rbc2s = 1.0 / static_cast<double>(c.bc2s);
  // Bits: the exact variants against the divider on random state, every magnitude range of v.
  {
    const int64_t k = 1 << 22;
    std::mt19937 rng(1);
    std::vector<uint16_t> p(k), g(k), m(k), v(k);
    for (int64_t i = 0; i < k; ++i) {
      const float e = std::ldexp(1.0f, static_cast<int>(rng() % 120) - 100);
      auto u = [&] { return std::uniform_real_distribution<float>(-1, 1)(rng); };
      p[i] = bf16_of(u()); g[i] = bf16_of(u() * e); m[i] = bf16_of(u() * e * 0.3f);
      v[i] = bf16_of(std::fabs(u()) * e * e);
      if (i % 97 == 0) m[i] = 0;
      if (i % 101 == 0) v[i] = 0;
    }
    for (int var = 1; var <= 2; ++var) {
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
  auto* V = static_cast<uint16_t*>(std::aligned_alloc(64, n * 2));
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
      P[i] = bf16_of(x); G[i] = bf16_of(x * 1e-3f); M[i] = bf16_of(x * 1e-4f); V[i] = bf16_of(x * x * 1e-7f + 1e-9f);
    }
  });
  for (int r = 0; r < reps; ++r) {
    for (int var = 0; var < 5; ++var) {
      const auto t0 = std::chrono::steady_clock::now();
      run([&](int64_t a, int64_t len) {
        for (int k = 0; k < inner; ++k) kPasses[var](P + a, G + a, M + a, V + a, len, c);
      });
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / inner;
      std::printf("rep %d %-24s %7.3f ms  %6.1f GB/s  %5.2f ns/elem/thread\n", r, kNames[var], ms, n * 10.0 / ms / 1e6,
                  ms * 1e6 * threads / n);
    }
  }
  return 0;
}
