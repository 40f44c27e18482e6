// adamw_update's vector interface on CUDA (included by .cu files only): one lane, each operation rounded once to
// nearest (nothing contracted), so that a device kernel computes the host kernels' bits.
#pragma once

namespace offload_ext {

struct DeviceLane {
  using F = float;
  __device__ static F set1(float x) { return x; }
  __device__ static F add(F a, F b) { return __fadd_rn(a, b); }
  __device__ static F sub(F a, F b) { return __fsub_rn(a, b); }
  __device__ static F mul(F a, F b) { return __fmul_rn(a, b); }
  __device__ static F div(F a, F b) { return __fdiv_rn(a, b); }
  __device__ static F sqrt(F a) { return __fsqrt_rn(a); }
  __device__ static F fmadd(F a, F b, F c) { return __fmaf_rn(a, b, c); }
};

}  // namespace offload_ext
