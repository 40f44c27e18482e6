// A job's work on a slice of its unit: gradient sums and norms on the AdamW kernels' accumulate pass, and
// steps as one AdamW pass per parameter group over the slice.
#include "job.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "../kernels/adamw8bit.h"

namespace offload_ext {

const char* job_name(Job job) {
  switch (job) {
    case Job::kStep: return "step";
    case Job::kAccumulateFirst: return "accumulate (first)";
    case Job::kAccumulate: return "accumulate";
    case Job::kAccumulateStep: return "accumulate + step";
    case Job::kNorm: return "norm";
    case Job::kScaleStep: return "scale + step";
    case Job::kAccumulateNorm: return "accumulate + norm";
    case Job::kSpeculativeStep: return "speculative step";
    case Job::kRedo: return "scale + step from before (redo)";
  }
  return "?";
}

bool carries_norm(Job job) { return job == Job::kNorm || job == Job::kAccumulateNorm; }

bool uses_second_buffers(Job job) { return job == Job::kSpeculativeStep || job == Job::kRedo; }

void check_group_ranges(const std::vector<GroupRange>& groups, int64_t numel) {
  int64_t next = 0;
  for (const GroupRange& g : groups) {
    if (g.group < 0 || g.begin != next || g.end < g.begin) {
      throw std::invalid_argument("StepScheduler: group ranges must be contiguous, in order, from element 0, with "
                                  "groups >= 0; got group " + std::to_string(g.group) + " at [" +
                                  std::to_string(g.begin) + ", " + std::to_string(g.end) + ")");
    }
    next = g.end;
  }
  if (next != numel) {
    throw std::invalid_argument("StepScheduler: group ranges end at element " + std::to_string(next) +
                                " but the unit has " + std::to_string(numel));
  }
}

int64_t number_blocks(std::vector<GroupRange>& groups) {
  int64_t blocks = 0;
  for (GroupRange& g : groups) {
    g.block0 = blocks;
    blocks += num_blocks(g.end - g.begin);
  }
  return blocks;
}

int64_t block_cut(const std::vector<GroupRange>& groups, int64_t end) {
  for (const GroupRange& g : groups) {
    if (end > g.begin && end < g.end) return std::min(g.end, g.begin + num_blocks(end - g.begin) * kBlock);
  }
  return end;  // a range's end, or past them all
}

namespace {

// Runs fn(chunk_index, begin, end) over [0, n) in fixed chunks on the pool: fixed chunks keep
// per-chunk partial results (the norm) independent of the thread count.
constexpr int64_t kChunk = int64_t{1} << 18;

template <class Fn>
void for_fixed_chunks(int64_t n, ThreadPool& pool, const Fn& fn) {
  pool.parallel_for((n + kChunk - 1) / kChunk, [&](int64_t t) { fn(t, t * kChunk, std::min(n, (t + 1) * kChunk)); });
}

void bf16_copy(uint16_t* dst, const uint16_t* src, int64_t n, ThreadPool& pool) {
  for_fixed_chunks(n, pool, [&](int64_t, int64_t begin, int64_t end) {
    std::memcpy(dst + begin, src + begin, static_cast<size_t>(end - begin) * sizeof(uint16_t));
  });
}

}  // namespace

std::optional<double> run_job(const QueuedJob& job, const StepUnit& whole, const std::vector<GroupRange>& groups,
                              int64_t begin, int64_t end, ThreadPool& pool) {
  const StepUnit unit = sub_unit(whole, begin, end);
  const auto* landed = static_cast<const uint16_t*>(unit.grad);
  const SimdLevel level = active_simd_level();
  const void* grad = unit.accum;
  const uint16_t* grad_add = nullptr;
  const float scale = job.job == Job::kRedo || job.job == Job::kScaleStep ? job.scale : 1.0f;
  Flow flow = Flow::kInPlace;
  switch (job.job) {
    case Job::kAccumulateFirst:
      bf16_copy(unit.accum, landed, unit.numel, pool);
      return std::nullopt;
    case Job::kAccumulate:
      bf16_accumulate(unit.accum, landed, unit.numel, false, pool, level);
      return std::nullopt;
    case Job::kAccumulateStep:  // the sum is formed inside the step: no pass of its own
      grad = landed;
      grad_add = unit.accum;
      break;
    case Job::kNorm:
    case Job::kAccumulateNorm:
      return bf16_accumulate(unit.accum, job.job == Job::kNorm ? nullptr : landed, unit.numel, true, pool, level);
    case Job::kSpeculativeStep:
      flow = Flow::kToAlt;
      break;
    case Job::kRedo:  // the scaling happens in the step's read of the gradient
      flow = Flow::kFromAlt;
      break;
    case Job::kScaleStep:
      break;
    case Job::kStep:
      grad = landed;
      break;
  }
  // AdamW is elementwise: stepping the slice piece by piece, each with its group's hyperparameters,
  // gives the same values as one pass would with those hyperparameters.
  const int64_t grad_size = unit.bf16_mode || unit.grad_type == GradType::kBF16 ? 2 : 4;
  for (const GroupRange& g : groups) {
    const int64_t a = std::max(begin, g.begin), b = std::min(end, g.end);
    if (a >= b) continue;
    if (static_cast<size_t>(g.group) >= job.hypers.size()) {
      throw std::runtime_error("StepScheduler: no hyperparameters set for parameter group " + std::to_string(g.group));
    }
    const int64_t at = a - begin;  // within this slice
    StepUnit piece = sub_unit(unit, at, at + (b - a));
    if (piece.eight_bit) {
      if ((a - g.begin) % kBlock != 0) {
        throw std::logic_error("StepScheduler: an 8-bit slice must start on a block of its range (block_cut)");
      }
      piece = at_block(piece, g.block0 + (a - g.begin) / kBlock);
    }
    adamw_unit_pass(piece, static_cast<const char*>(grad) + at * grad_size, grad_add ? grad_add + at : nullptr, scale,
                    flow, job.hypers[static_cast<size_t>(g.group)], pool, job.parts);
  }
  return std::nullopt;
}

}  // namespace offload_ext
