// sr_round_bf16 on the CPU (the simulated device, and any CPU tensor), on the global pool in fixed
// chunks: each element's stores depend on its index alone, so the chunking changes no bit.
#include "sr_round.h"

#include <algorithm>

#include "../common/messages.h"
#include "../common/thread_pool.h"
#include "../kernels/stochastic_rounding.h"

namespace offload_ext {
namespace {

void check_span(const char* who, const at::Tensor& t, const char* name, at::ScalarType dtype, const at::Tensor& ref) {
  TORCH_CHECK(t.scalar_type() == dtype, who, ": expected ", name, " of dtype ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), who, ": expected ", name, " contiguous (one flat span); call .contiguous() first");
  TORCH_CHECK(t.numel() == ref.numel(), who, ": expected ", name, " to have ", num(ref.numel()),
              " elements (as param32), got ", num(t.numel()));
  TORCH_CHECK(t.device() == ref.device(), who, ": expected ", name, " on ", ref.device(), " (as param32), got ",
              t.device());
}

}  // namespace

void check_sr_round_args(const char* who, const at::Tensor& param32, const at::Tensor& exp_avg32,
                         const at::Tensor& exp_avg_sq32, const at::Tensor& param, const at::Tensor& exp_avg,
                         const at::Tensor& exp_avg_sq, int64_t offset) {
  check_span(who, param32, "param32", at::kFloat, param32);
  check_span(who, exp_avg32, "exp_avg32", at::kFloat, param32);
  check_span(who, exp_avg_sq32, "exp_avg_sq32", at::kFloat, param32);
  check_span(who, param, "param", at::kBFloat16, param32);
  check_span(who, exp_avg, "exp_avg", at::kBFloat16, param32);
  check_span(who, exp_avg_sq, "exp_avg_sq", at::kBFloat16, param32);
  TORCH_CHECK(offset >= 0, who, ": expected offset >= 0 (the stream index of the span's element 0), got ", num(offset));
  const int64_t n = param32.numel();
  TORCH_CHECK(n == 0 || (static_cast<uint64_t>(offset) >> 32) == (static_cast<uint64_t>(offset + n - 1) >> 32), who,
              ": the span's stream indices ", num(offset), " .. ", num(offset + n - 1),
              " cross a multiple of 2^32; cut the span there (each part has its own key)");
}

uint32_t sr_span_key(int64_t seed, int64_t stream, int64_t step, int64_t offset) {
  return static_cast<uint32_t>(sr_key(static_cast<uint64_t>(seed), static_cast<uint64_t>(stream), step,
                                      static_cast<uint64_t>(offset) >> 32));
}

void sr_round_bf16_cpu(const at::Tensor& param32, const at::Tensor& exp_avg32, const at::Tensor& exp_avg_sq32,
                       const at::Tensor& param, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                       int64_t seed, int64_t stream, int64_t step, int64_t offset) {
  check_sr_round_args("sr_round_bf16", param32, exp_avg32, exp_avg_sq32, param, exp_avg, exp_avg_sq, offset);
  const int64_t n = param32.numel();
  const uint32_t first = static_cast<uint32_t>(offset) + sr_span_key(seed, stream, step, offset);
  const float* p = param32.const_data_ptr<float>();
  const float* m = exp_avg32.const_data_ptr<float>();
  const float* v = exp_avg_sq32.const_data_ptr<float>();
  auto* po = reinterpret_cast<uint16_t*>(param.data_ptr());
  auto* mo = reinterpret_cast<uint16_t*>(exp_avg.data_ptr());
  auto* vo = reinterpret_cast<uint16_t*>(exp_avg_sq.data_ptr());
  constexpr int64_t kChunk = 1 << 16;
  global_pool()->parallel_for((n + kChunk - 1) / kChunk, [&](int64_t task) {
    const int64_t end = std::min(n, (task + 1) * kChunk);
    for (int64_t i = task * kChunk; i < end; ++i) {
      sr_store(p[i], m[i], v[i], sr_hash32_word(first + static_cast<uint32_t>(i)), po + i, mo + i, vo + i);
    }
  });
}

}  // namespace offload_ext
