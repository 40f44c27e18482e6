// Fused AdamW over one contiguous span, with torch.optim.AdamW's arithmetic, in three
// precision modes (bf16 with round-to-nearest or stochastic rounding, mixed, fp32), SIMD-dispatched at
// run time and spread over the library's ThreadPool.
#pragma once

#include <cstdint>
#include <optional>

#include "../common/thread_pool.h"

namespace offload_ext {

// kAvx512Vbmi: AVX-512 with VBMI's byte permutes (Ice Lake, Zen 4 and later), which only the 8-bit kernel's
// decoder uses; every other kernel runs its AVX-512 loops there.
enum class SimdLevel { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Vbmi = 3 };

// Highest level this CPU supports.
SimdLevel supported_simd_level();
// The level the kernels use: the supported one, capped by OFFLOAD_EXT_SIMD=scalar|avx2|avx512 or
// by set_simd_level (which throws for a level this CPU lacks).
SimdLevel active_simd_level();
void set_simd_level(SimdLevel level);
SimdLevel parse_simd_level(const char* name);
const char* simd_level_name(SimdLevel level);

struct AdamWHyper {
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  int64_t step;  // 1-based step count used for bias correction
};

// Per-call constants in the precision the kernels compute in, derived exactly as torch's
// fused CPU AdamW derives them (in double, then rounded once to float).
struct AdamWCoef {
  float decay;          // 1 - lr * weight_decay
  bool apply_decay;     // weight_decay != 0
  float lerp_coef;      // exp_avg.lerp_(grad, 1 - beta1), as fma(coef, grad - m, base)
  bool lerp_from_grad;  // base is grad (weight >= 0.5) instead of exp_avg
  float beta2;
  float one_minus_beta2;
  float bias_correction2_sqrt;
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^step)
  // Memory tuning, not arithmetic: software-prefetch distance in elements (0 = off), the cache
  // level it fills (PrefetchLevel), and whether write-only stores (the bf16 param_out, a pass out of
  // place) may bypass the cache (non-temporal stores).
  int64_t prefetch = 0;
  int prefetch_level = 0;
  bool stream_out = false;
  // Stochastic rounding of a bf16 pass (stochastic_rounding.h): uint32(K) of the elements of this span,
  // and the low 32 bits of the stream index of its element 0 (the dispatcher cuts spans where the high
  // bits change, so lanes count on in 32 bits).
  bool stochastic = false;
  uint32_t sr_key = 0;
  uint32_t sr_index = 0;
};

// The cache a software prefetch fills, as _mm_prefetch's hints: L1 (T0; the line waits in one of the core's
// fill buffers), L2 (T1; it waits in the L2's queue instead), or NTA (L1, not the shared cache). L1 stays the
// default: L2 did not speed the B2 params pass and slowed training on the GPU host (docs/history.md, run 106).
enum class PrefetchLevel : int { kL1 = 0, kL2 = 1, kNTA = 2 };

// Memory tuning knobs (process-wide, atomic): see AdamWCoef. Defaults come from
// OFFLOAD_EXT_PREFETCH (elements), OFFLOAD_EXT_PREFETCH_LEVEL (l1, l2 or nta) and
// OFFLOAD_EXT_STREAM_OUT (0/1) when set.
struct MemoryTuning {
  int64_t prefetch;
  bool stream_out;
  PrefetchLevel prefetch_level = PrefetchLevel::kL1;
};
PrefetchLevel parse_prefetch_level(const char* name);
const char* prefetch_level_name(PrefetchLevel level);
MemoryTuning memory_tuning();
void set_memory_tuning(const MemoryTuning& t);
AdamWCoef make_coef(const AdamWHyper& h);

enum class GradType { kBF16, kFP32 };

// What a pass stores. A step the next forward waits for (after the norm: a redo or a clipped step) can run
// as two passes: kParams stores the param alone (the forward's copy waits for it), kMoments the moments
// alone, later. Each computes the whole update, so the two give the bits of one kAll pass; the moments pass
// never reads the param, so in place the params pass goes first and the moments pass still reads the old
// moments.
enum class Parts : uint8_t { kAll = 0, kParams = 1, kMoments = 2 };

// Where one AdamW pass reads and writes (pointers at element 0 of the span). In place, each *_out
// equals its *_in. Out of place, the state before the pass survives: speculative clipping redoes a
// step from it; the stores out of place bypass the cache (non-temporal) where aligned. `grad_add` (optional, bf16): the step uses bf16(grad_add + grad), one rounding, as
// torch sums .grad over micro-batches, so the last micro-batch needs no separate accumulate pass.
struct Bf16Pass {
  const uint16_t* param_in;
  uint16_t* param;             // the stepped param (bf16 mode: also what the next forward copies)
  const uint16_t* grad;
  const uint16_t* grad_add;
  const uint16_t* exp_avg_in;
  uint16_t* exp_avg;
  const uint16_t* exp_avg_sq_in;
  uint16_t* exp_avg_sq;
  float grad_scale = 1.0f;     // != 1: the step uses bf16(grad * grad_scale) (clipping; not with grad_add)
  Parts parts = Parts::kAll;
};

struct Fp32Pass {
  const float* param_in;       // fp32 master
  float* param;
  const void* grad;
  GradType grad_type;
  const uint16_t* grad_add;    // bf16 grads only
  const float* exp_avg_in;
  float* exp_avg;
  const float* exp_avg_sq_in;
  float* exp_avg_sq;
  uint16_t* param_out;         // optional: the stepped param rounded to bf16
  float grad_scale = 1.0f;     // != 1: the step uses bf16(grad * grad_scale) (a bf16 grad) or the fp32 product
  Parts parts = Parts::kAll;   // kParams stores param and param_out
};

// Where a bf16 pass draws its stochastic rounding bits (stochastic_rounding.h): (seed, stream) name the
// stream, `index` is the stream index of the pass's element 0 (a slice of a unit starts past 0).
struct SrStream {
  uint64_t seed;
  uint64_t stream;
  int64_t index;
};

// "bf16" mode: param, grad, exp_avg, exp_avg_sq all bf16 (bits as uint16_t); math in fp32. With `sr`
// ("bf16-sr"), param and exp_avg_sq are stored by stochastic rounding instead of to nearest even.
void adamw_bf16(const Bf16Pass& pass, int64_t n, const AdamWHyper& h, ThreadPool& pool, SimdLevel level,
                const std::optional<SrStream>& sr = std::nullopt);
void adamw_bf16(uint16_t* param, const uint16_t* grad, uint16_t* exp_avg, uint16_t* exp_avg_sq,
                int64_t n, const AdamWHyper& h, ThreadPool& pool, SimdLevel level);  // in place

// "mixed" and "fp32" modes: fp32 master param and states, grad bf16 or fp32; when param_out is
// not null the updated param is also written there rounded to bf16 in the same pass.
void adamw_fp32(const Fp32Pass& pass, int64_t n, const AdamWHyper& h, ThreadPool& pool, SimdLevel level);
void adamw_fp32(float* param, const void* grad, GradType grad_type, float* exp_avg, float* exp_avg_sq,
                uint16_t* param_out, int64_t n, const AdamWHyper& h, ThreadPool& pool, SimdLevel level);

// Gradient sums for accumulation and clipping, bf16 spans, fp32 math: accum = bf16(accum + grad)
// (grad null: accum unchanged); returns the float64 sum of squares of the resulting accum when `norm`
// (each square taken in float64: exact, and finite for any finite value), else 0. The sum's order is fixed by
// the ISA and fixed chunks, not by the thread count.
double bf16_accumulate(uint16_t* accum, const uint16_t* grad, int64_t n, bool norm, ThreadPool& pool,
                       SimdLevel level);

// The float64 sum of squares of an fp32 span (each square exact in float64), in bf16_accumulate's fixed order.
double fp32_sum_squares(const float* x, int64_t n, ThreadPool& pool, SimdLevel level);

// Per-ISA span kernels, each defined in its own translation unit compiled for that ISA.
#define OFFLOAD_EXT_DECLARE_SPANS(isa)                                               \
  void adamw_bf16_span_##isa(const Bf16Pass& pass, int64_t n, const AdamWCoef& c);   \
  void adamw_fp32_span_##isa(const Fp32Pass& pass, int64_t n, const AdamWCoef& c);   \
  double accumulate_span_##isa(uint16_t* accum, const uint16_t* grad, int64_t n, bool norm); \
  double squares_f32_span_##isa(const float* x, int64_t n);
OFFLOAD_EXT_DECLARE_SPANS(scalar)
OFFLOAD_EXT_DECLARE_SPANS(avx2)
OFFLOAD_EXT_DECLARE_SPANS(avx512)
#undef OFFLOAD_EXT_DECLARE_SPANS

}  // namespace offload_ext
