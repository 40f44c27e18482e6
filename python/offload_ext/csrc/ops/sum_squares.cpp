// sum_squares on the CPU: the host norm pass of the AdamW kernels (bf16_accumulate without a gradient
// to add; fp32_sum_squares for an fp32 tensor), on the global pool.
#include "sum_squares.h"

#include "../common/thread_pool.h"
#include "../kernels/adamw.h"

namespace offload_ext {

void check_sum_squares_arg(const char* who, const at::Tensor& x, bool fp32) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || (fp32 && x.scalar_type() == at::kFloat), who, ": expected a bf16 ",
              fp32 ? "or fp32 " : "", "tensor", fp32 ? "" : " on this device", ", got ", x.scalar_type());
  TORCH_CHECK(x.is_contiguous(), who, ": expected a contiguous tensor (one flat span); call .contiguous() first");
}

at::Tensor sum_squares_cpu(const at::Tensor& x) {
  check_sum_squares_arg("sum_squares", x, true);
  if (x.scalar_type() == at::kFloat) {
    const double sum = fp32_sum_squares(x.const_data_ptr<float>(), x.numel(), *global_pool(), active_simd_level());
    return at::scalar_tensor(sum, x.options().dtype(at::kDouble));
  }
  // With no gradient to add, bf16_accumulate only reads its accum argument.
  auto* data = const_cast<uint16_t*>(reinterpret_cast<const uint16_t*>(x.const_data_ptr()));
  const double sum = bf16_accumulate(data, nullptr, x.numel(), true, *global_pool(), active_simd_level());
  return at::scalar_tensor(sum, x.options().dtype(at::kDouble));
}

}  // namespace offload_ext
