// AdamW's update of one element (or one vector of lanes), written once over a vector type V: the host
// kernels instantiate it per ISA (adamw_kernel.h), the CUDA kernel with correctly rounded scalar
// intrinsics (adamw_cuda.cu), so both give the same bits for the same inputs.
#pragma once

#include "adamw.h"
#include "bf16.h"

namespace offload_ext {
namespace {

template <class V>
OFFLOAD_EXT_HD inline void adamw_update(typename V::F& p, typename V::F g, typename V::F& m, typename V::F& v,
                                       const AdamWCoef& c) {
  using F = typename V::F;
  if (c.apply_decay) p = V::mul(p, V::set1(c.decay));
  const F base = c.lerp_from_grad ? g : m;
  m = V::fmadd(V::set1(c.lerp_coef), V::sub(g, m), base);
  // torch's build contracts `v * beta2 + (1 - beta2) * g * g` into this one fma; matching it keeps
  // exp_avg_sq bit-identical to torch's fused AdamW.
  v = V::fmadd(V::mul(V::set1(c.one_minus_beta2), g), g, V::mul(v, V::set1(c.beta2)));
  const F denom = V::add(V::div(V::sqrt(v), V::set1(c.bias_correction2_sqrt)), V::set1(c.eps));
  p = V::add(p, V::div(V::mul(V::set1(c.neg_step_size), m), denom));
}

}  // namespace
}  // namespace offload_ext
