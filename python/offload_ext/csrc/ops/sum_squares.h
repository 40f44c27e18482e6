// The sum_squares op: the float64 sum of the squares of a bf16 tensor's elements (on the CPU also fp32's; each
// square exact), as a 0-d float64 tensor on the tensor's device. It is speculative clipping's device norm: taken on the
// GPU from a layer's flat gradient before its copy to the host, so the host makes no pass over it.
#pragma once

#include <ATen/ATen.h>

namespace offload_ext {

// Throws unless `x` is a contiguous bf16 tensor (or fp32, where `fp32` says the device's kernel takes it); `who`
// names the op.
void check_sum_squares_arg(const char* who, const at::Tensor& x, bool fp32);

// The CPU kernel: the engine's own norm pass (fixed chunks summed in order, so the result does not
// depend on the thread count).
at::Tensor sum_squares_cpu(const at::Tensor& x);

}  // namespace offload_ext
