// Row-wise cross-entropy on CUDA: one block per row, one pass over the logits in each direction
// (online max/sum-exp forward; softmax-minus-one-hot backward, written in the logits' dtype).
// Replaces .float() + log_softmax + nll (and their backward), which move ~5x the logits' bytes.
#include "cross_entropy.h"

#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/macros/Macros.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

namespace offload_ext {
namespace {

constexpr int kThreads = 512;

template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

// Running (max, sum of exp(x - max)) of a set of values; merging two sets is associative.
struct MaxSum {
  float m;
  float s;
};

__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.f};
  return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}

template <int kVec>
__device__ __forceinline__ MaxSum absorb(MaxSum acc, const float (&f)[kVec]) {
  float m = acc.m;
#pragma unroll
  for (int k = 0; k < kVec; ++k) m = fmaxf(m, f[k]);
  if (m == -INFINITY) return acc;
  float s = acc.s * expf(acc.m - m);
#pragma unroll
  for (int k = 0; k < kVec; ++k) s += expf(f[k] - m);
  return {m, s};
}

// Every thread gets the block's merged value.
__device__ MaxSum block_merge(MaxSum v) {
  __shared__ MaxSum warp_vals[kThreads / 32];
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = merge(v, {__shfl_xor_sync(0xffffffffu, v.m, offset), __shfl_xor_sync(0xffffffffu, v.s, offset)});
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  if (lane == 0) warp_vals[warp] = v;
  __syncthreads();
  v = lane < warps ? warp_vals[lane] : MaxSum{-INFINITY, 0.f};
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = merge(v, {__shfl_xor_sync(0xffffffffu, v.m, offset), __shfl_xor_sync(0xffffffffu, v.s, offset)});
  }
  return v;
}

template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads) forward_kernel(const T* __restrict__ logits,
                                                           const int64_t* __restrict__ labels, int64_t vocab,
                                                           int64_t ignore_index, float* __restrict__ loss,
                                                           float* __restrict__ lse) {
  const int64_t row = blockIdx.x;
  const T* x = logits + row * vocab;
  const auto* packs = reinterpret_cast<const Pack<T, kVec>*>(x);
  MaxSum acc{-INFINITY, 0.f};
  for (int64_t i = threadIdx.x; i < vocab / kVec; i += blockDim.x) {
    const Pack<T, kVec> p = packs[i];
    float f[kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) f[k] = static_cast<float>(p.v[k]);
    acc = absorb<kVec>(acc, f);
  }
  for (int64_t j = vocab / kVec * kVec + threadIdx.x; j < vocab; j += blockDim.x) {
    const float f[1] = {static_cast<float>(x[j])};
    acc = absorb<1>(acc, f);
  }
  acc = block_merge(acc);
  if (threadIdx.x == 0) {
    const int64_t y = labels[row];
    CUDA_KERNEL_ASSERT(y == ignore_index || (y >= 0 && y < vocab));
    const float l = acc.m + logf(acc.s);
    lse[row] = l;
    loss[row] = y == ignore_index ? 0.f : l - static_cast<float>(x[y]);
  }
}

template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads) backward_kernel(const T* __restrict__ logits, const float* lse,
                                                            const int64_t* labels, const float* grad,
                                                            int64_t vocab, int64_t ignore_index, T* out) {
  // logits and out may be the same memory: each element is read, then written, by one thread.
  const int64_t row = blockIdx.x;
  const int64_t y = labels[row];
  CUDA_KERNEL_ASSERT(y == ignore_index || (y >= 0 && y < vocab));
  const bool ignored = y == ignore_index;
  const float g = ignored ? 0.f : grad[row], l = lse[row];
  const T* x = logits + row * vocab;
  T* dst = out + row * vocab;
  auto value = [&](float f, int64_t j) {
    return ignored ? 0.f : g * (expf(f - l) - (j == y ? 1.f : 0.f));
  };
  const auto* in_packs = reinterpret_cast<const Pack<T, kVec>*>(x);
  auto* out_packs = reinterpret_cast<Pack<T, kVec>*>(dst);
  for (int64_t i = threadIdx.x; i < vocab / kVec; i += blockDim.x) {
    const Pack<T, kVec> p = in_packs[i];
    Pack<T, kVec> q;
#pragma unroll
    for (int k = 0; k < kVec; ++k) q.v[k] = static_cast<T>(value(static_cast<float>(p.v[k]), i * kVec + k));
    out_packs[i] = q;
  }
  for (int64_t j = vocab / kVec * kVec + threadIdx.x; j < vocab; j += blockDim.x) {
    dst[j] = static_cast<T>(value(static_cast<float>(x[j]), j));
  }
}

// 16-byte packs when every row starts 16-byte aligned, else one element at a time.
template <typename T>
bool rows_aligned(const void* base, int64_t vocab) {
  return reinterpret_cast<uintptr_t>(base) % 16 == 0 && (vocab * static_cast<int64_t>(sizeof(T))) % 16 == 0;
}

// One block per row: the grid's x dimension bounds the rows of one call.
void check_rows_fit_grid(const char* who, int64_t rows) {
  TORCH_CHECK(rows <= std::numeric_limits<int32_t>::max(), who, ": expected at most 2^31 - 1 rows per call, got ",
              std::to_string(rows), "; pass the logits in chunks");
}

int threads_for(int64_t vocab) {
  const int64_t warps = (vocab + 31) / 32;
  return static_cast<int>(std::min<int64_t>(kThreads, std::max<int64_t>(32, warps * 32)));
}

// `overwrite` is for the backward's autograd formula (see cross_entropy.h).
std::tuple<at::Tensor, at::Tensor> cross_entropy_rows_cuda(const at::Tensor& logits, const at::Tensor& labels,
                                                           int64_t ignore_index, bool /*overwrite*/) {
  check_cross_entropy_args("cross_entropy_rows", logits, labels);
  check_rows_fit_grid("cross_entropy_rows", logits.size(0));
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  auto loss = at::empty({rows}, logits.options().dtype(at::kFloat));
  auto lse = at::empty({rows}, logits.options().dtype(at::kFloat));
  if (rows == 0) return {loss, lse};
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "cross_entropy_rows", [&] {
    constexpr int kVec = 16 / sizeof(scalar_t);
    const auto* x = logits.const_data_ptr<scalar_t>();
    const auto* y = labels.const_data_ptr<int64_t>();
    if (rows_aligned<scalar_t>(x, vocab)) {
      forward_kernel<scalar_t, kVec><<<rows, threads_for(vocab / kVec), 0, stream>>>(
          x, y, vocab, ignore_index, loss.data_ptr<float>(), lse.data_ptr<float>());
    } else {
      forward_kernel<scalar_t, 1><<<rows, threads_for(vocab), 0, stream>>>(
          x, y, vocab, ignore_index, loss.data_ptr<float>(), lse.data_ptr<float>());
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {loss, lse};
}

void cross_entropy_rows_backward_cuda(const at::Tensor& logits, const at::Tensor& lse, const at::Tensor& labels,
                                      const at::Tensor& grad, int64_t ignore_index, at::Tensor grad_logits) {
  check_cross_entropy_backward_args("cross_entropy_rows_backward", logits, lse, labels, grad, grad_logits);
  check_rows_fit_grid("cross_entropy_rows_backward", logits.size(0));
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  if (rows == 0) return;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "cross_entropy_rows_backward", [&] {
    constexpr int kVec = 16 / sizeof(scalar_t);
    const auto* x = logits.const_data_ptr<scalar_t>();
    auto* out = grad_logits.data_ptr<scalar_t>();
    const auto* l = lse.const_data_ptr<float>();
    const auto* y = labels.const_data_ptr<int64_t>();
    const auto* g = grad.const_data_ptr<float>();
    if (rows_aligned<scalar_t>(x, vocab) && rows_aligned<scalar_t>(out, vocab)) {
      backward_kernel<scalar_t, kVec><<<rows, threads_for(vocab / kVec), 0, stream>>>(x, l, y, g, vocab,
                                                                                       ignore_index, out);
    } else {
      backward_kernel<scalar_t, 1><<<rows, threads_for(vocab), 0, stream>>>(x, l, y, g, vocab, ignore_index, out);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace
}  // namespace offload_ext

TORCH_LIBRARY_IMPL(offload_ext, CUDA, m) {
  m.impl("cross_entropy_rows", &offload_ext::cross_entropy_rows_cuda);
  m.impl("cross_entropy_rows_backward", &offload_ext::cross_entropy_rows_backward_cuda);
}
