// The sr_round_bf16 op: the stores of a bf16-sr AdamW step (stochastic_rounding.h) from its fp32 results,
// in one pass: param and exp_avg_sq rounded stochastically, exp_avg to nearest. The device-kept
// parameters' step (offload_ext.stochastic_rounding.adamw_step_sr) keeps torch's fused AdamW for the
// fp32 update and hands this op the rounding, which in integer torch ops took ~40 passes over
// int64 and fp32 temporaries (54 ms of a B1 step).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace offload_ext {

// Throws unless the fp32 results and the bf16 outputs are contiguous spans of one element count on one
// device and the span's stream indices offset .. offset + n - 1 share their value of index >> 32 (the
// key K is then one for the span); `who` names the op.
void check_sr_round_args(const char* who, const at::Tensor& param32, const at::Tensor& exp_avg32,
                         const at::Tensor& exp_avg_sq32, const at::Tensor& param, const at::Tensor& exp_avg,
                         const at::Tensor& exp_avg_sq, int64_t offset);

// uint32(K) of the rule for the span starting at stream index `offset`.
uint32_t sr_span_key(int64_t seed, int64_t stream, int64_t step, int64_t offset);

void sr_round_bf16_cpu(const at::Tensor& param32, const at::Tensor& exp_avg32, const at::Tensor& exp_avg_sq32,
                       const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                       int64_t seed, int64_t stream, int64_t step, int64_t offset);

}  // namespace offload_ext
