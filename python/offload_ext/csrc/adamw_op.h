// The adamw_step op on CPU tensors, and the checks that turn one AdamW span's tensors into a StepUnit
// (the Engine checks the spans of its units the same way).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

#include "step_scheduler.h"

namespace offload_ext {

// Throws unless `t` is a contiguous CPU tensor of `numel` elements; `who` and `name` name it in the message.
void check_span(const char* who, const at::Tensor& t, const char* name, int64_t numel);

// Validates one AdamW span's tensors (shapes, layout, the dtypes of a precision mode) and describes it.
StepUnit checked_unit(const char* who, const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                      const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& param_out);

// The random stream of a bf16 unit stepped with stochastic rounding (sr_seed given), checked.
std::optional<SrStream> checked_sr(const char* who, const StepUnit& unit, const std::optional<int64_t>& sr_seed,
                                   int64_t sr_stream, int64_t sr_offset);

// torch.ops.offload_ext.adamw_step: one fused AdamW step over a span, in place, on the global pool; with
// sr_seed, bf16 stores round stochastically, drawing elements sr_offset.. of stream (sr_seed, sr_stream).
void adamw_step_cpu(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                    const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& param_out, double lr,
                    double beta1, double beta2, double eps, double weight_decay, int64_t step,
                    std::optional<int64_t> sr_seed, int64_t sr_stream, int64_t sr_offset);

}  // namespace offload_ext
