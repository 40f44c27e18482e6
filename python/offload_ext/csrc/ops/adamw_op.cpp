// The adamw_step op on the CPU: checks a span's tensors against the precision mode their dtypes choose, then
// runs the fused kernel on the global pool. The checks serve the CUDA kernel (adamw_cuda.cu) too.
#include "adamw_op.h"

#include <cmath>

#include "../common/messages.h"
#include "../common/thread_pool.h"

namespace offload_ext {

void check_dtype(const char* who, const at::Tensor& t, const char* name, at::ScalarType expected, const char* mode) {
  TORCH_CHECK(t.scalar_type() == expected, who, ": in ", mode, " mode expected ", name, " of dtype ", expected,
              ", got ", t.scalar_type());
}

void check_span(const char* who, const at::Tensor& t, const char* name, int64_t numel, c10::Device device) {
  if (device.is_cpu()) {
    TORCH_CHECK(t.device().is_cpu(), who, ": expected ", name, " on the CPU, got a tensor on ", t.device());
  } else {
    TORCH_CHECK(t.device() == device, who, ": expected ", name, " on ", device, " like param, got a tensor on ",
                t.device());
  }
  TORCH_CHECK(t.is_contiguous(), who, ": expected ", name,
              " to be contiguous (the kernel steps one flat span); call .contiguous() on it first");
  TORCH_CHECK(t.numel() == numel, who, ": expected ", name, " to have ", num(numel), " elements like param, got ",
              num(t.numel()));
}

StepUnit checked_unit(const char* who, const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                      const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& param_out, c10::Device device,
                      bool eight_bit) {
  const int64_t n = param.numel();
  check_span(who, param, "param", n, device);
  check_span(who, grad, "grad", n, device);
  check_span(who, exp_avg, "exp_avg", n, device);
  check_span(who, exp_avg_sq, "exp_avg_sq", n, device);
  StepUnit u{};
  u.numel = n;
  u.param = param.data_ptr();
  u.grad = grad.data_ptr();
  u.exp_avg = exp_avg.data_ptr();
  u.exp_avg_sq = exp_avg_sq.data_ptr();
  if (param.scalar_type() == at::kBFloat16 || eight_bit) {
    const char* mode = eight_bit ? "8-bit (bf16 param, uint8 moments)" : "bf16 (bf16 param)";
    const at::ScalarType moments = eight_bit ? at::kByte : at::kBFloat16;
    check_dtype(who, param, "param", at::kBFloat16, mode);
    check_dtype(who, grad, "grad", at::kBFloat16, mode);
    check_dtype(who, exp_avg, "exp_avg", moments, mode);
    check_dtype(who, exp_avg_sq, "exp_avg_sq", moments, mode);
    u.eight_bit = eight_bit;
    TORCH_CHECK(!param_out.has_value(), who, ": param_out is only for fp32 master params; "
                "a bf16 param is updated in place");
    u.bf16_mode = true;
    return u;
  }
  TORCH_CHECK(param.scalar_type() == at::kFloat, who, ": expected param of dtype bfloat16 (bf16 mode) or ",
              "float32 (fp32/mixed mode), got ", param.scalar_type());
  const char* mode = "fp32/mixed (float32 param)";
  check_dtype(who, exp_avg, "exp_avg", at::kFloat, mode);
  check_dtype(who, exp_avg_sq, "exp_avg_sq", at::kFloat, mode);
  TORCH_CHECK(grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kBFloat16, who, ": in ", mode,
              " mode expected grad of dtype float32 or bfloat16, got ", grad.scalar_type());
  u.grad_type = grad.scalar_type() == at::kBFloat16 ? GradType::kBF16 : GradType::kFP32;
  if (param_out.has_value()) {
    check_span(who, *param_out, "param_out", n, device);
    check_dtype(who, *param_out, "param_out", at::kBFloat16, mode);
    u.param_out = reinterpret_cast<uint16_t*>(param_out->data_ptr());
  }
  return u;
}

std::optional<SrStream> checked_sr(const char* who, const StepUnit& unit, const std::optional<int64_t>& sr_seed,
                                   int64_t sr_stream, int64_t sr_offset) {
  if (!sr_seed.has_value()) return std::nullopt;
  TORCH_CHECK(unit.bf16_mode, who, ": stochastic rounding (sr_seed) is for bf16 params, bf16 moments (bf16 mode); "
              "an fp32 master needs none");
  TORCH_CHECK(sr_offset >= 0, who, ": expected sr_offset >= 0 (the stream index of the span's element 0), got ",
              num(sr_offset));
  return SrStream{static_cast<uint64_t>(*sr_seed), static_cast<uint64_t>(sr_stream), sr_offset};
}

AdamWHyper checked_hyper(const StepUnit& unit, double lr, double beta1, double beta2, double eps, double weight_decay,
                         int64_t step, double grad_scale) {
  TORCH_CHECK(step >= 1, "adamw_step: expected step >= 1 (the 1-based count used for bias correction), got ",
              num(step));
  TORCH_CHECK(lr >= 0, "adamw_step: expected lr >= 0, got ", num(lr));
  TORCH_CHECK(beta1 >= 0 && beta1 < 1, "adamw_step: expected 0 <= beta1 < 1, got ", num(beta1));
  TORCH_CHECK(beta2 >= 0 && beta2 < 1, "adamw_step: expected 0 <= beta2 < 1, got ", num(beta2));
  TORCH_CHECK(eps >= 0, "adamw_step: expected eps >= 0, got ", num(eps));
  TORCH_CHECK(weight_decay >= 0, "adamw_step: expected weight_decay >= 0, got ", num(weight_decay));
  TORCH_CHECK(std::isfinite(grad_scale) && grad_scale >= 0,
              "adamw_step: expected a finite grad_scale >= 0 (a clipping coefficient), got ", num(grad_scale));
  return {lr, beta1, beta2, eps, weight_decay, step};
}

void adamw_step_cpu(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                    const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& param_out, double lr,
                    double beta1, double beta2, double eps, double weight_decay, int64_t step,
                    std::optional<int64_t> sr_seed, int64_t sr_stream, int64_t sr_offset, double grad_scale) {
  StepUnit unit = checked_unit("adamw_step", param, grad, exp_avg, exp_avg_sq, param_out);
  const AdamWHyper h = checked_hyper(unit, lr, beta1, beta2, eps, weight_decay, step, grad_scale);
  unit.sr = checked_sr("adamw_step", unit, sr_seed, sr_stream, sr_offset);
  adamw_unit(unit, unit.grad, h, *global_pool(), static_cast<float>(grad_scale));
}

}  // namespace offload_ext
