// Speculation's moves: which queued jobs wait for the norm, and how a speculative step becomes the final
// step (kept, turned into a plain or clipped step in place, redone, or dropped for the device).
#include "speculation.h"

#include <iterator>
#include <stdexcept>
#include <string>

namespace offload_ext {

void Speculation::queued(Queue::iterator at) {
  if (at->job == Job::kScaleStep) split(at);  // queued so only once the norm is known
  if (at->job == Job::kSpeculativeStep) --norms_pending_;  // its copy landed: see Engine::copy
}

void Speculation::finished(const QueuedJob& job, bool ran) {
  ScheduledUnit& unit = units_[static_cast<size_t>(job.unit)];
  if (job.parts == Parts::kMoments) --unit.trailing;
  if (carries_norm(job.job)) --norms_pending_;
  if (job.job == Job::kSpeculativeStep && ran) unit.swap();
}

void Speculation::start_norm_wait() {
  hold_after_norms_ = true;
  ++norm_waiters_;
}

bool Speculation::held(const QueuedJob& job, bool failed) const {
  // On the GPU machine a speculative step that started in the gap between the last norm and the redos
  // delayed the whole redo chain, which the next forward waits on, by one step (B1 with clipping on every
  // step). After a step that clipped, every one is held from the start (hold_all).
  const bool holding = !failed && (hold_all_ || (hold_after_norms_ && norms_pending_ == 0));
  return holding && job.job == Job::kSpeculativeStep && job.begin == 0 &&
         !units_[static_cast<size_t>(job.unit)].waited();
}

bool Speculation::release() {
  if (!drop_holds()) return false;
  // One pass: a step still held when the norm did not clip is one the host had not reached in backward,
  // so it is behind, and one pass is less work than two (B2 with clipping: the host was busy the whole step).
  for (QueuedJob& q : queue_) {
    if (q.job == Job::kSpeculativeStep && q.begin == 0) q.job = Job::kScaleStep;  // q.scale is 1
  }
  return true;
}

bool Speculation::drop_holds() {
  const bool holding = hold_after_norms_ || hold_all_;
  hold_after_norms_ = false;
  hold_all_ = false;
  return holding;
}

bool Speculation::redo(int id, const std::vector<AdamWHyper>& hypers, float scale) {
  const auto it = unstarted(id);
  if (it != queue_.end()) {  // not started: step once, clipped, in place
    it->job = Job::kScaleStep;
    it->scale = scale;
    split(it);
    return false;
  }
  ++units_[static_cast<size_t>(id)].expected;
  queue_.push_back({id, hypers, Job::kRedo, scale});
  split(std::prev(queue_.end()));
  return true;
}

bool Speculation::take_over(int id) {
  ScheduledUnit& unit = units_[static_cast<size_t>(id)];
  if (unit.span.alt_param == nullptr) {
    throw std::invalid_argument("StepScheduler: unit " + std::to_string(id) +
                                " has no second buffers: only a speculative step can be taken over");
  }
  const auto it = unstarted(id);
  if (it == queue_.end()) return false;
  queue_.erase(it);
  ++unit.stepped;
  unit.swap();
  return true;
}

void Speculation::split(Queue::iterator at) {
  if (!params_first_ || at->parts != Parts::kAll) return;
  at->parts = Parts::kParams;
  QueuedJob moments = *at;
  moments.parts = Parts::kMoments;
  ScheduledUnit& unit = units_[static_cast<size_t>(at->unit)];
  ++unit.expected;
  ++unit.trailing;
  queue_.insert(std::next(at), std::move(moments));
}

Speculation::Queue::iterator Speculation::unstarted(int id) {
  for (auto it = queue_.rbegin(); it != queue_.rend(); ++it) {
    if (it->unit != id) continue;
    const bool unstarted = it->job == Job::kSpeculativeStep && it->begin == 0;
    return unstarted ? std::prev(it.base()) : queue_.end();
  }
  return queue_.end();
}

}  // namespace offload_ext
