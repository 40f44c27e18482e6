// The adamw_step op's CPU kernel and the checks its CPU and CUDA kernels share: they turn one AdamW span's
// tensors into a StepUnit (the Engine checks the spans of its units the same way).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

#include "../kernels/adamw_unit.h"

namespace offload_ext {

// Throws unless `t` is a contiguous tensor of `numel` elements on `device`; `who` and `name` name it in the
// message.
void check_span(const char* who, const at::Tensor& t, const char* name, int64_t numel,
                c10::Device device = c10::Device(c10::kCPU));

// Throws unless `t` has dtype `expected`, the one precision `mode` (named in the message) takes for `name`.
void check_dtype(const char* who, const at::Tensor& t, const char* name, at::ScalarType expected, const char* mode);

// Validates one AdamW span's tensors (shapes, layout, the dtypes of a precision mode, all on param's device
// when `device` is not given: the CPU) and describes it.
StepUnit checked_unit(const char* who, const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                      const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& param_out,
                      c10::Device device = c10::Device(c10::kCPU), bool eight_bit = false);

// The adamw_step op's scalar arguments, checked (the same rules on every device); grad_scale != 1 needs a bf16
// gradient (the step reads bf16(grad * grad_scale), rounded as torch's clipping rounds a bf16 .grad).
AdamWHyper checked_hyper(const StepUnit& unit, double lr, double beta1, double beta2, double eps, double weight_decay,
                         int64_t step, double grad_scale);

// The random stream of a bf16 unit stepped with stochastic rounding (sr_seed given), checked.
std::optional<SrStream> checked_sr(const char* who, const StepUnit& unit, const std::optional<int64_t>& sr_seed,
                                   int64_t sr_stream, int64_t sr_offset);

// torch.ops.offload_ext.adamw_step: one fused AdamW step over a span, in place, on the global pool; with
// sr_seed, bf16 stores round stochastically, drawing elements sr_offset.. of stream (sr_seed, sr_stream).
void adamw_step_cpu(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                    const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& param_out, double lr,
                    double beta1, double beta2, double eps, double weight_decay, int64_t step,
                    std::optional<int64_t> sr_seed, int64_t sr_stream, int64_t sr_offset, double grad_scale);

}  // namespace offload_ext
