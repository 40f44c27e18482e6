// StepScheduler: one scheduling thread takes queued units (the one a caller waits on first, else the
// lowest id) and runs each unit's job across the pool, one slice at a time, choosing again after every
// slice (the scheduling thread works as one of the pool's threads).
#include "step_scheduler.h"

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <iterator>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>

namespace offload_ext {

StepScheduler::StepScheduler(std::shared_ptr<ThreadPool> pool)
    : pool_(std::move(pool)), thread_([this] { loop(); }) {}

StepScheduler::~StepScheduler() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  thread_.join();
}

int StepScheduler::add_unit(const StepUnit& unit, std::vector<GroupRange> groups) {
  if (groups.empty()) groups.push_back({0, 0, unit.numel});
  check_group_ranges(groups, unit.numel);
  if (unit.eight_bit) number_blocks(groups);
  std::lock_guard<std::mutex> lock(mutex_);
  units_.push_back(ScheduledUnit{unit, std::move(groups)});
  return static_cast<int>(units_.size()) - 1;
}

void StepScheduler::set_hyper(int group, const AdamWHyper& h) {
  if (group < 0) throw std::invalid_argument("StepScheduler: group must be >= 0, got " + std::to_string(group));
  std::lock_guard<std::mutex> lock(mutex_);
  if (static_cast<size_t>(group) >= hypers_.size()) hypers_.resize(static_cast<size_t>(group) + 1);
  hypers_[static_cast<size_t>(group)] = h;
}

void StepScheduler::set_trace(std::shared_ptr<TraceRecorder> trace) {
  std::lock_guard<std::mutex> lock(mutex_);
  trace_ = std::move(trace);
}

void StepScheduler::expect(int id, bool norm) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_unit_locked(id);
  ++units_[id].expected;
  if (norm) speculation_.expect_norm();  // from the enqueue on: a norm whose copy is still in flight counts too
}

void StepScheduler::withdraw(int id, bool norm) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    --units_[id].expected;
    if (norm) speculation_.withdraw_norm();
  }
  done_cv_.notify_all();  // a caller may be blocked on just the withdrawn job
}

void StepScheduler::notify(int id, Job job, float scale, bool then_step) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (id < 0 || id >= static_cast<int>(units_.size())) {
      fail_locked(std::make_exception_ptr(std::out_of_range("StepScheduler: no unit " + std::to_string(id))));
      return;
    }
    const StepUnit& span = units_[id].span;
    if ((job != Job::kStep) && span.accum == nullptr) {
      fail_locked(std::make_exception_ptr(std::invalid_argument(
          "StepScheduler: unit " + std::to_string(id) + " has no gradient accumulator")));
    }
    if ((then_step || uses_second_buffers(job)) && span.alt_param == nullptr) {
      fail_locked(std::make_exception_ptr(std::invalid_argument(
          "StepScheduler: unit " + std::to_string(id) + " has no second state buffers for speculative clipping")));
    }
    queue_.push_back({id, hypers_, job, scale});
    speculation_.queued(std::prev(queue_.end()));
    if (then_step) queue_.push_back({id, hypers_, Job::kSpeculativeStep, 1.0f});
  }
  work_cv_.notify_one();
  if (job == Job::kSpeculativeStep) done_cv_.notify_all();  // wait_norms may be waiting for this landing
}

void StepScheduler::loop() {
  pthread_setname_np(pthread_self(), "offload-sched");
  try {
    pool_->lower_calling_thread();  // it works as one of the pool's threads
  } catch (...) {
    std::lock_guard<std::mutex> lock(mutex_);
    fail_locked(std::current_exception());  // every wait raises it; nothing is stepped
  }
  for (;;) {
    try {
      if (!loop_once()) return;
    } catch (...) {
      // Out of memory in the bookkeeping itself: the scheduler fails, every wait raises it; no abort().
      {
        std::lock_guard<std::mutex> lock(mutex_);
        fail_locked(std::current_exception());
        running_ = 0;
      }
      done_cv_.notify_all();
    }
  }
}

bool StepScheduler::loop_once() {
  QueuedJob job;
  bool skip;
  StepUnit span;
  std::shared_ptr<TraceRecorder> trace;
  std::vector<GroupRange> groups;
  int delay_us;
  int64_t end;
  std::exception_ptr failure;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    auto next = queue_.end();
    work_cv_.wait(lock, [&] { return stopping_ || (next = pick_locked()) != queue_.end(); });
    if (next == queue_.end()) return false;  // stopping, and nothing (more) may run
    job = *next;
    queue_.erase(next);
    ++running_;
    skip = static_cast<bool>(error_);  // after a failure, state is suspect: stop stepping
    span = units_[job.unit].span;
    groups = units_[job.unit].groups;
    trace = trace_;
    delay_us = debug_step_delay_us_;
    // A norm is one sum in a fixed order; a skipped job is done at once.
    end = carries_norm(job.job) || skip ? span.numel : std::min(span.numel, job.begin + slice_);
    if (span.eight_bit) end = block_cut(groups, end);
    if (fail_next_ && !skip) {
      fail_next_ = false;
      failure = std::make_exception_ptr(std::runtime_error(
          "StepScheduler: injected failure while stepping unit " + std::to_string(job.unit)));
      skip = true;
    }
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::optional<double> sq_norm;
  if (!skip) {
    if (delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
    const int64_t begin_ns = TraceRecorder::now_ns();
    try {
      sq_norm = run_job(job, span, groups, job.begin, end, *pool_);
    } catch (...) {
      failure = std::current_exception();
    }
    if (trace && trace->enabled()) {
      const char* part = job.parts == Parts::kParams ? " (params)" : job.parts == Parts::kMoments ? " (moments)" : "";
      trace->record("host step", std::string(job_name(job.job)) + part + " u" + std::to_string(job.unit), begin_ns,
                    TraceRecorder::now_ns(), job.unit);
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    --running_;
    if (failure) fail_locked(failure);
    if (!skip) stats_.busy_seconds += seconds;
    if (sq_norm) units_[job.unit].sq_norm = *sq_norm;
    if (end < span.numel && !error_) {
      // The rest goes back at the front: this unit's later jobs stay behind it.
      job.begin = end;
      queue_.push_front(job);
      return true;
    }
    ++units_[job.unit].stepped;
    speculation_.finished(job, !skip);
    if (!skip && job.parts != Parts::kMoments) ++stats_.units_stepped;
  }
  done_cv_.notify_all();
  return true;
}

std::deque<QueuedJob>::iterator StepScheduler::pick_locked() {
  // A unit someone is blocked on goes first (a forward layer, or a gradient slot about to be reused);
  // else the lowest unit id, the one the next forward needs soonest. The first queued job of the
  // chosen unit is taken, so one unit's jobs keep their order.
  // While someone waits for the norms (speculative clipping), a unit whose next job is a norm goes
  // before the others. A moments pass goes after every other unit's work, unless a job of its unit waits
  // behind it: then it ranks as that job.
  auto rank = [&](const QueuedJob& head, const QueuedJob* behind) {
    const QueuedJob& q = head.parts == Parts::kMoments && behind != nullptr ? *behind : head;
    const bool trailing = q.parts == Parts::kMoments;
    const ScheduledUnit& unit = units_[q.unit];
    // A caller waiting for the params waits for no trailing moments pass (its wait may not have returned yet).
    const bool waited = unit.waiters > 0 || (unit.params_waiters > 0 && !trailing);
    return std::make_tuple(!waited, !(speculation_.norms_first() && carries_norm(q.job)), trailing, q.unit);
  };
  std::vector<std::deque<QueuedJob>::iterator> head(units_.size(), queue_.end());
  std::vector<const QueuedJob*> behind(units_.size(), nullptr);
  for (auto it = queue_.begin(); it != queue_.end(); ++it) {
    const auto u = static_cast<size_t>(it->unit);
    if (head[u] == queue_.end()) {
      head[u] = it;  // only a unit's first queued job is a candidate
    } else if (behind[u] == nullptr) {
      behind[u] = &*it;
    }
  }
  auto best = queue_.end();
  const QueuedJob* best_behind = nullptr;
  for (size_t u = 0; u < head.size(); ++u) {
    if (head[u] == queue_.end() || speculation_.held(*head[u], error_ != nullptr)) continue;
    if (best == queue_.end() || rank(*head[u], behind[u]) < rank(*best, best_behind)) {
      best = head[u];
      best_behind = behind[u];
    }
  }
  return best;
}

template <class Done>
bool StepScheduler::wait_locked(std::unique_lock<std::mutex>& lock, Done done, std::chrono::milliseconds timeout) {
  if (done() || error_) return true;
  const auto t0 = std::chrono::steady_clock::now();
  const bool ended = done_cv_.wait_for(lock, timeout, [&] { return done() || error_ != nullptr; });
  stats_.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return ended;
}

void StepScheduler::check_unit_locked(int id) const {
  if (id < 0 || id >= static_cast<int>(units_.size())) {
    throw std::out_of_range("StepScheduler: no unit " + std::to_string(id));
  }
}

void StepScheduler::rethrow_locked() {
  // Kept: a unit stepped after a failure would leave the layers at different steps.
  if (error_) std::rethrow_exception(error_);
}

void StepScheduler::fail_locked(std::exception_ptr error) {
  if (!error_) error_ = std::move(error);
}

void StepScheduler::fail(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    fail_locked(std::move(error));
  }
  work_cv_.notify_all();  // queued jobs are skipped from now on
  done_cv_.notify_all();  // every wait raises it
}

std::string StepScheduler::error_message() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!error_) return {};
  try {
    std::rethrow_exception(error_);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown error";
  }
}

bool StepScheduler::wait(int id, bool params_only, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  check_unit_locked(id);
  return wait_unit_locked(lock, id, params_only, timeout);
}

bool StepScheduler::wait_unit_locked(std::unique_lock<std::mutex>& lock, int id, bool params_only,
                                     std::chrono::milliseconds timeout) {
  rethrow_locked();
  if (units_[id].done(params_only)) return true;
  // By index, not by reference: add_unit may move the units while the lock is released.
  auto waiters = [&]() -> int& { return params_only ? units_[id].params_waiters : units_[id].waiters; };
  ++waiters();
  work_cv_.notify_all();  // a held job of this unit may run now, and its jobs go first
  const bool ended = wait_locked(lock, [&] { return units_[id].done(params_only); }, timeout);
  --waiters();
  rethrow_locked();
  return ended;
}

void StepScheduler::set_params_first(bool on) {
  std::lock_guard<std::mutex> lock(mutex_);
  speculation_.set_params_first(on);
}

bool StepScheduler::has_second_buffers(int id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  check_unit_locked(id);
  return units_[id].span.alt_param != nullptr;
}

bool StepScheduler::swapped(int id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  check_unit_locked(id);
  return units_[id].swapped;
}

bool StepScheduler::ready(int id, bool params_only) const {
  std::lock_guard<std::mutex> lock(mutex_);
  check_unit_locked(id);
  return units_[id].done(params_only);
}

void StepScheduler::set_debug_step_delay_us(int us) {
  std::lock_guard<std::mutex> lock(mutex_);
  debug_step_delay_us_ = std::max(0, us);
}

void StepScheduler::set_slice_elements(int64_t n) {
  if (n < 1) throw std::invalid_argument("StepScheduler: slice must be >= 1 element, got " + std::to_string(n));
  std::lock_guard<std::mutex> lock(mutex_);
  slice_ = n;
}

void StepScheduler::release_speculation() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!speculation_.release()) return;
  }
  work_cv_.notify_all();
}

void StepScheduler::drop_holds_locked() {
  if (speculation_.drop_holds()) work_cv_.notify_all();
}

bool StepScheduler::wait_all(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  drop_holds_locked();
  const bool ended = wait_locked(lock, [&] {
    return std::all_of(units_.begin(), units_.end(), [](const ScheduledUnit& u) { return u.done(false); });
  }, timeout);
  rethrow_locked();
  return ended;
}

bool StepScheduler::drain(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  drop_holds_locked();
  return done_cv_.wait_for(lock, timeout, [&] { return queue_.empty() && running_ == 0; });
}

void StepScheduler::check() {
  std::lock_guard<std::mutex> lock(mutex_);
  rethrow_locked();
}

void StepScheduler::hold_speculation() {
  std::lock_guard<std::mutex> lock(mutex_);
  speculation_.hold_all();
}

bool StepScheduler::wait_norms(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  speculation_.start_norm_wait();
  work_cv_.notify_all();  // norms go first from now on
  const bool ended = wait_locked(lock, [&] { return speculation_.norms_known(); }, timeout);
  speculation_.end_norm_wait();
  rethrow_locked();
  return ended;
}

void StepScheduler::redo(int id, float scale) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    check_unit_locked(id);
    if (!speculation_.redo(id, hypers_, scale)) return;
  }
  work_cv_.notify_one();
}

void StepScheduler::take_over(int id) {
  std::unique_lock<std::mutex> lock(mutex_);
  check_unit_locked(id);
  if (speculation_.take_over(id)) done_cv_.notify_all();
  // A started speculative step: a host job, which ends (or fails, which ends the wait too).
  while (!wait_unit_locked(lock, id, false, std::chrono::hours(1))) {
  }
}

double StepScheduler::sq_norm(int id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  check_unit_locked(id);
  return units_[id].sq_norm;
}

void StepScheduler::inject_failure() {
  std::lock_guard<std::mutex> lock(mutex_);
  fail_next_ = true;
}

SchedulerStats StepScheduler::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

}  // namespace offload_ext
