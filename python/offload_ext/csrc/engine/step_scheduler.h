// StepScheduler: steps a unit (one layer's flat AdamW spans) on the library's worker threads the
// moment that unit's gradients have landed, while the GPU runs backward on the layers below; a step
// still queued when backward ends may finish during the next forward, before that unit is copied.
// A unit's job advances in slices, so a unit the next forward needs sooner can go ahead of one
// already started (the top layer, whose gradients land first, is needed last).
// Notifications may come from any thread (a CUDA host callback included); waits block without the
// GIL (the bindings release it); a failed step leaves the scheduler failed: every later wait or check
// rethrows that first error and no later job runs, for the scheduler's life (its Offloader is closed).
// The scheduler owns the queue, the thread and the waits; speculative clipping's protocol is Speculation's
// (speculation.h), a job's work on its unit is run_job's (job.h).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../common/thread_pool.h"
#include "../kernels/adamw_unit.h"
#include "job.h"
#include "scheduled_unit.h"
#include "speculation.h"
#include "trace.h"

namespace offload_ext {

struct SchedulerStats {
  double busy_seconds = 0;   // wall time spent stepping, summed over units
  int64_t units_stepped = 0;
  double wait_seconds = 0;   // time callers spent blocked in wait/wait_all
};

class StepScheduler {
 public:
  explicit StepScheduler(std::shared_ptr<ThreadPool> pool);
  ~StepScheduler();
  StepScheduler(const StepScheduler&) = delete;
  StepScheduler& operator=(const StepScheduler&) = delete;

  // `groups` split the unit into contiguous ranges, in order, covering it; empty: all of it in group 0.
  int add_unit(const StepUnit& unit, std::vector<GroupRange> groups = {});
  // Hyperparameters of parameter group `group` for the units notified from now on (a schedule changes
  // lr per step; groups differ in lr or weight decay).
  void set_hyper(int group, const AdamWHyper& h);
  // A step of unit `id` is on its way (its gradient copy is enqueued): waits cover it from now on,
  // even before the copy lands and calls notify.
  // `norm`: the job will carry a norm, which wait_norms() covers from now on too.
  void expect(int id, bool norm = false);
  // Takes back one expect(id) whose job will never be notified (its copy failed to enqueue), so waits
  // stop covering it. Requires that expect(id) call, which checked id.
  void withdraw(int id, bool norm = false);
  // Unit `id`'s gradients are in place: queue its job (and, with then_step, its kSpeculativeStep
  // behind it, in the same critical section: a redo must never see the norm without the step). Safe from
  // any thread.
  void notify(int id, Job job = Job::kStep, float scale = 1.0f, bool then_step = false);
  // The last norm result of unit `id` (after waiting for it).
  double sq_norm(int id) const;
  // Block until every queued norm (kNorm, kAccumulateNorm) is done and every speculative step a copy
  // announced has landed (its norm taken on the device); meanwhile norms go first. From then
  // on the norm is known and a speculative step started would be wasted or could be done in place: none
  // not yet started starts (unless a caller waits on its unit) until release_speculation() or wait_all().
  // Returns false when `timeout` passed first (the caller checks the copy streams and calls again).
  bool wait_norms(std::chrono::milliseconds timeout);
  // The norm decided (after any redo() calls): speculative steps still held become in-place kScaleSteps
  // with scale 1 (the norm did not clip: the same step, without the second buffers' traffic).
  void release_speculation();
  // From now on every speculative step is held as wait_norms() holds them, until release_speculation() or
  // wait_all(): after a step that clipped, clipping tends to trigger again, and a speculative step that ran
  // in backward would be wasted host work (its redo is on the next forward's path anyway, while a held one
  // becomes the clipped step itself, in place, or is dropped for a redo on the device).
  void hold_speculation();
  // Redo unit `id`'s speculative step with gradients scaled by `scale`: a kSpeculativeStep not yet
  // started becomes an in-place kScaleStep; else a kRedo is queued behind it.
  void redo(int id, float scale);
  // The caller redoes unit `id`'s clipped step elsewhere (on the device), from the state before its
  // speculative step into the second buffers: a speculative step not yet started is dropped, its swap done
  // as if it had run; one started is waited for. On return no job of the unit is queued or running, and
  // swapped(id) names the buffers the caller is to fill. Requires second buffers; rethrows a step's failure.
  void take_over(int id);
  // Block until unit `id` (or every notified unit) has been stepped; rethrows a step's failure.
  // While someone waits on a unit, its queued jobs go before all others. `params_only`: until its params
  // are final, a moments pass behind them (see set_params_first) may still be queued or running.
  // Returns false when `timeout` passed first.
  bool wait(int id, bool params_only, std::chrono::milliseconds timeout);
  // Whether every announced job of unit `id` is done (no waiting); `params_only` as in wait().
  bool ready(int id, bool params_only = false) const;
  // A step after the norm (a redo, a clipped step; not a held speculative step released unclipped: see
  // release_speculation) runs as two passes:
  // the params first, which the next forward's copy waits for, then the moments, which go after every
  // other unit's work and only the unit's next step waits for. The params pass computes the whole update
  // but stores only the params (~0.78 of a whole pass's time on the CPU machine), so the chain of redos the
  // next forward follows is shorter, at the cost of reading the moments and the gradient twice. On by
  // default; false: one pass.
  void set_params_first(bool on);
  // Whether unit `id` has second state buffers (it can step speculatively).
  bool has_second_buffers(int id) const;
  // Whether unit `id`'s live state is in its second buffers (an odd number of speculative steps so far).
  bool swapped(int id) const;
  // Returns false when `timeout` passed first.
  bool wait_all(std::chrono::milliseconds timeout);
  // Once nothing more will be notified (the copy streams synchronized or failed): releases held jobs and
  // blocks until no job is queued or running, without raising (after a failure the rest are skipped
  // at once). Returns false when `timeout` passed first.
  bool drain(std::chrono::milliseconds timeout);
  // Rethrows the failure, if any, without waiting; it stays.
  void check();
  // Enters the failed state with `error` unless already failed (a copy stream's fault, a callback's error).
  void fail(std::exception_ptr error);
  // The first failure's message, or empty.
  std::string error_message() const;
  // Where each slice of a job is recorded while the recorder is enabled (null: nowhere).
  void set_trace(std::shared_ptr<TraceRecorder> trace);
  // Testing aid: the next unit stepped fails as a real kernel failure would.
  void inject_failure();
  // Testing aid: every slice of a job sleeps this long first, as a slow host would (0 = off).
  void set_debug_step_delay_us(int us);
  // Elements per slice (>= 1); elementwise jobs give the same result on any slicing.
  void set_slice_elements(int64_t n);
  static constexpr int64_t kDefaultSlice = int64_t{1} << 24;
  SchedulerStats stats() const;
  std::shared_ptr<ThreadPool> pool() const { return pool_; }

 private:
  void loop();
  // Takes one job (or slice) and runs it; false once stopping with nothing left to run.
  bool loop_once();
  // The job to run next, or queue_.end() when none may run now (all held); requires mutex_.
  std::deque<QueuedJob>::iterator pick_locked();
  void rethrow_locked();  // requires mutex_
  void check_unit_locked(int id) const;  // requires mutex_; throws std::out_of_range for an unknown unit
  // Blocks on done_cv_ until done(), counting the time blocked in stats_.wait_seconds.
  // Returns done() (false: `timeout` passed first); a failure ends the wait too.
  template <class Done>
  bool wait_locked(std::unique_lock<std::mutex>& lock, Done done, std::chrono::milliseconds timeout);
  // wait(id)'s blocking part (id checked): its jobs go first meanwhile; rethrows a step's failure.
  bool wait_unit_locked(std::unique_lock<std::mutex>& lock, int id, bool params_only,
                        std::chrono::milliseconds timeout);
  void fail_locked(std::exception_ptr error);  // requires mutex_
  // Nothing stays held from now on (wait_all, drain); requires mutex_.
  void drop_holds_locked();

  std::shared_ptr<ThreadPool> pool_;
  std::vector<ScheduledUnit> units_;
  std::vector<AdamWHyper> hypers_;  // per parameter group
  std::shared_ptr<TraceRecorder> trace_;
  mutable std::mutex mutex_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::deque<QueuedJob> queue_;
  Speculation speculation_{queue_, units_};  // after the queue and the units it works on
  int running_ = 0;  // jobs taken off queue_ and not yet accounted (see drain())
  std::exception_ptr error_;
  SchedulerStats stats_;
  bool stopping_ = false;
  bool fail_next_ = false;
  int debug_step_delay_us_ = 0;
  int64_t slice_ = kDefaultSlice;
  std::thread thread_;  // last: starts after the members it uses exist
};

}  // namespace offload_ext
