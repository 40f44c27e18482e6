// A StepUnit's AdamW pass: picks the state each side of the pass reads and writes, then runs the kernel of
// the unit's precision mode at the active SIMD level.
#include "adamw_unit.h"

#include <utility>

#include "adamw8bit.h"

namespace offload_ext {

void adamw_unit_pass(const StepUnit& u, const void* grad, const uint16_t* grad_add, float scale, Flow flow,
                     const AdamWHyper& h, ThreadPool& pool, Parts parts) {
  const bool to = flow == Flow::kToAlt, from = flow == Flow::kFromAlt;
  void* m_out = to ? u.alt_exp_avg : u.exp_avg;
  void* v_out = to ? u.alt_exp_avg_sq : u.exp_avg_sq;
  const void* m_in = from ? u.alt_exp_avg : u.exp_avg;
  const void* v_in = from ? u.alt_exp_avg_sq : u.exp_avg_sq;
  const void* p_in = from ? u.alt_param : u.param;
  const SimdLevel level = active_simd_level();
  void* p_out = to ? u.alt_param : u.param;
  if (u.eight_bit) {
    EightBitPass pass{static_cast<uint16_t*>(p_out), grad, GradType::kBF16, static_cast<uint8_t*>(m_out),
                      static_cast<uint8_t*>(v_out), to ? u.alt_exp_avg_absmax : u.exp_avg_absmax,
                      to ? u.alt_exp_avg_sq_absmax : u.exp_avg_sq_absmax, u.codes, u.codes + kCodes, grad_add,
                      scale, parts};
    if (flow != Flow::kInPlace) {
      pass.in = EightBitState{static_cast<const uint16_t*>(p_in), static_cast<const uint8_t*>(m_in),
                              static_cast<const uint8_t*>(v_in), from ? u.alt_exp_avg_absmax : u.exp_avg_absmax,
                              from ? u.alt_exp_avg_sq_absmax : u.exp_avg_sq_absmax};
    }
    adamw8bit(pass, u.numel, h, pool, level, u.sr);
  } else if (u.bf16_mode) {
    adamw_bf16(Bf16Pass{static_cast<const uint16_t*>(p_in), static_cast<uint16_t*>(p_out),
                        static_cast<const uint16_t*>(grad), grad_add, static_cast<const uint16_t*>(m_in),
                        static_cast<uint16_t*>(m_out), static_cast<const uint16_t*>(v_in),
                        static_cast<uint16_t*>(v_out), scale, parts},
               u.numel, h, pool, level, u.sr);
  } else {
    adamw_fp32(Fp32Pass{static_cast<const float*>(p_in), static_cast<float*>(p_out), grad,
                        u.grad_type, grad_add, static_cast<const float*>(m_in), static_cast<float*>(m_out),
                        static_cast<const float*>(v_in), static_cast<float*>(v_out), u.param_out, scale, parts},
               u.numel, h, pool, level);
  }
}

void adamw_unit(const StepUnit& unit, const void* grad, const AdamWHyper& h, ThreadPool& pool, float scale) {
  adamw_unit_pass(unit, grad, nullptr, scale, Flow::kInPlace, h, pool);
}

StepUnit sub_unit(const StepUnit& u, int64_t begin, int64_t end) {
  const int64_t state = u.bf16_mode ? 2 : 4;  // bytes per param / moment element
  const int64_t moment = u.eight_bit ? 1 : state;
  const int64_t grad = u.bf16_mode || u.grad_type == GradType::kBF16 ? 2 : 4;
  StepUnit s = u;
  if (u.alt_param != nullptr) {
    s.alt_param = static_cast<char*>(u.alt_param) + begin * state;
    s.alt_exp_avg = static_cast<char*>(u.alt_exp_avg) + begin * moment;
    s.alt_exp_avg_sq = static_cast<char*>(u.alt_exp_avg_sq) + begin * moment;
  }
  s.param = static_cast<char*>(u.param) + begin * state;
  s.grad = static_cast<const char*>(u.grad) + begin * grad;
  s.exp_avg = static_cast<char*>(u.exp_avg) + begin * moment;
  s.exp_avg_sq = static_cast<char*>(u.exp_avg_sq) + begin * moment;
  if (u.param_out != nullptr) s.param_out = u.param_out + begin;
  if (u.accum != nullptr) s.accum = u.accum + begin;
  if (u.sr) s.sr->index += begin;
  s.numel = end - begin;
  return s;
}

StepUnit at_block(const StepUnit& u, int64_t block) {
  StepUnit s = u;
  s.exp_avg_absmax = u.exp_avg_absmax + block;
  s.exp_avg_sq_absmax = u.exp_avg_sq_absmax + block;
  if (u.alt_exp_avg_absmax != nullptr) {
    s.alt_exp_avg_absmax = u.alt_exp_avg_absmax + block;
    s.alt_exp_avg_sq_absmax = u.alt_exp_avg_sq_absmax + block;
  }
  return s;
}

void swap_state(StepUnit& u) {
  std::swap(u.exp_avg, u.alt_exp_avg);
  std::swap(u.exp_avg_sq, u.alt_exp_avg_sq);
  std::swap(u.exp_avg_absmax, u.alt_exp_avg_absmax);
  std::swap(u.exp_avg_sq_absmax, u.alt_exp_avg_sq_absmax);
  std::swap(u.param, u.alt_param);  // bf16: the next forward copies from the other buffer (the caller follows)
}

}  // namespace offload_ext
