// dequantize_base on the CPU (the simulated device, and any CPU tensor), on the global pool: each element's value
// depends on its code and scale alone, so the split changes no bit.
#include "dequantize.h"

#include <algorithm>

#include "../common/messages.h"
#include "../common/thread_pool.h"

namespace offload_ext {

int64_t base_scale_count(BaseFormat f, int64_t rows, int64_t cols) {
  return f == BaseFormat::kNf4 ? rows * cols / kNf4Block : rows;
}

BaseFormat check_dequantize_args(const at::Tensor& storage, const std::string& fmt, int64_t rows, int64_t cols,
                                 const at::Tensor& out) {
  constexpr const char* who = "dequantize_base";
  BaseFormat f;
  if (fmt == "int8") {
    f = BaseFormat::kInt8;
  } else if (fmt == "fp8") {
    f = BaseFormat::kFp8;
  } else {
    TORCH_CHECK(fmt == "nf4", who, ": unknown format '", fmt, "'; expected int8, fp8 or nf4");
    f = BaseFormat::kNf4;
  }
  TORCH_CHECK(rows >= 0 && cols >= 0, who, ": expected a shape of rows, cols >= 0, got ", num(rows), " x ", num(cols));
  const int64_t n = rows * cols;
  TORCH_CHECK(f != BaseFormat::kNf4 || n % kNf4Block == 0, who, ": nf4 holds whole blocks of ", num(kNf4Block),
              " elements; a ", num(rows), " x ", num(cols), " weight has ", num(n));
  const auto check_span = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.scalar_type() == at::kBFloat16, who, ": expected ", name, " of dtype bfloat16, got ",
                t.scalar_type());
    TORCH_CHECK(t.is_contiguous(), who, ": expected ", name, " contiguous (one flat span); call .contiguous() first");
  };
  check_span(storage, "storage");
  check_span(out, "out");
  TORCH_CHECK(out.numel() == n, who, ": expected out to have ", num(n), " elements (", num(rows), " x ", num(cols),
              "), got ", num(out.numel()));
  TORCH_CHECK(out.device() == storage.device(), who, ": expected out on ", storage.device(), " (as storage), got ",
              out.device());
  const int64_t bytes = 4 * base_scale_count(f, rows, cols) + (f == BaseFormat::kNf4 ? n / 2 : n);
  const int64_t stored = 2 * ((bytes + 3) / 4);
  TORCH_CHECK(storage.numel() == stored, who, ": expected storage to have ", num(stored), " bf16 elements (",
              fmt, " scales and codes of ", num(rows), " x ", num(cols), "), got ", num(storage.numel()));
  TORCH_CHECK(reinterpret_cast<uintptr_t>(storage.const_data_ptr()) % 4 == 0, who,
              ": expected storage to start 4-byte aligned (its fp32 scales); take it at an even element offset");
  return f;
}

void dequantize_base_cpu(const at::Tensor& storage, const std::string& fmt, int64_t rows, int64_t cols,
                         const at::Tensor& out) {
  const BaseFormat f = check_dequantize_args(storage, fmt, rows, cols, out);
  const int64_t n = rows * cols;
  const auto* scales = static_cast<const float*>(storage.const_data_ptr());
  const auto* codes = reinterpret_cast<const uint8_t*>(scales + base_scale_count(f, rows, cols));
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  constexpr int64_t kChunk = 1 << 16;  // a multiple of the nf4 block
  global_pool()->parallel_for((n + kChunk - 1) / kChunk, [&](int64_t task) {
    const int64_t end = std::min(n, (task + 1) * kChunk);
    int64_t i = task * kChunk;
    if (f == BaseFormat::kNf4) {
      for (; i < end; ++i) o[i] = bf16_round_bits(nf4_level(nf4_code(codes, i)) * scales[i / kNf4Block]);
      return;
    }
    while (i < end) {  // a row's run of the chunk at a time
      const int64_t row = i / cols, stop = std::min(end, (row + 1) * cols);
      const float s = scales[row];
      if (f == BaseFormat::kInt8) {
        for (; i < stop; ++i) o[i] = dequant_int8(codes[i], s);
      } else {
        for (; i < stop; ++i) o[i] = dequant_fp8(codes[i], s);
      }
    }
  });
}

}  // namespace offload_ext
