// 8-bit AdamW dispatch: the maps' encoder tables (built once a map), the ISA, and whole blocks spread over the
// ThreadPool (a block's absmax is its own, so the split changes no bit).
#include "adamw8bit.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <utility>
#include <vector>

#include "bf16.h"

namespace offload_ext {
namespace {

constexpr int64_t kMinParallelBlocks = (int64_t{1} << 16) / kBlock;  // below this, threading costs more than it saves
constexpr int64_t kMinTaskBlocks = (int64_t{1} << 15) / kBlock;
constexpr int64_t kTasksPerThread = 4;  // some slack so a descheduled thread does not stall a step

float float_of_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// The least and the greatest non-NaN float of bucket `key` (false: it holds NaNs alone).
bool bucket_bounds(uint32_t key, float& least, float& most) {
  const bool negative = key & 0x8000u;
  if ((key & 0x7f80u) == 0x7f80u) {  // the exponent of infinities and NaNs: only the infinity's bucket counts
    least = most = negative ? -INFINITY : INFINITY;
    return (key & 0x7fu) == 0;
  }
  least = float_of_bits(negative ? key << 16 | 0xffffu : key << 16);
  most = float_of_bits(negative ? key << 16 : key << 16 | 0xffffu);
  return true;
}

// The dynamic maps' LinearEncoder of midpoints `mid`, usable if they fit it: P (the non-negative ones) holds the
// midpoint above 0, then for each decimal exponent e = 0 .. 6 the n0 * 2^e - 1 between its codes and the one
// above its last (n0 = 1 signed, 2 unsigned: 1 + 127 * n0 in all); those are the anchors, the inner ones sit
// near fma(x, slope, offset) = base + rank + 1 as the codes' formula puts them.
LinearEncoder build_linear(const float* mid) {
  constexpr int kDecades = 7;
  constexpr int kSegments = kDecades + 2;
  LinearEncoder l{};
  int zero = 0;
  while (zero < kCodes - 1 && mid[zero] < 0.0f) ++zero;
  const float* p = mid + zero;
  const int positive = kCodes - 1 - zero;
  if (zero > positive || (positive - 1) % ((1 << kDecades) - 1) != 0 || !(p[0] > 0.0f)) return l;
  for (int k = 0; k < zero; ++k) {
    if (mid[zero - 1 - k] != -p[k]) return l;
  }
  const int n0 = (positive - 1) / ((1 << kDecades) - 1);
  l.zero = zero;
  for (int s = 0; s < 16; ++s) {  // below the first anchor and past the last: no run, pos(a) = count + 0.5
    const int count = s == 0 ? 0 : positive;
    l.anchor[s] = INFINITY;
    l.slope[s] = 0.0f;
    l.offset[s] = l.limit[s] = static_cast<float>(count) + 0.5f;
  }
  int at = 0;  // P's index of anchor e
  for (int e = 0; e < kDecades; ++e) {
    const int n = n0 << e, s = e + 1, base = at + 1;
    l.anchor[e] = p[at];
    l.slope[s] = static_cast<float>(std::pow(10.0, kDecades - 1 - e) * n / 0.9);
    l.offset[s] = static_cast<float>(base - n / 9.0);
    l.limit[s] = static_cast<float>(at + n) + 0.5f;
    if (!(std::fma(p[at], l.slope[s], l.offset[s]) >= static_cast<float>(base) - kLinearMargin)) return l;
    for (int r = 0; r + 1 < n; ++r) {
      const float pos = std::fma(p[at + 1 + r], l.slope[s], l.offset[s]);
      if (!(std::fabs(pos - static_cast<float>(base + r + 1)) < kLinearMargin)) return l;
    }
    at += n;
  }
  l.anchor[kDecades] = p[at];
  int in_class[32] = {};
  for (int s = 0; s + 1 < kSegments; ++s) {
    const int binade = static_cast<int>(float_bits(l.anchor[s]) >> 23) - kLinearBinade0;
    if (++in_class[std::clamp(binade, 0, 31)] > 1) return l;
  }
  for (int c = 0; c < 32; ++c) {
    const float least = c == 0 ? 0.0f : float_of_bits(static_cast<uint32_t>(kLinearBinade0 + c) << 23);
    l.segment_of_exponent[(kLinearBinade0 + c) % 32] = static_cast<int32_t>(std::lower_bound(l.anchor, l.anchor + kSegments - 1, least) - l.anchor);
  }
  l.usable = true;
  return l;
}

std::shared_ptr<const MapTables> build_tables(const float* code) {
  auto t = std::make_shared<MapTables>();
  for (int k = 0; k + 1 < kCodes; ++k) t->mid[k] = (code[k] + code[k + 1]) * 0.5f;
  t->mid[kCodes - 1] = INFINITY;
  std::memset(t->below, 0, sizeof(t->below));
  t->bucketed = true;
  const float* end = t->mid + kCodes - 1;
  for (uint32_t key = 0; key < kBuckets; ++key) {
    float least, most;
    if (!bucket_bounds(key, least, most)) continue;
    const int64_t below = std::lower_bound(static_cast<const float*>(t->mid), end, least) - t->mid;
    t->below[key] = static_cast<uint8_t>(below);
    if (below + 1 < kCodes - 1 && !(t->mid[below + 1] > most)) t->bucketed = false;
  }
  t->linear = build_linear(t->mid);
  for (int c = 0; c < kCodes; ++c) {
    uint32_t bits;
    std::memcpy(&bits, code + c, sizeof(bits));
    for (int k = 0; k < 4; ++k) t->planes[k][c] = static_cast<uint8_t>(bits >> (8 * k));
  }
  return t;
}

// A map's tables, built once for each map seen lately (a step passes the same two maps every time).
std::shared_ptr<const MapTables> map_tables(const float* code) {
  constexpr size_t kKept = 4;
  using Codes = std::array<float, kCodes>;
  static std::mutex mutex;
  static std::vector<std::pair<Codes, std::shared_ptr<const MapTables>>> kept;
  Codes codes;
  std::memcpy(codes.data(), code, sizeof(codes));
  std::lock_guard<std::mutex> lock(mutex);
  for (const auto& [seen, tables] : kept) {
    if (std::memcmp(seen.data(), codes.data(), sizeof(codes)) == 0) return tables;
  }
  if (kept.size() == kKept) kept.erase(kept.begin());
  kept.emplace_back(codes, build_tables(code));
  return kept.back().second;
}

}  // namespace

void adamw8bit(const EightBitPass& pass, int64_t n, const AdamWHyper& h, ThreadPool& pool, SimdLevel level,
               const std::optional<SrStream>& sr) {
  if (pass.grad_type == GradType::kFP32 && (pass.grad_add != nullptr || pass.grad_scale != 1.0f ||
                                            pass.parts != Parts::kAll)) {
    throw std::invalid_argument("adamw8bit: a gradient sum, a scale or a partial pass takes bf16 gradients");
  }
  const AdamWCoef c = make_coef(h);
  const auto exp_avg_tables = map_tables(pass.exp_avg_code);
  const auto exp_avg_sq_tables = map_tables(pass.exp_avg_sq_code);
  EightBitTables t;
  t.exp_avg = exp_avg_tables.get();
  t.exp_avg_sq = exp_avg_sq_tables.get();
  if (sr) {
    t.stochastic = true;
    t.sr_seed = sr->seed;
    t.sr_stream = sr->stream;
    t.sr_index = sr->index;
    t.step = h.step;
  }
  auto blocks = level == SimdLevel::kAvx512Vbmi ? adamw8bit_blocks_avx512vbmi
                : level == SimdLevel::kAvx512   ? adamw8bit_blocks_avx512
                : level == SimdLevel::kAvx2     ? adamw8bit_blocks_avx2
                                                : adamw8bit_blocks_scalar;
  const int64_t total = num_blocks(n);
  const int64_t threads = pool.num_threads();
  if (total < kMinParallelBlocks || threads == 1) {
    blocks(pass, n, 0, total, t, c);
    return;
  }
  const int64_t tasks = std::min(threads * kTasksPerThread, std::max<int64_t>(1, total / kMinTaskBlocks));
  const int64_t per_task = (total + tasks - 1) / tasks;
  pool.parallel_for((total + per_task - 1) / per_task, [&](int64_t task) {
    const int64_t first = task * per_task;
    blocks(pass, n, first, std::min(total, first + per_task), t, c);
  });
}

}  // namespace offload_ext
