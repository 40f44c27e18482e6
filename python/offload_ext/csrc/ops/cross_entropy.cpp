// Row-wise cross-entropy on the CPU, and the argument checks the CUDA kernels share. Math in fp32
// whatever the logits' dtype, as F.cross_entropy(logits.float()). Plain loops: on CPU tensors the loss
// uses torch's own cross-entropy unless backend="native" is asked for; these define the ops' results
// where CI can check them.
#include "cross_entropy.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <string>

namespace offload_ext {
namespace {

void check_labels_in_range(const at::Tensor& labels, int64_t vocab, int64_t ignore_index) {
  const int64_t* y = labels.data_ptr<int64_t>();
  for (int64_t r = 0; r < labels.numel(); ++r) {
    TORCH_CHECK(y[r] == ignore_index || (y[r] >= 0 && y[r] < vocab), "cross_entropy_rows: label ",
                std::to_string(y[r]), " of row ", std::to_string(r), " is outside the vocabulary [0, ",
                std::to_string(vocab), ") and is not ignore_index (", std::to_string(ignore_index), ")");
  }
}

template <typename T>
void forward_rows(const T* x, const int64_t* y, int64_t rows, int64_t vocab, int64_t ignore_index, float* loss,
                  float* lse) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + r * vocab;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < vocab; ++j) m = std::max(m, static_cast<float>(row[j]));
      float s = 0.f;
      for (int64_t j = 0; j < vocab; ++j) s += std::exp(static_cast<float>(row[j]) - m);
      lse[r] = m + std::log(s);
      loss[r] = y[r] == ignore_index ? 0.f : lse[r] - static_cast<float>(row[y[r]]);
    }
  });
}

template <typename T>
void backward_rows(const T* x, const float* lse, const int64_t* y, const float* grad, int64_t rows, int64_t vocab,
                   int64_t ignore_index, T* out) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + r * vocab;
      T* dst = out + r * vocab;
      if (y[r] == ignore_index) {
        for (int64_t j = 0; j < vocab; ++j) dst[j] = T(0.f);
        continue;
      }
      const float g = grad[r], l = lse[r];
      for (int64_t j = 0; j < vocab; ++j) {
        dst[j] = T(g * (std::exp(static_cast<float>(row[j]) - l) - (j == y[r] ? 1.f : 0.f)));
      }
    }
  });
}

}  // namespace

void check_cross_entropy_args(const char* who, const at::Tensor& logits, const at::Tensor& labels) {
  TORCH_CHECK(logits.dim() == 2, who, ": expected logits of shape [rows, vocab], got ", logits.dim(),
              " dimensions; reshape to (-1, vocab) first");
  TORCH_CHECK(logits.size(1) > 0, who, ": expected a vocabulary of at least one entry");
  TORCH_CHECK(logits.is_contiguous(), who, ": expected contiguous logits; call .contiguous() first");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16 ||
                  logits.scalar_type() == at::kHalf,
              who, ": expected logits of dtype float32, bfloat16 or float16, got ", logits.scalar_type());
  TORCH_CHECK(labels.scalar_type() == at::kLong, who, ": expected int64 labels, got ", labels.scalar_type(),
              "; call .long() first");
  TORCH_CHECK(labels.dim() == 1 && labels.size(0) == logits.size(0) && labels.is_contiguous(), who,
              ": expected contiguous labels of shape [", std::to_string(logits.size(0)), "] (one per row), got ",
              labels.sizes());
  TORCH_CHECK(labels.device() == logits.device(), who, ": expected labels on ", logits.device(), " like logits, got ",
              labels.device());
}

void check_cross_entropy_backward_args(const char* who, const at::Tensor& logits, const at::Tensor& lse,
                                       const at::Tensor& labels, const at::Tensor& grad,
                                       const at::Tensor& grad_logits) {
  check_cross_entropy_args(who, logits, labels);
  for (const auto* t : {&lse, &grad}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 1 && t->size(0) == logits.size(0) &&
                    t->is_contiguous() && t->device() == logits.device(),
                who, ": expected lse and grad as contiguous float32 [", std::to_string(logits.size(0)), "] on ",
                logits.device(), ", got ", t->scalar_type(), " ", t->sizes(), " on ", t->device());
  }
  TORCH_CHECK(grad_logits.sizes() == logits.sizes() && grad_logits.scalar_type() == logits.scalar_type() &&
                  grad_logits.is_contiguous() && grad_logits.device() == logits.device(),
              who, ": expected grad_logits shaped, typed and placed like logits (", logits.scalar_type(), " ",
              logits.sizes(), "), got ", grad_logits.scalar_type(), " ", grad_logits.sizes());
}

std::tuple<at::Tensor, at::Tensor> cross_entropy_rows_cpu(const at::Tensor& logits, const at::Tensor& labels,
                                                          int64_t ignore_index, bool /*overwrite*/) {
  check_cross_entropy_args("cross_entropy_rows", logits, labels);
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  check_labels_in_range(labels, vocab, ignore_index);
  auto loss = at::empty({rows}, logits.options().dtype(at::kFloat));
  auto lse = at::empty({rows}, logits.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "cross_entropy_rows", [&] {
    forward_rows<scalar_t>(logits.const_data_ptr<scalar_t>(), labels.const_data_ptr<int64_t>(), rows, vocab,
                           ignore_index, loss.data_ptr<float>(), lse.data_ptr<float>());
  });
  return {loss, lse};
}

void cross_entropy_rows_backward_cpu(const at::Tensor& logits, const at::Tensor& lse, const at::Tensor& labels,
                                     const at::Tensor& grad, int64_t ignore_index, at::Tensor grad_logits) {
  check_cross_entropy_backward_args("cross_entropy_rows_backward", logits, lse, labels, grad, grad_logits);
  check_labels_in_range(labels, logits.size(1), ignore_index);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "cross_entropy_rows_backward", [&] {
    backward_rows<scalar_t>(logits.const_data_ptr<scalar_t>(), lse.const_data_ptr<float>(),
                            labels.const_data_ptr<int64_t>(), grad.const_data_ptr<float>(), logits.size(0),
                            logits.size(1), ignore_index, grad_logits.data_ptr<scalar_t>());
  });
}

}  // namespace offload_ext
