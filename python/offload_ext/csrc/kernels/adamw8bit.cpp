// 8-bit AdamW dispatch: the maps' encoder tables (built once a map), the ISA, and whole blocks spread over the
// ThreadPool (a block's absmax is its own, so the split changes no bit).
#include "adamw8bit.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

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
  auto blocks = level == SimdLevel::kAvx512 ? adamw8bit_blocks_avx512
                : level == SimdLevel::kAvx2 ? adamw8bit_blocks_avx2
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
