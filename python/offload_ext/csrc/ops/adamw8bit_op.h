// The adamw8bit_step op ("bf16-8bit": bf16 params, 8-bit moments): its argument checks and the CPU kernel's call
// (adamw8bit_cuda.cu: the CUDA one's).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

#include "../kernels/adamw.h"

namespace offload_ext {

// torch.ops.offload_ext.adamw8bit_step: one AdamW step over a span in place by offload_ext.optim.eight_bit's rule,
// on the global pool. param bf16; grad bf16 or fp32; exp_avg, exp_avg_sq uint8 indices into the maps
// exp_avg_code, exp_avg_sq_code (256 increasing fp32 values each); one fp32 absmax of each moment per block of
// 256 elements. With sr_seed the param is stored by stochastic rounding, drawing elements sr_offset.. of stream
// (sr_seed, sr_stream).
// The op's checks, the same on every device (each tensor on param's; the maps on it or on the CPU): its
// hyperparameters and both maps on the CPU.
struct Checked8bit {
  AdamWHyper hyper;
  at::Tensor code_m;
  at::Tensor code_v;
};
Checked8bit checked_8bit(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                        const at::Tensor& exp_avg_sq, const at::Tensor& exp_avg_absmax,
                        const at::Tensor& exp_avg_sq_absmax, const at::Tensor& exp_avg_code,
                        const at::Tensor& exp_avg_sq_code, double lr, double beta1, double beta2, double eps,
                        double weight_decay, int64_t step, int64_t sr_offset);

void adamw8bit_step_cpu(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                        const at::Tensor& exp_avg_sq, const at::Tensor& exp_avg_absmax,
                        const at::Tensor& exp_avg_sq_absmax, const at::Tensor& exp_avg_code,
                        const at::Tensor& exp_avg_sq_code, double lr, double beta1, double beta2, double eps,
                        double weight_decay, int64_t step, std::optional<int64_t> sr_seed, int64_t sr_stream,
                        int64_t sr_offset);

}  // namespace offload_ext
