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

// torch.ops.offload_ext.adamw_step: one fused AdamW step over a span, in place, on the global pool.
void adamw_step_cpu(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                    const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& param_out, double lr,
                    double beta1, double beta2, double eps, double weight_decay, int64_t step);

}  // namespace offload_ext
