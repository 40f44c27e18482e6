// sr_round_bf16 on CUDA: one thread an element, the rule's integer arithmetic from stochastic_rounding.h
// (the same functions the CPU kernels use), so the bits are the CPU op's and the torch-op rule's.
#include "sr_round.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../kernels/stochastic_rounding.h"

namespace offload_ext {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) sr_round_kernel(const float* __restrict__ p, const float* __restrict__ m,
                                                            const float* __restrict__ v, uint16_t* __restrict__ po,
                                                            uint16_t* __restrict__ mo, uint16_t* __restrict__ vo,
                                                            int64_t n, uint32_t first) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    sr_store(p[i], m[i], v[i], sr_hash32_word(first + static_cast<uint32_t>(i)), po + i, mo + i, vo + i);
  }
}

void sr_round_bf16_cuda(const at::Tensor& param32, const at::Tensor& exp_avg32, const at::Tensor& exp_avg_sq32,
                        const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                        int64_t seed, int64_t stream, int64_t step, int64_t offset) {
  check_sr_round_args("sr_round_bf16", param32, exp_avg32, exp_avg_sq32, param, exp_avg, exp_avg_sq, offset);
  const int64_t n = param32.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(param32.device());
  const uint32_t first = static_cast<uint32_t>(offset) + sr_span_key(seed, stream, step, offset);
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, 65535);
  sr_round_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      param32.const_data_ptr<float>(), exp_avg32.const_data_ptr<float>(), exp_avg_sq32.const_data_ptr<float>(),
      reinterpret_cast<uint16_t*>(param.data_ptr()), reinterpret_cast<uint16_t*>(exp_avg.data_ptr()),
      reinterpret_cast<uint16_t*>(exp_avg_sq.data_ptr()), n, first);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace offload_ext

TORCH_LIBRARY_IMPL(offload_ext, CUDA, m) { m.impl("sr_round_bf16", &offload_ext::sr_round_bf16_cuda); }
