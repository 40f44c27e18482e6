// adamw8bit_step on the CPU: every tensor checked (device, layout, dtype, size, the maps' order) before the
// kernel runs, each refusal one line naming the argument.
#include "adamw8bit_op.h"

#include <cmath>

#include "../common/messages.h"
#include "../common/thread_pool.h"
#include "../kernels/adamw8bit.h"
#include "adamw_op.h"

namespace offload_ext {
namespace {

constexpr const char* kWho = "adamw8bit_step";

// `counted`: what the element count follows (param's, or a count of its own).
void check_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t numel, const char* counted,
                  c10::Device device) {
  check_span(kWho, t, name, t.numel(), device);
  TORCH_CHECK(t.numel() == numel, kWho, ": expected ", name, " to have ", num(numel), " elements ", counted, ", got ",
              num(t.numel()));
  TORCH_CHECK(t.scalar_type() == dtype, kWho, ": expected ", name, " of dtype ", dtype, ", got ", t.scalar_type());
}

// The encoder's search needs each map finite and strictly increasing. A map on the CPU serves a CUDA step too
// (its kernel takes the maps by value): no read back, which would wait for the step's stream.
at::Tensor checked_map(const at::Tensor& code, const char* name, c10::Device device) {
  check_tensor(code, name, at::kFloat, kCodes, "(the map's codes)", code.device().is_cpu() ? code.device() : device);
  const at::Tensor host = code.cpu();
  const float* c = host.const_data_ptr<float>();
  for (int k = 0; k < kCodes; ++k) {
    TORCH_CHECK(std::isfinite(c[k]), kWho, ": expected ", name, " finite, but code ", num(int64_t{k}), " is ",
                num(static_cast<double>(c[k])));
    TORCH_CHECK(k == 0 || c[k - 1] < c[k], kWho, ": expected ", name, " strictly increasing, but code ",
                num(int64_t{k - 1}), " is not below code ", num(int64_t{k}));
  }
  return host;
}

AdamWHyper checked_hyper(double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step) {
  TORCH_CHECK(step >= 1, kWho, ": expected step >= 1 (the 1-based count used for bias correction), got ", num(step));
  TORCH_CHECK(lr >= 0, kWho, ": expected lr >= 0, got ", num(lr));
  TORCH_CHECK(beta1 >= 0 && beta1 < 1, kWho, ": expected 0 <= beta1 < 1, got ", num(beta1));
  TORCH_CHECK(beta2 >= 0 && beta2 < 1, kWho, ": expected 0 <= beta2 < 1, got ", num(beta2));
  TORCH_CHECK(eps >= 0, kWho, ": expected eps >= 0, got ", num(eps));
  TORCH_CHECK(weight_decay >= 0, kWho, ": expected weight_decay >= 0, got ", num(weight_decay));
  return {lr, beta1, beta2, eps, weight_decay, step};
}

}  // namespace

Checked8bit checked_8bit(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                        const at::Tensor& exp_avg_sq, const at::Tensor& exp_avg_absmax,
                        const at::Tensor& exp_avg_sq_absmax, const at::Tensor& exp_avg_code,
                        const at::Tensor& exp_avg_sq_code, double lr, double beta1, double beta2, double eps,
                        double weight_decay, int64_t step, int64_t sr_offset) {
  const int64_t n = param.numel();
  const c10::Device device = param.device();
  TORCH_CHECK(param.scalar_type() == at::kBFloat16, kWho, ": expected param of dtype BFloat16 (bf16-8bit steps bf16 "
              "params), got ", param.scalar_type());
  check_span(kWho, param, "param", n, device);
  check_span(kWho, grad, "grad", n, device);
  TORCH_CHECK(grad.scalar_type() == at::kBFloat16 || grad.scalar_type() == at::kFloat, kWho,
              ": expected grad of dtype bfloat16 or float32, got ", grad.scalar_type());
  check_tensor(exp_avg, "exp_avg", at::kByte, n, "like param", device);
  check_tensor(exp_avg_sq, "exp_avg_sq", at::kByte, n, "like param", device);
  check_tensor(exp_avg_absmax, "exp_avg_absmax", at::kFloat, num_blocks(n), "(one a block of 256)", device);
  check_tensor(exp_avg_sq_absmax, "exp_avg_sq_absmax", at::kFloat, num_blocks(n), "(one a block of 256)", device);
  at::Tensor code_m = checked_map(exp_avg_code, "exp_avg_code", device);
  at::Tensor code_v = checked_map(exp_avg_sq_code, "exp_avg_sq_code", device);
  TORCH_CHECK(sr_offset >= 0, kWho, ": expected sr_offset >= 0 (the stream index of the span's element 0), got ",
              num(sr_offset));
  return {checked_hyper(lr, beta1, beta2, eps, weight_decay, step), std::move(code_m), std::move(code_v)};
}

void adamw8bit_step_cpu(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                        const at::Tensor& exp_avg_sq, const at::Tensor& exp_avg_absmax,
                        const at::Tensor& exp_avg_sq_absmax, const at::Tensor& exp_avg_code,
                        const at::Tensor& exp_avg_sq_code, double lr, double beta1, double beta2, double eps,
                        double weight_decay, int64_t step, std::optional<int64_t> sr_seed, int64_t sr_stream,
                        int64_t sr_offset) {
  TORCH_CHECK(param.device().is_cpu(), kWho, ": expected param on the CPU, got a tensor on ", param.device());
  const int64_t n = param.numel();
  const Checked8bit ck = checked_8bit(param, grad, exp_avg, exp_avg_sq, exp_avg_absmax, exp_avg_sq_absmax,
                                      exp_avg_code, exp_avg_sq_code, lr, beta1, beta2, eps, weight_decay, step,
                                      sr_offset);
  std::optional<SrStream> sr;
  if (sr_seed) sr = SrStream{static_cast<uint64_t>(*sr_seed), static_cast<uint64_t>(sr_stream), sr_offset};
  const EightBitPass pass{reinterpret_cast<uint16_t*>(param.data_ptr()), grad.const_data_ptr(),
                          grad.scalar_type() == at::kFloat ? GradType::kFP32 : GradType::kBF16,
                          exp_avg.data_ptr<uint8_t>(), exp_avg_sq.data_ptr<uint8_t>(),
                          exp_avg_absmax.data_ptr<float>(), exp_avg_sq_absmax.data_ptr<float>(),
                          ck.code_m.const_data_ptr<float>(), ck.code_v.const_data_ptr<float>()};
  adamw8bit(pass, n, ck.hyper, *global_pool(), active_simd_level(), sr);
}

}  // namespace offload_ext
