// Job: what the step scheduler does to a unit (after its gradient copy lands, or when a caller asks), a
// queued job, and the work one slice of a job does on the unit's elements.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "../kernels/adamw_unit.h"

namespace offload_ext {

// What a landed gradient copy asks of its unit.
enum class Job {
  kStep = 0,            // step with the landed gradient
  kAccumulateFirst = 1, // accum = landed gradient (first micro-batch)
  kAccumulate = 2,      // accum += landed gradient, in bf16 like torch's .grad accumulation
  kAccumulateStep = 3,  // step with bf16(accum + landed gradient), summed inside the step (last micro-batch)
  kNorm = 4,            // sum of squares of accum, kept for sq_norm() (gradient clipping)
  kScaleStep = 5,       // accum *= scale (rounded to bf16, like torch's clipping), then step with accum
  // Speculative clipping: the norm of the summed gradient is known before any step is final.
  kAccumulateNorm = 7,  // accum += landed gradient, then its sum of squares (one pass)
  kSpeculativeStep = 8, // step with accum into the second state buffers, which become the live ones
  kRedo = 9,            // accum *= scale, then step again from the state before the speculative step
};

// A job's name on the timeline.
const char* job_name(Job job);
// Whether the job computes a norm (kNorm, kAccumulateNorm): wait_norms() covers it until it is done.
bool carries_norm(Job job);
// Whether the job uses the unit's second state buffers (kSpeculativeStep, kRedo).
bool uses_second_buffers(Job job);

// Elements [begin, end) of a unit stepped with the hyperparameters of parameter group `group`.
struct GroupRange {
  int group;
  int64_t begin;
  int64_t end;
  int64_t block0 = 0;  // 8-bit units: the absmax index of the range's first block (its blocks count from begin)
};

// 8-bit units: each range's block0 (the ranges' blocks in order), and the absmaxes all of them need.
int64_t number_blocks(std::vector<GroupRange>& groups);

// Where a slice of an 8-bit unit that would end at `end` ends: the first block boundary of its range at or past
// it (a block is stepped whole: its absmax is the largest of its elements).
int64_t block_cut(const std::vector<GroupRange>& groups, int64_t end);

// Throws std::invalid_argument unless `groups` are contiguous, in order, from element 0 to `numel`, with
// groups >= 0.
void check_group_ranges(const std::vector<GroupRange>& groups, int64_t numel);

// A job in the scheduler's queue.
struct QueuedJob {
  int unit;
  std::vector<AdamWHyper> hypers;  // per group, as set when the job was queued
  Job job;
  float scale;
  int64_t begin = 0;  // elements done by earlier slices
  Parts parts = Parts::kAll;
};

// The job's work on elements [begin, end) of `unit`, its AdamW pass split by the unit's group ranges;
// returns the sum of squares when the job carries a norm.
std::optional<double> run_job(const QueuedJob& job, const StepUnit& unit, const std::vector<GroupRange>& groups,
                              int64_t begin, int64_t end, ThreadPool& pool);

}  // namespace offload_ext
