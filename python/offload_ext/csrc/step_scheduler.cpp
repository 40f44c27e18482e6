// StepScheduler: one scheduling thread takes units in the order their gradients landed and runs
// each unit's fused AdamW across the pool (the scheduling thread works as one of the pool's threads).
#include "step_scheduler.h"

#include <chrono>
#include <stdexcept>
#include <string>

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

int StepScheduler::add_unit(const StepUnit& unit) {
  std::lock_guard<std::mutex> lock(mutex_);
  units_.push_back(unit);
  expected_.push_back(0);
  stepped_.push_back(0);
  return static_cast<int>(units_.size()) - 1;
}

void StepScheduler::set_hyper(const AdamWHyper& h) {
  std::lock_guard<std::mutex> lock(mutex_);
  hyper_ = h;
}

void StepScheduler::expect(int id) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (id < 0 || id >= static_cast<int>(units_.size())) throw std::out_of_range("StepScheduler: no unit " + std::to_string(id));
  ++expected_[id];
}

void StepScheduler::notify(int id) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (id < 0 || id >= static_cast<int>(units_.size())) {
      if (!error_) {
        error_ = std::make_exception_ptr(std::out_of_range("StepScheduler: no unit " + std::to_string(id)));
      }
      return;
    }
    queue_.emplace_back(id, hyper_);
  }
  work_cv_.notify_one();
}

void StepScheduler::loop() {
  for (;;) {
    std::pair<int, AdamWHyper> job;
    bool skip;
    StepUnit unit;
    std::exception_ptr failure;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      work_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      job = queue_.front();
      queue_.pop_front();
      skip = static_cast<bool>(error_);  // after a failure, state is suspect: stop stepping
      unit = units_[job.first];
      if (fail_next_ && !skip) {
        fail_next_ = false;
        failure = std::make_exception_ptr(std::runtime_error(
            "StepScheduler: injected failure while stepping unit " + std::to_string(job.first)));
        skip = true;
      }
    }
    const auto t0 = std::chrono::steady_clock::now();
    if (!skip) {
      try {
        const SimdLevel level = active_simd_level();
        if (unit.bf16_mode) {
          adamw_bf16(static_cast<uint16_t*>(unit.param), static_cast<const uint16_t*>(unit.grad),
                     static_cast<uint16_t*>(unit.exp_avg), static_cast<uint16_t*>(unit.exp_avg_sq), unit.numel,
                     job.second, *pool_, level);
        } else {
          adamw_fp32(static_cast<float*>(unit.param), unit.grad, unit.grad_type, static_cast<float*>(unit.exp_avg),
                     static_cast<float*>(unit.exp_avg_sq), unit.param_out, unit.numel, job.second, *pool_, level);
        }
      } catch (...) {
        failure = std::current_exception();
      }
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (failure && !error_) error_ = failure;
      ++stepped_[job.first];
      if (!skip) {
        stats_.busy_seconds += seconds;
        ++stats_.units_stepped;
      }
    }
    done_cv_.notify_all();
  }
}

void StepScheduler::rethrow_locked() {
  if (error_) {
    std::exception_ptr e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
}

void StepScheduler::wait(int id) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (id < 0 || id >= static_cast<int>(units_.size())) throw std::out_of_range("StepScheduler: no unit " + std::to_string(id));
  done_cv_.wait(lock, [&] { return stepped_[id] >= expected_[id]; });
  rethrow_locked();
}

void StepScheduler::wait_all() {
  std::unique_lock<std::mutex> lock(mutex_);
  done_cv_.wait(lock, [&] {
    for (size_t i = 0; i < units_.size(); ++i) {
      if (stepped_[i] < expected_[i]) return false;
    }
    return true;
  });
  rethrow_locked();
}

void StepScheduler::check() {
  std::lock_guard<std::mutex> lock(mutex_);
  rethrow_locked();
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
