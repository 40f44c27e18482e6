// The dequantize_base op: a frozen weight held in a quantized format (offload_ext.models.quantized_base gives
// the formats and their rules) turned back into bf16 in one pass, one element's value from its code and its
// scale alone. The element rules below serve the CPU kernel and the CUDA one alike, so both give the bits of
// the torch-op rule; the torch ops took ~30 bytes of memory traffic an element (NF4's widened codes, gathered
// levels, an fp32 product) where these read a code and write a bf16.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>

#include "../kernels/bf16.h"

namespace offload_ext {

enum class BaseFormat { kInt8, kFp8, kNf4 };

constexpr int64_t kNf4Block = 64;  // QLoRA's: one absmax per 64 consecutive elements

// The checks of the op's arguments (one line each, naming the fix); returns the format named by `fmt`.
BaseFormat check_dequantize_args(const at::Tensor& storage, const std::string& fmt, int64_t rows, int64_t cols,
                                 const at::Tensor& out);

// The fp32 scales at the storage's start (one a row; for nf4 one a block), the codes after them.
int64_t base_scale_count(BaseFormat f, int64_t rows, int64_t cols);

void dequantize_base_cpu(const at::Tensor& storage, const std::string& fmt, int64_t rows, int64_t cols,
                         const at::Tensor& out);

namespace {

// LLM.int8's 1 / 127 as torch multiplies by the Python float: rounded to fp32 once.
constexpr float kInv127 = static_cast<float>(7.874015718698502e-3);

// q * absmax * (1 / 127) in fp32, the two products in this order (as the rule's torch ops), rounded to bf16.
OFFLOAD_EXT_HD inline uint16_t dequant_int8(uint8_t code, float absmax) {
  return bf16_round_bits(static_cast<float>(static_cast<int8_t>(code)) * absmax * kInv127);
}

// float8 e4m3fn's value, exact in fp32: bias 7, subnormals m * 2^-9, no infinities, S.1111.111 NaN.
OFFLOAD_EXT_HD inline float e4m3_to_float(uint8_t code) {
  const uint32_t sign = static_cast<uint32_t>(code >> 7) << 31;
  const uint32_t e = (code >> 3) & 0xF, m = code & 0x7;
  if (e == 0xF && m == 0x7) return bits_float(sign | 0x7fc00000u);
  if (e == 0) {
    const float sub = static_cast<float>(m) * 0.001953125f;  // 2^-9: exact
    return code >> 7 ? -sub : sub;
  }
  return bits_float(sign | ((e + 120) << 23) | (m << 20));
}

OFFLOAD_EXT_HD inline uint16_t dequant_fp8(uint8_t code, float scale) {
  return bf16_round_bits(e4m3_to_float(code) * scale);
}

// The 16 NormalFloat4 levels, ascending, each the fp32 nearest the rule's Python float.
OFFLOAD_EXT_HD inline float nf4_level(int q) {
  switch (q) {
    case 0: return static_cast<float>(-1.0);
    case 1: return static_cast<float>(-0.6961928009986877);
    case 2: return static_cast<float>(-0.5250730514526367);
    case 3: return static_cast<float>(-0.39491748809814453);
    case 4: return static_cast<float>(-0.28444138169288635);
    case 5: return static_cast<float>(-0.18477343022823334);
    case 6: return static_cast<float>(-0.09105003625154495);
    case 7: return 0.0f;
    case 8: return static_cast<float>(0.07958029955625534);
    case 9: return static_cast<float>(0.16093020141124725);
    case 10: return static_cast<float>(0.24611230194568634);
    case 11: return static_cast<float>(0.33791524171829224);
    case 12: return static_cast<float>(0.44070982933044434);
    case 13: return static_cast<float>(0.5626170039176941);
    case 14: return static_cast<float>(0.7229568362236023);
    default: return 1.0f;
  }
}

// Element i's 4-bit code: two a byte, the first in the high nibble.
OFFLOAD_EXT_HD inline int nf4_code(const uint8_t* codes, int64_t i) {
  const uint8_t byte = codes[i >> 1];
  return (i & 1) ? (byte & 0xF) : (byte >> 4);
}

}  // namespace
}  // namespace offload_ext
