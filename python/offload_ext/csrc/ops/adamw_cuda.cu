// adamw_step on CUDA: one thread an element, AdamW's update from adamw_update.h with each operation
// rounded once to nearest (the fmas are the ones the host kernels write, nothing contracted), so a span
// stepped here gets the CPU kernel's bits. bf16 mode, and fp32/mixed mode with a bf16 or fp32 grad;
// stochastic rounding stays on the CPU.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>

#include "../kernels/adamw_update.h"
#include "../kernels/bf16.h"
#include "../kernels/device_lane.h"
#include "adamw_op.h"

namespace offload_ext {
namespace {

constexpr int kThreads = 256;

// The gradient as the step reads it: as stored, or bf16(grad * scale) (adamw_kernel.h's kGradScale).
template <bool kScale>
__device__ inline float grad_bf16(const uint16_t* g, int64_t i, float scale) {
  const float x = bf16_to_float(g[i]);
  return kScale ? bf16_to_float(bf16_round_bits(DeviceLane::mul(x, scale))) : x;
}

// An fp32 gradient as the step reads it: as stored, or fp32(grad * scale) (adamw_kernel.h's load_grad_f32).
template <bool kScale>
__device__ inline float grad_f32(const float* g, int64_t i, float scale) {
  return kScale ? DeviceLane::mul(g[i], scale) : g[i];
}

template <bool kScale>
__global__ void __launch_bounds__(kThreads) adamw_bf16_kernel(uint16_t* __restrict__ p, const uint16_t* __restrict__ g,
                                                              uint16_t* __restrict__ m, uint16_t* __restrict__ v,
                                                              int64_t n, AdamWCoef c, float scale) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    float P = bf16_to_float(p[i]), M = bf16_to_float(m[i]), S = bf16_to_float(v[i]);
    adamw_update<DeviceLane>(P, grad_bf16<kScale>(g, i, scale), M, S, c);
    p[i] = bf16_round_bits(P);
    m[i] = bf16_round_bits(M);
    v[i] = bf16_round_bits(S);
  }
}

template <bool kGradBF16, bool kScale>
__global__ void __launch_bounds__(kThreads) adamw_fp32_kernel(float* __restrict__ p, const void* __restrict__ g,
                                                              float* __restrict__ m, float* __restrict__ v,
                                                              uint16_t* __restrict__ out, int64_t n, AdamWCoef c,
                                                              float scale) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    float P = p[i], M = m[i], S = v[i];
    const float G = kGradBF16 ? grad_bf16<kScale>(static_cast<const uint16_t*>(g), i, scale)
                              : grad_f32<kScale>(static_cast<const float*>(g), i, scale);
    adamw_update<DeviceLane>(P, G, M, S, c);
    p[i] = P;
    m[i] = M;
    v[i] = S;
    if (out != nullptr) out[i] = bf16_round_bits(P);
  }
}

void adamw_step_cuda(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                     const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& param_out, double lr,
                     double beta1, double beta2, double eps, double weight_decay, int64_t step,
                     std::optional<int64_t> sr_seed, int64_t /*sr_stream*/, int64_t /*sr_offset*/, double grad_scale) {
  TORCH_CHECK(!sr_seed.has_value(), "adamw_step: stochastic rounding (sr_seed) has no CUDA kernel; step a bf16-sr "
              "span on the CPU, or on the device without sr_seed");
  const StepUnit u = checked_unit("adamw_step", param, grad, exp_avg, exp_avg_sq, param_out, param.device());
  const AdamWCoef c = make_coef(checked_hyper(u, lr, beta1, beta2, eps, weight_decay, step, grad_scale));
  const int64_t n = u.numel;
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(param.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const auto blocks = static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535));
  const float scale = static_cast<float>(grad_scale);
  const bool scaled = scale != 1.0f;  // as the host kernels choose their gradient read
  if (u.bf16_mode) {
    auto* p = static_cast<uint16_t*>(u.param);
    const auto* g = static_cast<const uint16_t*>(u.grad);
    auto* m = static_cast<uint16_t*>(u.exp_avg);
    auto* v = static_cast<uint16_t*>(u.exp_avg_sq);
    const auto kernel = scaled ? adamw_bf16_kernel<true> : adamw_bf16_kernel<false>;
    kernel<<<blocks, kThreads, 0, stream>>>(p, g, m, v, n, c, scale);
  } else {
    auto* p = static_cast<float*>(u.param);
    auto* m = static_cast<float*>(u.exp_avg);
    auto* v = static_cast<float*>(u.exp_avg_sq);
    const bool bf16_grad = u.grad_type == GradType::kBF16;
    const auto kernel = bf16_grad ? (scaled ? adamw_fp32_kernel<true, true> : adamw_fp32_kernel<true, false>)
                                  : (scaled ? adamw_fp32_kernel<false, true> : adamw_fp32_kernel<false, false>);
    kernel<<<blocks, kThreads, 0, stream>>>(p, u.grad, m, v, u.param_out, n, c, scale);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace offload_ext

TORCH_LIBRARY_IMPL(offload_ext, CUDA, m) { m.impl("adamw_step", &offload_ext::adamw_step_cuda); }
