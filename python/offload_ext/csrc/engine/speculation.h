// Speculation: speculative clipping's protocol state and its moves on the step scheduler's queue.
// A unit's step may run before the global gradient norm is known (speculate: a kSpeculativeStep behind the
// unit's norm, into its second state buffers); once every norm is in, each such step stands (release) or is
// redone clipped from the state before it (redo, or take_over for a redo on the device). Meanwhile norms are
// counted from their copy's enqueue until done, and go first while a caller waits for them; once the norms
// are in (after a step that clipped: from the start, hold_all) a speculative step not yet started is held,
// to become the plain or the clipped step itself, in place. A step after the norm (a redo, a clipped step)
// runs params first, its moments pass trailing (set_params_first).
// It works on the scheduler's queue and units and keeps no lock of its own: the scheduler calls every member
// under its lock.
#pragma once

#include <cstdint>
#include <deque>
#include <vector>

#include "job.h"
#include "scheduled_unit.h"

namespace offload_ext {

class Speculation {
 public:
  using Queue = std::deque<QueuedJob>;

  Speculation(Queue& queue, std::vector<ScheduledUnit>& units) : queue_(queue), units_(units) {}
  Speculation(const Speculation&) = delete;
  Speculation& operator=(const Speculation&) = delete;

  // A norm job (or a speculative step whose norm is taken on the device) is on its way: the norms are not
  // known until it is done, even while its copy is in flight.
  void expect_norm() { ++norms_pending_; }
  // Takes back one expect_norm() whose job will never be queued (its copy failed to enqueue).
  void withdraw_norm() { --norms_pending_; }
  // The job at `at` was just queued: a clipped step is split (params first); a speculative step's copy landed,
  // its norm taken on the device.
  void queued(Queue::iterator at);
  // The job's last slice finished (`ran` false: skipped after a failure); the scheduler counts it stepped.
  void finished(const QueuedJob& job, bool ran);

  // A caller starts waiting for the norms: they go first, and from now on speculative steps are held.
  void start_norm_wait();
  void end_norm_wait() { --norm_waiters_; }
  bool norms_known() const { return norms_pending_ == 0; }
  bool norms_first() const { return norm_waiters_ > 0; }
  // Every speculative step is held from now on (after a step that clipped, clipping tends to trigger again).
  void hold_all() { hold_all_ = true; }
  // Whether `job` may not start now; `failed`: the scheduler failed, every job is skipped at once.
  bool held(const QueuedJob& job, bool failed) const;
  // The norm decided without clipping: held speculative steps become in-place kScaleSteps with scale 1.
  // Returns whether anything was held (the scheduler wakes its thread).
  bool release();
  // Everything is to be done (wait_all, drain): nothing stays held; held jobs run as they are. Returns
  // whether anything was held.
  bool drop_holds();

  // Redo unit `id`'s speculative step with gradients scaled by `scale` (hyperparameters `hypers`): one not yet
  // started becomes an in-place kScaleStep; else a kRedo is queued behind it. Returns whether a job was added.
  bool redo(int id, const std::vector<AdamWHyper>& hypers, float scale);
  // The unit's clipped redo happens on the device: a speculative step not yet started is dropped, its swap
  // done as if it had run (returns true); one started is left to finish. Throws without second buffers.
  bool take_over(int id);

  // A step after the norm runs as two passes, the params first (see StepScheduler::set_params_first).
  void set_params_first(bool on) { params_first_ = on; }

 private:
  // With params first, the step at `at` stores the params alone and its moments pass is queued right behind
  // it (one job more expected).
  void split(Queue::iterator at);
  // Unit id's last queued job when it is a speculative step no slice of which has run, else queue_.end().
  Queue::iterator unstarted(int id);

  Queue& queue_;
  std::vector<ScheduledUnit>& units_;
  int64_t norms_pending_ = 0;      // announced norm jobs not yet done
  int norm_waiters_ = 0;           // callers blocked in wait_norms()
  bool hold_after_norms_ = false;  // a caller waited for the norms: hold once they are known
  bool hold_all_ = false;          // see hold_all()
  bool params_first_ = true;
};

}  // namespace offload_ext
