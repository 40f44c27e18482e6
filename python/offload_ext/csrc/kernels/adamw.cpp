// AdamW dispatch: derives the per-call constants, picks the ISA, and splits a span into
// cache-line-aligned chunks for the ThreadPool.
#include "adamw.h"

#include "stochastic_rounding.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace offload_ext {

namespace {

constexpr int64_t kAlign = 64;                 // elements; keeps chunk starts on cache lines
constexpr int64_t kMinParallel = int64_t{1} << 16;  // below this, threading costs more than it saves
constexpr int64_t kMinChunk = int64_t{1} << 15;
constexpr int64_t kTasksPerThread = 4;         // some slack so a descheduled thread does not stall a step

SimdLevel cpu_simd_level() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) {
    const bool vbmi = __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vbmi");
    return vbmi ? SimdLevel::kAvx512Vbmi : SimdLevel::kAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return SimdLevel::kAvx2;
#endif
  return SimdLevel::kScalar;
}

template <class Fn>
void for_chunks(int64_t n, ThreadPool& pool, const Fn& fn) {
  const int64_t threads = pool.num_threads();
  if (n < kMinParallel || threads == 1) {
    fn(0, n);
    return;
  }
  const int64_t max_tasks = std::max<int64_t>(1, n / kMinChunk);
  const int64_t tasks_wanted = std::min(threads * kTasksPerThread, max_tasks);
  int64_t chunk = (n + tasks_wanted - 1) / tasks_wanted;
  chunk = (chunk + kAlign - 1) / kAlign * kAlign;
  const int64_t tasks = (n + chunk - 1) / chunk;
  pool.parallel_for(tasks, [&](int64_t t) {
    const int64_t begin = t * chunk;
    fn(begin, std::min(n, begin + chunk));
  });
}

}  // namespace

SimdLevel supported_simd_level() {
  static const SimdLevel level = cpu_simd_level();
  return level;
}

SimdLevel parse_simd_level(const char* name) {
  if (std::strcmp(name, "scalar") == 0) return SimdLevel::kScalar;
  if (std::strcmp(name, "avx2") == 0) return SimdLevel::kAvx2;
  if (std::strcmp(name, "avx512") == 0) return SimdLevel::kAvx512;
  if (std::strcmp(name, "avx512vbmi") == 0) return SimdLevel::kAvx512Vbmi;
  throw std::invalid_argument(std::string("SIMD level must be one of scalar, avx2, avx512, avx512vbmi; got '") + name +
                              "'");
}

namespace {
SimdLevel initial_level() {
  const char* env = std::getenv("OFFLOAD_EXT_SIMD");
  const SimdLevel supported = supported_simd_level();
  return (env && *env) ? std::min(supported, parse_simd_level(env)) : supported;
}
std::atomic<int> g_active_level{-1};  // -1: not chosen yet
}  // namespace

SimdLevel active_simd_level() {
  int level = g_active_level.load(std::memory_order_relaxed);
  if (level < 0) {
    int expected = -1;
    g_active_level.compare_exchange_strong(expected, static_cast<int>(initial_level()));
    level = g_active_level.load(std::memory_order_relaxed);
  }
  return static_cast<SimdLevel>(level);
}

namespace {
int64_t env_int(const char* name, int64_t fallback) {
  const char* env = std::getenv(name);
  return (env && *env) ? std::strtoll(env, nullptr, 10) : fallback;
}
// 512 elements ahead (1-2 KiB a stream) measured best on the GPU host: see benchmarks/results/adamw_tune_16t.md.
std::atomic<int64_t> g_prefetch{env_int("OFFLOAD_EXT_PREFETCH", 512)};
std::atomic<bool> g_stream_out{env_int("OFFLOAD_EXT_STREAM_OUT", 1) != 0};
// Read at first use, not at load, so that a bad OFFLOAD_EXT_PREFETCH_LEVEL raises instead of aborting the import.
std::atomic<int> g_prefetch_level{-1};

PrefetchLevel initial_prefetch_level() {
  const char* env = std::getenv("OFFLOAD_EXT_PREFETCH_LEVEL");
  return (env && *env) ? parse_prefetch_level(env) : PrefetchLevel::kL1;
}
}  // namespace

PrefetchLevel parse_prefetch_level(const char* name) {
  if (std::strcmp(name, "l1") == 0) return PrefetchLevel::kL1;
  if (std::strcmp(name, "l2") == 0) return PrefetchLevel::kL2;
  if (std::strcmp(name, "nta") == 0) return PrefetchLevel::kNTA;
  throw std::invalid_argument(std::string("prefetch level must be one of l1, l2, nta; got '") + name + "'");
}

const char* prefetch_level_name(PrefetchLevel level) {
  switch (level) {
    case PrefetchLevel::kL2:
      return "l2";
    case PrefetchLevel::kNTA:
      return "nta";
    default:
      return "l1";
  }
}

MemoryTuning memory_tuning() {
  int level = g_prefetch_level.load();
  if (level < 0) {
    g_prefetch_level.compare_exchange_strong(level, static_cast<int>(initial_prefetch_level()));
    level = g_prefetch_level.load();
  }
  return {g_prefetch.load(), g_stream_out.load(), static_cast<PrefetchLevel>(level)};
}

void set_memory_tuning(const MemoryTuning& t) {
  if (t.prefetch < 0) throw std::invalid_argument("prefetch distance must be >= 0 elements");
  g_prefetch.store(t.prefetch);
  g_stream_out.store(t.stream_out);
  g_prefetch_level.store(static_cast<int>(t.prefetch_level));
}

void set_simd_level(SimdLevel level) {
  if (level > supported_simd_level()) {
    throw std::invalid_argument(std::string("set_simd_level: this CPU supports up to ") +
                                simd_level_name(supported_simd_level()) + ", not " + simd_level_name(level));
  }
  g_active_level.store(static_cast<int>(level), std::memory_order_relaxed);
}

const char* simd_level_name(SimdLevel level) {
  switch (level) {
    case SimdLevel::kAvx512Vbmi:
      return "avx512vbmi";
    case SimdLevel::kAvx512:
      return "avx512";
    case SimdLevel::kAvx2:
      return "avx2";
    default:
      return "scalar";
  }
}

AdamWCoef make_coef(const AdamWHyper& h) {
  const double step = static_cast<double>(h.step);
  const double bias_correction1 = 1 - std::pow(h.beta1, step);
  const double bias_correction2 = 1 - std::pow(h.beta2, step);
  const float lerp_weight = static_cast<float>(1 - h.beta1);
  const bool small_weight = std::abs(lerp_weight) < 0.5f;
  AdamWCoef c;
  c.decay = static_cast<float>(1 - h.lr * h.weight_decay);
  c.apply_decay = h.weight_decay != 0;
  c.lerp_coef = small_weight ? lerp_weight : lerp_weight - 1.0f;
  c.lerp_from_grad = !small_weight;
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1 - h.beta2);
  c.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  c.eps = static_cast<float>(h.eps);
  c.neg_step_size = static_cast<float>(-(h.lr / bias_correction1));
  const MemoryTuning tuning = memory_tuning();
  c.prefetch = tuning.prefetch;
  c.stream_out = tuning.stream_out;
  c.prefetch_level = static_cast<int>(tuning.prefetch_level);
  return c;
}

namespace {

// The entry point compiled for `level`.
template <class Fn>
Fn* by_level(SimdLevel level, Fn* avx512, Fn* avx2, Fn* scalar) {
  return level >= SimdLevel::kAvx512 ? avx512 : level == SimdLevel::kAvx2 ? avx2 : scalar;
}

template <class T>
T* at(T* p, int64_t i) {
  return p ? p + i : nullptr;
}

Bf16Pass offset(const Bf16Pass& a, int64_t i) {
  return {a.param_in + i, a.param + i, a.grad + i, at(a.grad_add, i),
          a.exp_avg_in + i, a.exp_avg + i, a.exp_avg_sq_in + i, a.exp_avg_sq + i, a.grad_scale, a.parts};
}

Fp32Pass offset(const Fp32Pass& a, int64_t i) {
  const size_t grad_size = a.grad_type == GradType::kBF16 ? 2 : 4;
  return {a.param_in + i, a.param + i, static_cast<const char*>(a.grad) + i * grad_size, a.grad_type,
          at(a.grad_add, i), a.exp_avg_in + i, a.exp_avg + i, a.exp_avg_sq_in + i, a.exp_avg_sq + i,
          at(a.param_out, i), a.grad_scale, a.parts};
}

// Two-part passes (Parts) exist for steps after the norm only: the kernels split no other kind.
void check_parts(Parts parts, bool summed, bool fp32_grad) {
  if (parts == Parts::kAll || (!summed && !fp32_grad)) return;
  throw std::invalid_argument(std::string("AdamW: a pass of the params or the moments alone takes a bf16 gradient "
                                          "as it is or scaled, got ") +
                              (summed ? "a sum (grad_add)" : "an fp32 gradient") + "; step it in one pass (Parts::kAll)");
}

}  // namespace

void adamw_bf16(const Bf16Pass& pass, int64_t n, const AdamWHyper& h, ThreadPool& pool, SimdLevel level,
                const std::optional<SrStream>& sr) {
  check_parts(pass.parts, pass.grad_add != nullptr, false);
  const AdamWCoef c = make_coef(h);
  auto span = by_level(level, adamw_bf16_span_avx512, adamw_bf16_span_avx2, adamw_bf16_span_scalar);
  if (!sr) {
    for_chunks(n, pool, [&](int64_t b, int64_t e) { span(offset(pass, b), e - b, c); });
    return;
  }
  for_chunks(n, pool, [&](int64_t b, int64_t e) {
    // The stream's key changes where index >> 32 does: each span gets one key, its lanes the low bits.
    for (int64_t i = b; i < e;) {
      const uint64_t index = static_cast<uint64_t>(sr->index + i);
      const uint64_t to_next = (uint64_t{1} << 32) - (index & 0xffffffffu);
      const int64_t len = static_cast<int64_t>(std::min<uint64_t>(static_cast<uint64_t>(e - i), to_next));
      const uint64_t key = sr_key(sr->seed, sr->stream, h.step, index >> 32);
      AdamWCoef piece = c;
      piece.stochastic = true;
      piece.sr_key = static_cast<uint32_t>(key);
      piece.sr_index = static_cast<uint32_t>(index);
      span(offset(pass, i), len, piece);
      i += len;
    }
  });
}

void adamw_bf16(uint16_t* param, const uint16_t* grad, uint16_t* exp_avg, uint16_t* exp_avg_sq, int64_t n,
                const AdamWHyper& h, ThreadPool& pool, SimdLevel level) {
  adamw_bf16(Bf16Pass{param, param, grad, nullptr, exp_avg, exp_avg, exp_avg_sq, exp_avg_sq}, n, h, pool,
             level);
}

void adamw_fp32(const Fp32Pass& pass, int64_t n, const AdamWHyper& h, ThreadPool& pool, SimdLevel level) {
  check_parts(pass.parts, pass.grad_add != nullptr, pass.grad_type == GradType::kFP32);
  const AdamWCoef c = make_coef(h);
  auto span = by_level(level, adamw_fp32_span_avx512, adamw_fp32_span_avx2, adamw_fp32_span_scalar);
  for_chunks(n, pool, [&](int64_t b, int64_t e) { span(offset(pass, b), e - b, c); });
}

void adamw_fp32(float* param, const void* grad, GradType grad_type, float* exp_avg, float* exp_avg_sq,
                uint16_t* param_out, int64_t n, const AdamWHyper& h, ThreadPool& pool, SimdLevel level) {
  adamw_fp32(Fp32Pass{param, param, grad, grad_type, nullptr, exp_avg, exp_avg, exp_avg_sq, exp_avg_sq, param_out},
             n, h, pool, level);
}

namespace {

// sum(b, e) of each fixed chunk of [0, n), the partial sums added in chunk order: a norm that does not depend on
// the thread count.
template <class Sum>
double chunked_sum(int64_t n, ThreadPool& pool, const Sum& sum) {
  constexpr int64_t kNormChunk = int64_t{1} << 18;
  const int64_t chunks = (n + kNormChunk - 1) / kNormChunk;
  std::vector<double> partial(static_cast<size_t>(chunks), 0.0);
  pool.parallel_for(chunks, [&](int64_t t) {
    const int64_t b = t * kNormChunk;
    partial[static_cast<size_t>(t)] = sum(b, std::min(n, b + kNormChunk));
  });
  double total = 0.0;
  for (double p : partial) total += p;
  return total;
}

}  // namespace

double bf16_accumulate(uint16_t* accum, const uint16_t* grad, int64_t n, bool norm, ThreadPool& pool,
                       SimdLevel level) {
  auto span = by_level(level, accumulate_span_avx512, accumulate_span_avx2, accumulate_span_scalar);
  return chunked_sum(n, pool, [&](int64_t b, int64_t e) {
    return span(accum + b, grad ? grad + b : nullptr, e - b, norm);
  });
}

double fp32_sum_squares(const float* x, int64_t n, ThreadPool& pool, SimdLevel level) {
  auto span = by_level(level, squares_f32_span_avx512, squares_f32_span_avx2, squares_f32_span_scalar);
  return chunked_sum(n, pool, [&](int64_t b, int64_t e) { return span(x + b, e - b); });
}

}  // namespace offload_ext
