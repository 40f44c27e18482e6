// StepScheduler: one scheduling thread takes queued units (the one a caller waits on first, else the
// lowest id) and runs each unit's fused AdamW across the pool, one slice at a time, choosing again
// after every slice (the scheduling thread works as one of the pool's threads).
#include "step_scheduler.h"

#include "bf16.h"

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <iterator>
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
  int64_t next = 0;
  for (const GroupRange& g : groups) {
    if (g.group < 0 || g.begin != next || g.end < g.begin) {
      throw std::invalid_argument("StepScheduler: group ranges must be contiguous, in order, from element 0, with "
                                  "groups >= 0; got group " + std::to_string(g.group) + " at [" +
                                  std::to_string(g.begin) + ", " + std::to_string(g.end) + ")");
    }
    next = g.end;
  }
  if (next != unit.numel) {
    throw std::invalid_argument("StepScheduler: group ranges end at element " + std::to_string(next) +
                                " but the unit has " + std::to_string(unit.numel));
  }
  std::lock_guard<std::mutex> lock(mutex_);
  units_.push_back(unit);
  groups_.push_back(std::move(groups));
  expected_.push_back(0);
  stepped_.push_back(0);
  sq_norms_.push_back(0.0);
  swapped_.push_back(false);
  waiters_.push_back(0);
  params_waiters_.push_back(0);
  trailing_.push_back(0);
  return static_cast<int>(units_.size()) - 1;
}

void StepScheduler::set_hyper(int group, const AdamWHyper& h) {
  if (group < 0) throw std::invalid_argument("StepScheduler: group must be >= 0, got " + std::to_string(group));
  std::lock_guard<std::mutex> lock(mutex_);
  if (static_cast<size_t>(group) >= hypers_.size()) hypers_.resize(static_cast<size_t>(group) + 1);
  hypers_[static_cast<size_t>(group)] = h;
}

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

namespace {
bool speculative(Job job) { return job == Job::kSpeculativeStep || job == Job::kRedo; }
}  // namespace

void StepScheduler::set_trace(std::shared_ptr<TraceRecorder> trace) {
  std::lock_guard<std::mutex> lock(mutex_);
  trace_ = std::move(trace);
}

void StepScheduler::expect(int id, bool norm) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_unit_locked(id);
  ++expected_[id];
  if (norm) ++norms_pending_;  // from the enqueue on: a norm whose copy is still in flight counts too
}

void StepScheduler::withdraw(int id, bool norm) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    --expected_[id];
    if (norm) --norms_pending_;
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
    if ((job != Job::kStep) && units_[id].accum == nullptr) {
      fail_locked(std::make_exception_ptr(std::invalid_argument(
          "StepScheduler: unit " + std::to_string(id) + " has no gradient accumulator")));
    }
    if ((then_step || speculative(job)) && units_[id].alt_param == nullptr) {
      fail_locked(std::make_exception_ptr(std::invalid_argument(
          "StepScheduler: unit " + std::to_string(id) + " has no second state buffers for speculative clipping")));
    }
    queue_.push_back({id, hypers_, job, scale});
    if (job == Job::kScaleStep) split_locked(std::prev(queue_.end()));  // queued so only once the norm is known
    if (then_step) queue_.push_back({id, hypers_, Job::kSpeculativeStep, 1.0f});
    if (job == Job::kSpeculativeStep) --norms_pending_;  // its copy landed: see Engine::copy
  }
  work_cv_.notify_one();
  if (job == Job::kSpeculativeStep) done_cv_.notify_all();  // wait_norms may be waiting for this landing
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

// Elements [begin, end) of a unit, as a unit of its own.
StepUnit sub_unit(const StepUnit& u, int64_t begin, int64_t end) {
  const int64_t state = u.bf16_mode ? 2 : 4;  // bytes per param / moment element
  const int64_t grad = u.bf16_mode || u.grad_type == GradType::kBF16 ? 2 : 4;
  StepUnit s = u;
  if (u.alt_param != nullptr) {
    s.alt_param = static_cast<char*>(u.alt_param) + begin * state;
    s.alt_exp_avg = static_cast<char*>(u.alt_exp_avg) + begin * state;
    s.alt_exp_avg_sq = static_cast<char*>(u.alt_exp_avg_sq) + begin * state;
  }
  s.param = static_cast<char*>(u.param) + begin * state;
  s.grad = static_cast<const char*>(u.grad) + begin * grad;
  s.exp_avg = static_cast<char*>(u.exp_avg) + begin * state;
  s.exp_avg_sq = static_cast<char*>(u.exp_avg_sq) + begin * state;
  if (u.param_out != nullptr) s.param_out = u.param_out + begin;
  if (u.accum != nullptr) s.accum = u.accum + begin;
  if (u.sr) s.sr->index += begin;
  s.numel = end - begin;
  return s;
}

// Where a step reads its state and writes the result (see StepUnit's second buffers).
enum class Flow {
  kInPlace,
  kToAlt,    // speculative: from the live state into the second buffers
  kFromAlt,  // redo, after the swap: from the state before the speculative step into the live one
};

void step_pass(const StepUnit& u, const void* grad, const uint16_t* grad_add, float scale, Flow flow,
               const AdamWHyper& h, ThreadPool& pool, Parts parts = Parts::kAll) {
  const bool to = flow == Flow::kToAlt, from = flow == Flow::kFromAlt;
  void* m_out = to ? u.alt_exp_avg : u.exp_avg;
  void* v_out = to ? u.alt_exp_avg_sq : u.exp_avg_sq;
  const void* m_in = from ? u.alt_exp_avg : u.exp_avg;
  const void* v_in = from ? u.alt_exp_avg_sq : u.exp_avg_sq;
  const void* p_in = from ? u.alt_param : u.param;
  const SimdLevel level = active_simd_level();
  void* p_out = to ? u.alt_param : u.param;
  if (u.bf16_mode) {
    adamw_bf16(Bf16Pass{static_cast<const uint16_t*>(p_in), static_cast<uint16_t*>(p_out),
                        static_cast<const uint16_t*>(grad), grad_add, static_cast<const uint16_t*>(m_in),
                        static_cast<uint16_t*>(m_out), static_cast<const uint16_t*>(v_in),
                        static_cast<uint16_t*>(v_out), scale, parts},
               u.numel, h, pool, level, u.sr);
  } else {
    adamw_fp32(Fp32Pass{static_cast<const float*>(p_in), static_cast<float*>(p_out), grad,
                        u.grad_type, grad_add, static_cast<const float*>(m_in), static_cast<float*>(m_out),
                        static_cast<const float*>(v_in), static_cast<float*>(v_out), u.param_out, scale, parts},
               u.numel, h, pool, level);
  }
}

// After a speculative step the second buffers hold the live state, and the first the state before.
void swap_state(StepUnit& u) {
  std::swap(u.exp_avg, u.alt_exp_avg);
  std::swap(u.exp_avg_sq, u.alt_exp_avg_sq);
  std::swap(u.param, u.alt_param);  // bf16: the next forward copies from the other buffer (the caller follows)
}

}  // namespace

void StepScheduler::run(const StepUnit& whole, const std::vector<GroupRange>& groups, int64_t begin, int64_t end,
                        const Queued& job) {
  const StepUnit unit = sub_unit(whole, begin, end);
  const auto* landed = static_cast<const uint16_t*>(unit.grad);
  const SimdLevel level = active_simd_level();
  const void* grad = unit.accum;
  const uint16_t* grad_add = nullptr;
  const float scale = job.job == Job::kRedo || job.job == Job::kScaleStep ? job.scale : 1.0f;
  Flow flow = Flow::kInPlace;
  switch (job.job) {
    case Job::kAccumulateFirst:
      bf16_copy(unit.accum, landed, unit.numel, *pool_);
      return;
    case Job::kAccumulate:
      bf16_accumulate(unit.accum, landed, unit.numel, false, *pool_, level);
      return;
    case Job::kAccumulateStep:  // the sum is formed inside the step: no pass of its own
      grad = landed;
      grad_add = unit.accum;
      break;
    case Job::kNorm:
    case Job::kAccumulateNorm: {
      const double sq = bf16_accumulate(unit.accum, job.job == Job::kNorm ? nullptr : landed, unit.numel, true,
                                        *pool_, level);
      std::lock_guard<std::mutex> lock(mutex_);
      sq_norms_[job.unit] = sq;
      return;
    }
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
    const StepUnit piece = sub_unit(unit, at, at + (b - a));
    step_pass(piece, static_cast<const char*>(grad) + at * grad_size, grad_add ? grad_add + at : nullptr, scale, flow,
              job.hypers[static_cast<size_t>(g.group)], *pool_, job.parts);
  }
}

void adamw_unit(const StepUnit& unit, const void* grad, const AdamWHyper& h, ThreadPool& pool, float scale) {
  step_pass(unit, grad, nullptr, scale, Flow::kInPlace, h, pool);
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
  Queued job;
  bool skip;
  StepUnit unit;
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
    unit = units_[job.unit];
    groups = groups_[job.unit];
    trace = trace_;
    delay_us = debug_step_delay_us_;
    // A norm is one sum in a fixed order; a skipped job is done at once.
    end = carries_norm(job.job) || skip ? unit.numel : std::min(unit.numel, job.begin + slice_);
    if (fail_next_ && !skip) {
      fail_next_ = false;
      failure = std::make_exception_ptr(std::runtime_error(
          "StepScheduler: injected failure while stepping unit " + std::to_string(job.unit)));
      skip = true;
    }
  }
  const auto t0 = std::chrono::steady_clock::now();
  if (!skip) {
    if (delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
    const int64_t begin_ns = TraceRecorder::now_ns();
    try {
      run(unit, groups, job.begin, end, job);
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
    if (end < unit.numel && !error_) {
      // The rest goes back at the front: this unit's later jobs stay behind it.
      job.begin = end;
      queue_.push_front(job);
      return true;
    }
    ++stepped_[job.unit];
    if (job.parts == Parts::kMoments) --trailing_[job.unit];
    if (carries_norm(job.job)) --norms_pending_;
    if (job.job == Job::kSpeculativeStep && !skip) {
      swap_state(units_[job.unit]);
      swapped_[job.unit] = !swapped_[job.unit];
    }
    if (!skip && job.parts != Parts::kMoments) ++stats_.units_stepped;
  }
  done_cv_.notify_all();
  return true;
}

std::deque<StepScheduler::Queued>::iterator StepScheduler::pick_locked() {
  // A unit someone is blocked on goes first (a forward layer, or a gradient slot about to be reused);
  // else the lowest unit id, the one the next forward needs soonest. The first queued job of the
  // chosen unit is taken, so one unit's jobs keep their order.
  // While someone waits for the norms (speculative clipping), a unit whose next job is a norm goes
  // before the others. A moments pass goes after every other unit's work, unless a job of its unit waits
  // behind it: then it ranks as that job.
  auto rank = [&](const Queued& head, const Queued* behind) {
    const Queued& q = head.parts == Parts::kMoments && behind != nullptr ? *behind : head;
    const bool trailing = q.parts == Parts::kMoments;
    // A caller waiting for the params waits for no trailing moments pass (its wait may not have returned yet).
    const bool waited = waiters_[q.unit] > 0 || (params_waiters_[q.unit] > 0 && !trailing);
    return std::make_tuple(!waited, !(norm_waiters_ > 0 && carries_norm(q.job)), trailing, q.unit);
  };
  std::vector<std::deque<Queued>::iterator> head(units_.size(), queue_.end());
  std::vector<const Queued*> behind(units_.size(), nullptr);
  for (auto it = queue_.begin(); it != queue_.end(); ++it) {
    const auto u = static_cast<size_t>(it->unit);
    if (head[u] == queue_.end()) {
      head[u] = it;  // only a unit's first queued job is a candidate
    } else if (behind[u] == nullptr) {
      behind[u] = &*it;
    }
  }
  auto best = queue_.end();
  const Queued* best_behind = nullptr;
  for (size_t u = 0; u < head.size(); ++u) {
    if (head[u] == queue_.end() || held_locked(*head[u])) continue;
    if (best == queue_.end() || rank(*head[u], behind[u]) < rank(*best, best_behind)) {
      best = head[u];
      best_behind = behind[u];
    }
  }
  return best;
}

bool StepScheduler::held_locked(const Queued& q) const {
  // On the GPU machine a speculative step that started in the gap between the last norm and the redos
  // delayed the whole redo chain, which the next forward waits on, by one step (B1 clipall, run 26). After a
  // step that clipped, every one is held from the start (hold_speculation).
  // After a failure every job is skipped at once: nothing is held.
  const bool holding = !error_ && (hold_all_speculation_ || (hold_speculation_ && norms_pending_ == 0));
  return holding && q.job == Job::kSpeculativeStep && q.begin == 0 && waiters_[q.unit] == 0 &&
         params_waiters_[q.unit] == 0;
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

bool StepScheduler::done_locked(int id, bool params_only) const {
  // A moments pass is its unit's last job until the unit's next step is announced, which comes after the
  // next forward's copy: the params are final once every job but those is done.
  return stepped_[id] + (params_only ? trailing_[id] : 0) >= expected_[id];
}

bool StepScheduler::wait_unit_locked(std::unique_lock<std::mutex>& lock, int id, bool params_only,
                                     std::chrono::milliseconds timeout) {
  rethrow_locked();
  if (done_locked(id, params_only)) return true;
  std::vector<int>& waiters = params_only ? params_waiters_ : waiters_;
  ++waiters[id];
  work_cv_.notify_all();  // a held job of this unit may run now, and its jobs go first
  const bool ended = wait_locked(lock, [&] { return done_locked(id, params_only); }, timeout);
  --waiters[id];
  rethrow_locked();
  return ended;
}

void StepScheduler::set_params_first(bool on) {
  std::lock_guard<std::mutex> lock(mutex_);
  params_first_ = on;
}

void StepScheduler::split_locked(std::deque<Queued>::iterator at) {
  if (!params_first_ || at->parts != Parts::kAll) return;
  at->parts = Parts::kParams;
  Queued moments = *at;
  moments.parts = Parts::kMoments;
  ++expected_[at->unit];
  ++trailing_[at->unit];
  queue_.insert(std::next(at), std::move(moments));
}

bool StepScheduler::has_second_buffers(int id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  check_unit_locked(id);
  return units_[id].alt_param != nullptr;
}

bool StepScheduler::swapped(int id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  check_unit_locked(id);
  return swapped_[id];
}

bool StepScheduler::ready(int id, bool params_only) const {
  std::lock_guard<std::mutex> lock(mutex_);
  check_unit_locked(id);
  return done_locked(id, params_only);
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
    if (!hold_speculation_ && !hold_all_speculation_) return;
    hold_speculation_ = false;
    hold_all_speculation_ = false;
    // One pass: a step still held when the norm did not clip is one the host had not reached in backward,
    // so it is behind, and one pass is less work than two (B2 clip, run 84: host busy the whole step).
    for (Queued& q : queue_) {
      if (q.job == Job::kSpeculativeStep && q.begin == 0) q.job = Job::kScaleStep;  // q.scale is 1
    }
  }
  work_cv_.notify_all();
}

void StepScheduler::release_holds_locked() {
  if (hold_speculation_ || hold_all_speculation_) {  // everything is to be done: nothing stays held (held jobs
    hold_speculation_ = false;                       // run as they are)
    hold_all_speculation_ = false;
    work_cv_.notify_all();
  }
}

bool StepScheduler::wait_all(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  release_holds_locked();
  const bool ended = wait_locked(lock, [&] {
    for (int i = 0; i < static_cast<int>(units_.size()); ++i) {
      if (!done_locked(i, false)) return false;
    }
    return true;
  }, timeout);
  rethrow_locked();
  return ended;
}

bool StepScheduler::drain(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  release_holds_locked();
  return done_cv_.wait_for(lock, timeout, [&] { return queue_.empty() && running_ == 0; });
}

void StepScheduler::check() {
  std::lock_guard<std::mutex> lock(mutex_);
  rethrow_locked();
}

void StepScheduler::hold_speculation() {
  std::lock_guard<std::mutex> lock(mutex_);
  hold_all_speculation_ = true;
}

bool StepScheduler::wait_norms(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mutex_);
  hold_speculation_ = true;
  ++norm_waiters_;
  work_cv_.notify_all();  // norms go first from now on
  const bool ended = wait_locked(lock, [&] { return norms_pending_ == 0; }, timeout);
  --norm_waiters_;
  rethrow_locked();
  return ended;
}

std::deque<StepScheduler::Queued>::iterator StepScheduler::unstarted_speculation_locked(int id) {
  for (auto it = queue_.rbegin(); it != queue_.rend(); ++it) {
    if (it->unit != id) continue;
    const bool unstarted = it->job == Job::kSpeculativeStep && it->begin == 0;
    return unstarted ? std::prev(it.base()) : queue_.end();
  }
  return queue_.end();
}

void StepScheduler::redo(int id, float scale) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    check_unit_locked(id);
    const auto it = unstarted_speculation_locked(id);
    if (it != queue_.end()) {  // not started: step once, clipped, in place
      it->job = Job::kScaleStep;
      it->scale = scale;
      split_locked(it);
      return;
    }
    ++expected_[id];
    queue_.push_back({id, hypers_, Job::kRedo, scale});
    split_locked(std::prev(queue_.end()));
  }
  work_cv_.notify_one();
}

void StepScheduler::take_over(int id) {
  std::unique_lock<std::mutex> lock(mutex_);
  check_unit_locked(id);
  if (units_[id].alt_param == nullptr) {
    throw std::invalid_argument("StepScheduler: unit " + std::to_string(id) +
                                " has no second buffers: only a speculative step can be taken over");
  }
  const auto it = unstarted_speculation_locked(id);
  if (it != queue_.end()) {
    queue_.erase(it);
    ++stepped_[id];
    swap_state(units_[id]);
    swapped_[id] = !swapped_[id];
    done_cv_.notify_all();
  }
  // A started speculative step: a host job, which ends (or fails, which ends the wait too).
  while (!wait_unit_locked(lock, id, false, std::chrono::hours(1))) {
  }
}

double StepScheduler::sq_norm(int id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  check_unit_locked(id);
  return sq_norms_[id];
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
