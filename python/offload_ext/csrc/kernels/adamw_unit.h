// StepUnit: one AdamW span described by its pointers (the op layer and the step scheduler both build one),
// and its fused step: in place, or out of place through second state buffers for speculative clipping.
#pragma once

#include <cstdint>
#include <optional>

#include "adamw.h"

namespace offload_ext {

struct StepUnit {
  bool bf16_mode;           // all-bf16 span; else fp32 master with grad_type grad
  void* param;              // bf16 or fp32
  const void* grad;         // where the gradient copy lands: bf16 (bf16 mode) or grad_type
  GradType grad_type;
  void* exp_avg;
  void* exp_avg_sq;
  uint16_t* param_out;      // fp32 mode only, may be null
  uint16_t* accum;          // bf16 gradient sum (accumulation), or the landed gradient kept for a redo; else null
  // Speculative clipping: second state buffers, null without it. A speculative step writes the param
  // (mixed: the master) and the moments there, and they become the live ones: the state before the step
  // survives for an exact redo. In bf16 mode the next forward then copies the param from alt_param's
  // buffer (the caller follows swapped()), so alt_param is page-locked like param. Stepping the param in
  // place and saving its old value instead cost ~18 % more than a plain step (the host passes measured:
  // ~8.2 ms against 6.95 for a B1 layer once its 1.9 ms host norm pass is taken out; the out-of-place redo
  // took 7.8, and out of place the speculative step costs a plain one's).
  void* alt_param;
  void* alt_exp_avg;
  void* alt_exp_avg_sq;
  int64_t numel;
  // "bf16-8bit" (bf16_mode too): exp_avg and exp_avg_sq (and their alt_) hold uint8 codes of the dynamic maps
  // `codes` (exp_avg's 256, then exp_avg_sq's), with an fp32 absmax per kBlock elements of each span (a unit's
  // group range) in these arrays; a piece's absmax pointers point at its first block (the caller sets them: a
  // span's blocks count from its own start, see run_job).
  bool eight_bit = false;
  const float* codes = nullptr;
  float* exp_avg_absmax = nullptr;
  float* exp_avg_sq_absmax = nullptr;
  float* alt_exp_avg_absmax = nullptr;
  float* alt_exp_avg_sq_absmax = nullptr;
  // bf16 mode with stochastic rounding ("bf16-sr"): the unit's random stream, its index at element 0 of
  // this span (a slice or group range of a unit starts past the unit's 0, so its bits do not depend on
  // the slicing); speculative steps and redos draw the same bits as an in-place step.
  std::optional<SrStream> sr;
};

// Where a step reads its state and writes the result (see StepUnit's second buffers).
enum class Flow {
  kInPlace,
  kToAlt,    // speculative: from the live state into the second buffers
  kFromAlt,  // redo, after the swap: from the state before the speculative step into the live one
};

// One fused AdamW pass over the unit with gradient `grad` (bf16 `grad_add`, optional, summed into it in the
// pass); a bf16 gradient with `scale` != 1 is read as bf16(grad * scale), as clipping scales it.
void adamw_unit_pass(const StepUnit& unit, const void* grad, const uint16_t* grad_add, float scale, Flow flow,
                     const AdamWHyper& h, ThreadPool& pool, Parts parts = Parts::kAll);

// One fused AdamW pass in place with gradient `grad` (its landed copy or its accumulator).
void adamw_unit(const StepUnit& unit, const void* grad, const AdamWHyper& h, ThreadPool& pool, float scale = 1.0f);

// Elements [begin, end) of a unit, as a unit of its own (8-bit: its absmax pointers left at the unit's, for the
// caller to set).
StepUnit sub_unit(const StepUnit& unit, int64_t begin, int64_t end);

// An 8-bit unit with its absmax pointers at block `block` of its arrays.
StepUnit at_block(const StepUnit& unit, int64_t block);

// After a speculative step the second buffers hold the live state, and the first the state before.
void swap_state(StepUnit& unit);

}  // namespace offload_ext
