// dequantize_base on CUDA: one thread an element, the element rules of dequantize.h (the CPU kernel's), so the
// bits are the CPU op's and the torch-op rule's. Rows along the grid's y (one scale load a block), NF4's levels
// in shared memory (a constant table serializes a warp's different codes).
#include "dequantize.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>

namespace offload_ext {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxGrid = 65535;

template <BaseFormat F>
__global__ void __launch_bounds__(kThreads) dequantize_rows_kernel(const float* __restrict__ scales,
                                                                    const uint8_t* __restrict__ codes,
                                                                    uint16_t* __restrict__ out, int64_t rows,
                                                                    int64_t cols) {
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const float s = scales[r];
    const int64_t base = r * cols;
    for (int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; c < cols;
         c += static_cast<int64_t>(gridDim.x) * kThreads) {
      out[base + c] = F == BaseFormat::kInt8 ? dequant_int8(codes[base + c], s) : dequant_fp8(codes[base + c], s);
    }
  }
}

__global__ void __launch_bounds__(kThreads) dequantize_nf4_kernel(const float* __restrict__ scales,
                                                                   const uint8_t* __restrict__ codes,
                                                                   uint16_t* __restrict__ out, int64_t n) {
  __shared__ float levels[16];
  if (threadIdx.x < 16) levels[threadIdx.x] = nf4_level(threadIdx.x);
  __syncthreads();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    out[i] = bf16_round_bits(levels[nf4_code(codes, i)] * scales[i / kNf4Block]);
  }
}

void dequantize_base_cuda(const at::Tensor& storage, const std::string& fmt, int64_t rows, int64_t cols,
                          const at::Tensor& out) {
  const BaseFormat f = check_dequantize_args(storage, fmt, rows, cols, out);
  const int64_t n = rows * cols;
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(storage.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const auto* scales = static_cast<const float*>(storage.const_data_ptr());
  const auto* codes = reinterpret_cast<const uint8_t*>(scales + base_scale_count(f, rows, cols));
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  if (f == BaseFormat::kNf4) {
    const auto blocks = static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, kMaxGrid * 16));
    dequantize_nf4_kernel<<<blocks, kThreads, 0, stream>>>(scales, codes, o, n);
  } else {
    const dim3 grid(static_cast<unsigned>(std::min<int64_t>((cols + kThreads - 1) / kThreads, kMaxGrid)),
                    static_cast<unsigned>(std::min<int64_t>(rows, kMaxGrid)));
    if (f == BaseFormat::kInt8) {
      dequantize_rows_kernel<BaseFormat::kInt8><<<grid, kThreads, 0, stream>>>(scales, codes, o, rows, cols);
    } else {
      dequantize_rows_kernel<BaseFormat::kFp8><<<grid, kThreads, 0, stream>>>(scales, codes, o, rows, cols);
    }
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace offload_ext

TORCH_LIBRARY_IMPL(offload_ext, CUDA, m) { m.impl("dequantize_base", &offload_ext::dequantize_base_cuda); }
