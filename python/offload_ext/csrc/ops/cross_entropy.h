// Row-wise cross-entropy over a [rows, vocab] block of logits, for the chunked LM loss: the forward
// gives each row's loss and log-sum-exp in fp32 from logits of any float dtype without an fp32 copy;
// the backward writes d(sum_r grad[r] * loss[r]) / d logits in the logits' dtype, in place if asked.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace offload_ext {

// Validates the arguments shared by both directions (and both devices); `who` names the op.
void check_cross_entropy_args(const char* who, const at::Tensor& logits, const at::Tensor& labels);

// Returns (loss, lse), both float32 [rows]; a row whose label is ignore_index has loss 0. `overwrite` (the
// caller allows the backward to write the logits' gradient over the logits) is read by the op's autograd
// formula in ops.py alone.
std::tuple<at::Tensor, at::Tensor> cross_entropy_rows_cpu(const at::Tensor& logits, const at::Tensor& labels,
                                                          int64_t ignore_index, bool overwrite);

// grad_logits[r, j] = grad[r] * (exp(logits[r, j] - lse[r]) - [j == labels[r]]), 0 on ignored rows.
// grad_logits may be logits itself.
void cross_entropy_rows_backward_cpu(const at::Tensor& logits, const at::Tensor& lse, const at::Tensor& labels,
                                     const at::Tensor& grad, int64_t ignore_index, at::Tensor grad_logits);

// Checks of the backward's extra tensors against the forward's shapes.
void check_cross_entropy_backward_args(const char* who, const at::Tensor& logits, const at::Tensor& lse,
                                       const at::Tensor& labels, const at::Tensor& grad,
                                       const at::Tensor& grad_logits);

}  // namespace offload_ext
