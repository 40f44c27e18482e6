// Engine::add_unit: a unit's tensors checked against its precision (8-bit units with their absmaxes and maps)
// and handed to the step scheduler.
#include <string>
#include <tuple>
#include <utility>

#include "../common/messages.h"
#include "../kernels/adamw8bit.h"
#include "../ops/adamw_op.h"
#include "engine.h"

namespace offload_ext {

StepUnit Engine::eight_bit_unit(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                                const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& param_out,
                                std::vector<GroupRange> ranges, const std::vector<at::Tensor>& eight_bit) {
  const char* who = "Engine.add_unit";
  TORCH_CHECK(eight_bit.size() == 3, who, ": eight_bit is [exp_avg_absmax, exp_avg_sq_absmax, codes], got ",
              num(static_cast<int64_t>(eight_bit.size())), " tensors");
  StepUnit u = checked_unit(who, param, grad, exp_avg, exp_avg_sq, param_out, c10::Device(c10::kCPU), true);
  const char* mode = "8-bit (bf16 param, uint8 moments)";
  const int64_t n = u.numel;
  check_group_ranges(ranges, n);
  const int64_t blocks = number_blocks(ranges);
  check_span(who, eight_bit[0], "exp_avg_absmax", blocks);
  check_span(who, eight_bit[1], "exp_avg_sq_absmax", blocks);
  check_span(who, eight_bit[2], "codes", 2 * kCodes);
  for (const at::Tensor& t : eight_bit) check_dtype(who, t, "eight_bit's tensors", at::kFloat, mode);
  codes_.emplace_back(eight_bit[2].data_ptr<float>(), eight_bit[2].data_ptr<float>() + 2 * kCodes);
  u.codes = codes_.back().data();
  u.exp_avg_absmax = eight_bit[0].data_ptr<float>();
  u.exp_avg_sq_absmax = eight_bit[1].data_ptr<float>();
  return u;
}

int Engine::add_unit(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                     const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& param_out,
                     const std::optional<at::Tensor>& accum,
                     const std::vector<std::tuple<int, int64_t, int64_t>>& groups,
                     const std::vector<at::Tensor>& alt, const std::optional<int64_t>& sr_seed,
                     int64_t sr_stream, const std::vector<at::Tensor>& eight_bit) {
  std::vector<GroupRange> ranges;
  for (const auto& [group, begin, end] : groups) ranges.push_back({group, begin, end});
  if (ranges.empty()) ranges.push_back({0, 0, param.numel()});
  StepUnit u = eight_bit.empty() ? checked_unit("Engine.add_unit", param, grad, exp_avg, exp_avg_sq, param_out)
                                 : eight_bit_unit(param, grad, exp_avg, exp_avg_sq, param_out, ranges, eight_bit);
  u.sr = checked_sr("Engine.add_unit", u, sr_seed, sr_stream, 0);
  if (accum.has_value()) {
    check_span("Engine.add_unit", *accum, "accum", u.numel);
    TORCH_CHECK(accum->scalar_type() == at::kBFloat16 && grad.scalar_type() == at::kBFloat16,
                "Engine.add_unit: gradient accumulation works on bf16 grads into a bf16 accum, got grad ",
                grad.scalar_type(), " and accum ", accum->scalar_type());
    u.accum = reinterpret_cast<uint16_t*>(accum->data_ptr());
  }
  if (!alt.empty()) {
    const size_t want = u.eight_bit ? 5 : 3;
    TORCH_CHECK(alt.size() == want && u.accum != nullptr, "Engine.add_unit: the second state buffers (speculative "
                "clipping) are tensors like param, exp_avg and exp_avg_sq (8-bit: and the two absmaxes), and need an "
                "accum; got ", num(static_cast<int64_t>(alt.size())), " tensors", u.accum ? "" : " and no accum");
    const at::Tensor* like[] = {&param, &exp_avg, &exp_avg_sq, u.eight_bit ? &eight_bit[0] : nullptr,
                                u.eight_bit ? &eight_bit[1] : nullptr};
    const char* names[] = {"alt[0] (like param)", "alt[1] (like exp_avg)", "alt[2] (like exp_avg_sq)",
                           "alt[3] (like exp_avg_absmax)", "alt[4] (like exp_avg_sq_absmax)"};
    for (size_t k = 0; k < want; ++k) {
      check_span("Engine.add_unit", alt[k], names[k], like[k]->numel());
      TORCH_CHECK(alt[k].scalar_type() == like[k]->scalar_type(), "Engine.add_unit: expected ", names[k],
                  " of dtype ", like[k]->scalar_type(), ", got ", alt[k].scalar_type());
    }
    u.alt_param = alt[0].data_ptr();
    u.alt_exp_avg = alt[1].data_ptr();
    u.alt_exp_avg_sq = alt[2].data_ptr();
    if (u.eight_bit) {
      u.alt_exp_avg_absmax = alt[3].data_ptr<float>();
      u.alt_exp_avg_sq_absmax = alt[4].data_ptr<float>();
    }
  }
  try {
    return scheduler_->add_unit(u, std::move(ranges));
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(false, "Engine.add_unit: ", e.what());
  }
}

}  // namespace offload_ext
