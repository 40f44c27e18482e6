// dequantize_base on CUDA, the element rules of dequantize.h (the CPU kernel's), so the bits are the CPU op's and
// the torch-op rule's. Eight elements a thread where the spans are aligned for it (4-byte loads of codes, one
// 16-byte store): a byte a thread kept too few loads in flight to fill the memory system. Otherwise one
// element a thread. Rows along the grid's y (one scale load a row).
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

// Two bf16 in one word, the first at the lower address.
__device__ inline uint32_t pack2(uint16_t first, uint16_t second) {
  return static_cast<uint32_t>(first) | (static_cast<uint32_t>(second) << 16);
}

template <BaseFormat F>
__device__ inline uint16_t dequant_row_code(uint32_t code, float s) {
  return F == BaseFormat::kInt8 ? dequant_int8(static_cast<uint8_t>(code), s)
                                : dequant_fp8(static_cast<uint8_t>(code), s);
}

// The block's copy of the 16 levels (a constant table serializes a warp's different codes; shared memory does not).
__device__ inline void load_nf4_levels(float* levels) {
  if (threadIdx.x < 16) levels[threadIdx.x] = nf4_level(threadIdx.x);
  __syncthreads();
}

// Eight codes of two words (little-endian: code k of a word in its bits 8k..8k+7) to one 16-byte store.
template <BaseFormat F>
__device__ inline uint4 dequant_row8(uint32_t lo, uint32_t hi, float s) {
  uint4 v;
  v.x = pack2(dequant_row_code<F>(lo, s), dequant_row_code<F>(lo >> 8, s));
  v.y = pack2(dequant_row_code<F>(lo >> 16, s), dequant_row_code<F>(lo >> 24, s));
  v.z = pack2(dequant_row_code<F>(hi, s), dequant_row_code<F>(hi >> 8, s));
  v.w = pack2(dequant_row_code<F>(hi >> 16, s), dequant_row_code<F>(hi >> 24, s));
  return v;
}

// kEight: eight elements a thread (codes read as words, not pairs: a span's codes follow its fp32 scales, 4-byte
// aligned but not always 8; one 16-byte store), each row of whole groups of eight; else one element a thread.
template <BaseFormat F, bool kEight>
__global__ void __launch_bounds__(kThreads) dequantize_rows_kernel(const float* __restrict__ scales,
                                                                    const uint8_t* __restrict__ codes,
                                                                    uint16_t* __restrict__ out, int64_t rows,
                                                                    int64_t cols) {
  const int64_t items = kEight ? cols / 8 : cols;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const float s = scales[r];
    const uint8_t* in = codes + r * cols;
    uint16_t* o = out + r * cols;
    for (int64_t c = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; c < items;
         c += static_cast<int64_t>(gridDim.x) * kThreads) {
      if constexpr (kEight) {
        const auto* words = reinterpret_cast<const uint32_t*>(in);
        reinterpret_cast<uint4*>(o)[c] = dequant_row8<F>(words[2 * c], words[2 * c + 1], s);
      } else {
        o[c] = dequant_row_code<F>(in[c], s);
      }
    }
  }
}

// kEight: eight elements a thread (four code bytes, one scale: a block of 64 holds whole groups of eight; one
// 16-byte store), `items` groups of eight; else one element a thread, `items` elements.
template <bool kEight>
__global__ void __launch_bounds__(kThreads) dequantize_nf4_kernel(const float* __restrict__ scales,
                                                                   const uint8_t* __restrict__ codes,
                                                                   uint16_t* __restrict__ out, int64_t items) {
  __shared__ float levels[16];
  load_nf4_levels(levels);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < items; i += stride) {
    if constexpr (kEight) {
      const uint32_t c = reinterpret_cast<const uint32_t*>(codes)[i];
      const float s = scales[i / (kNf4Block / 8)];
      uint16_t e[8];
#pragma unroll
      for (int k = 0; k < 4; ++k) {  // byte k: elements 2k (high nibble) and 2k + 1
        const uint32_t byte = (c >> (8 * k)) & 0xFF;
        e[2 * k] = bf16_round_bits(levels[byte >> 4] * s);
        e[2 * k + 1] = bf16_round_bits(levels[byte & 0xF] * s);
      }
      reinterpret_cast<uint4*>(out)[i] =
          make_uint4(pack2(e[0], e[1]), pack2(e[2], e[3]), pack2(e[4], e[5]), pack2(e[6], e[7]));
    } else {
      out[i] = bf16_round_bits(levels[nf4_code(codes, i)] * scales[i / kNf4Block]);
    }
  }
}

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

unsigned flat_grid(int64_t items) {
  return static_cast<unsigned>(std::min<int64_t>((items + kThreads - 1) / kThreads, kMaxGrid * 16));
}

dim3 rows_grid(int64_t rows, int64_t items) {  // items: a row's, one a thread
  return dim3(static_cast<unsigned>(std::min<int64_t>((items + kThreads - 1) / kThreads, kMaxGrid)),
              static_cast<unsigned>(std::min<int64_t>(rows, kMaxGrid)));
}

template <BaseFormat F>
void launch_rows(const float* scales, const uint8_t* codes, uint16_t* o, int64_t rows, int64_t cols,
                 cudaStream_t stream) {
  if (cols % 8 == 0 && aligned(codes, 4) && aligned(o, 16)) {
    dequantize_rows_kernel<F, true><<<rows_grid(rows, cols / 8), kThreads, 0, stream>>>(scales, codes, o, rows, cols);
  } else {
    dequantize_rows_kernel<F, false><<<rows_grid(rows, cols), kThreads, 0, stream>>>(scales, codes, o, rows, cols);
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
    if (aligned(codes, 4) && aligned(o, 16)) {  // n is whole blocks of 64: whole groups of eight
      dequantize_nf4_kernel<true><<<flat_grid(n / 8), kThreads, 0, stream>>>(scales, codes, o, n / 8);
    } else {
      dequantize_nf4_kernel<false><<<flat_grid(n), kThreads, 0, stream>>>(scales, codes, o, n);
    }
  } else if (f == BaseFormat::kInt8) {
    launch_rows<BaseFormat::kInt8>(scales, codes, o, rows, cols, stream);
  } else {
    launch_rows<BaseFormat::kFp8>(scales, codes, o, rows, cols, stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace offload_ext

TORCH_LIBRARY_IMPL(offload_ext, CUDA, m) { m.impl("dequantize_base", &offload_ext::dequantize_base_cuda); }
