// adamw8bit_step on CUDA: one thread block a block of kBlock elements, so that the block's new absmax is one
// reduction in shared memory. Each thread decodes its element from the maps in shared memory, steps it with
// adamw_update.h's operations each rounded once (as adamw_cuda.cu does), stores the param (to nearest, or by
// stochastic_rounding.h's rule from the element's stream index), then encodes its moments against the block's
// new absmax with the CPU kernels' binary search over the midpoints: the CPU kernel's bits on the device.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "../kernels/adamw8bit.h"
#include "../kernels/adamw_update.h"
#include "../kernels/bf16.h"
#include "../kernels/device_lane.h"
#include "../kernels/stochastic_rounding.h"
#include "adamw8bit_op.h"

namespace offload_ext {
namespace {

constexpr int kThreads = static_cast<int>(kBlock);  // a thread an element of a block, and one a code
static_assert(kBlock == kCodes, "load_maps reads a map's code per thread");
constexpr int kWarps = kThreads / 32;

struct Maps {  // a moment's codes and the midpoints between neighbours (then +inf), as the CPU tables hold them
  float code[kCodes];
  float mid[kCodes];
};

// The stochastic rounding of the params: the stream's key and the span's element 0's index in it.
struct SrArgs {
  uint64_t seed;
  uint64_t stream;
  int64_t step;
  int64_t index;
};

// Both maps, passed to the kernel by value (2 KiB of its parameters): a map on the CPU needs no copy to the device.
struct MapArgs {
  float m[kCodes];
  float v[kCodes];
};

__device__ void load_maps(const float* code, Maps& m) {
  const int t = threadIdx.x;
  m.code[t] = code[t];
  __syncthreads();
  m.mid[t] = t + 1 < kCodes ? __fmul_rn(__fadd_rn(m.code[t], m.code[t + 1]), 0.5f) : INFINITY;
}

// The count of midpoints for which mid >= x is false (searched_code in adamw8bit_kernel.h).
__device__ uint8_t nearest(const Maps& m, float x) {
  uint32_t q = 0;
  for (uint32_t step = 128; step != 0; step >>= 1) q += !(m.mid[q + step - 1] >= x) ? step : 0;
  return static_cast<uint8_t>(q);
}

// The block's largest value of `bits` (threads past the span give 0).
__device__ uint32_t block_max(uint32_t bits, uint32_t* scratch) {
  for (int offset = 16; offset != 0; offset >>= 1) bits = max(bits, __shfl_xor_sync(0xffffffffu, bits, offset));
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = bits;
  __syncthreads();
  uint32_t all = 0;
  for (int w = 0; w < kWarps; ++w) all = max(all, scratch[w]);
  return all;
}

__device__ float float_of(uint32_t bits) { return __uint_as_float(bits); }

__device__ uint8_t encode(const Maps& m, float x, float absmax) {
  const float scale = absmax == 0.0f ? 0.0f : __fdiv_rn(1.0f, absmax);
  return nearest(m, __fmul_rn(x, scale));
}

template <bool kSR, bool kFp32Grad>
__global__ void __launch_bounds__(kThreads)
    adamw8bit_kernel(uint16_t* __restrict__ p, const void* __restrict__ g, uint8_t* __restrict__ qm,
                     uint8_t* __restrict__ qv, float* __restrict__ am, float* __restrict__ av,
                     const __grid_constant__ MapArgs codes, int64_t n, int64_t blocks, AdamWCoef c, SrArgs sr) {
  __shared__ Maps maps_m, maps_v;
  __shared__ uint32_t scratch[2][kWarps];
  load_maps(codes.m, maps_m);
  load_maps(codes.v, maps_v);
  __syncthreads();
  for (int64_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    const int64_t i = b * kBlock + threadIdx.x;
    const bool in = i < n;
    float M = 0.0f, S = 0.0f;
    if (in) {
      float P = bf16_to_float(p[i]);
      M = __fmul_rn(maps_m.code[qm[i]], am[b]);
      S = __fmul_rn(maps_v.code[qv[i]], av[b]);
      const float G = kFp32Grad ? static_cast<const float*>(g)[i] : bf16_to_float(static_cast<const uint16_t*>(g)[i]);
      adamw_update<DeviceLane>(P, G, M, S, c);
      if (kSR) {
        const uint64_t index = static_cast<uint64_t>(sr.index + i);
        const uint32_t key = static_cast<uint32_t>(sr_key(sr.seed, sr.stream, sr.step, index >> 32));
        p[i] = bf16_sr_bits(P, sr_hash32_word(static_cast<uint32_t>(index) + key) & 0xffffu);
      } else {
        p[i] = bf16_round_bits(P);
      }
    }
    // every thread has read am[b] and av[b] before block_max's barrier; thread 0 writes them after it
    const float new_m = float_of(block_max(in ? float_bits(M) & 0x7fffffffu : 0u, scratch[0]));
    const float new_v = float_of(block_max(in ? float_bits(S) & 0x7fffffffu : 0u, scratch[1]));
    if (in) {
      qm[i] = encode(maps_m, M, new_m);
      qv[i] = encode(maps_v, S, new_v);
    }
    if (threadIdx.x == 0) {
      am[b] = new_m;
      av[b] = new_v;
    }
    __syncthreads();  // the scratch is reused by the next block
  }
}

void adamw8bit_step_cuda(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                         const at::Tensor& exp_avg_sq, const at::Tensor& exp_avg_absmax,
                         const at::Tensor& exp_avg_sq_absmax, const at::Tensor& exp_avg_code,
                         const at::Tensor& exp_avg_sq_code, double lr, double beta1, double beta2, double eps,
                         double weight_decay, int64_t step, std::optional<int64_t> sr_seed, int64_t sr_stream,
                         int64_t sr_offset) {
  const Checked8bit ck = checked_8bit(param, grad, exp_avg, exp_avg_sq, exp_avg_absmax, exp_avg_sq_absmax,
                                      exp_avg_code, exp_avg_sq_code, lr, beta1, beta2, eps, weight_decay, step,
                                      sr_offset);
  const int64_t n = param.numel();
  if (n == 0) return;
  const AdamWCoef c = make_coef(ck.hyper);
  MapArgs codes;
  std::copy_n(ck.code_m.const_data_ptr<float>(), kCodes, codes.m);
  std::copy_n(ck.code_v.const_data_ptr<float>(), kCodes, codes.v);
  const SrArgs sr{static_cast<uint64_t>(sr_seed.value_or(0)), static_cast<uint64_t>(sr_stream), step, sr_offset};
  const c10::cuda::CUDAGuard guard(param.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t blocks = num_blocks(n);
  const auto grid = static_cast<unsigned>(std::min<int64_t>(blocks, 65535));
  auto* p = reinterpret_cast<uint16_t*>(param.data_ptr());
  auto* qm = exp_avg.data_ptr<uint8_t>();
  auto* qv = exp_avg_sq.data_ptr<uint8_t>();
  auto* am = exp_avg_absmax.data_ptr<float>();
  auto* av = exp_avg_sq_absmax.data_ptr<float>();
  const void* g = grad.const_data_ptr();
  const bool fp32 = grad.scalar_type() == at::kFloat;
  using Kernel = void (*)(uint16_t*, const void*, uint8_t*, uint8_t*, float*, float*, MapArgs, int64_t, int64_t,
                         AdamWCoef, SrArgs);
  const Kernel kernel = sr_seed.has_value() ? (fp32 ? adamw8bit_kernel<true, true> : adamw8bit_kernel<true, false>)
                                            : (fp32 ? adamw8bit_kernel<false, true> : adamw8bit_kernel<false, false>);
  kernel<<<grid, kThreads, 0, stream>>>(p, g, qm, qv, am, av, codes, n, blocks, c, sr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace offload_ext

TORCH_LIBRARY_IMPL(offload_ext, CUDA, m) { m.impl("adamw8bit_step", &offload_ext::adamw8bit_step_cuda); }
