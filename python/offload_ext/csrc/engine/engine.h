// Engine: the offload engine behind the Python Engine class; owns the pinned and host pools, the copy
// streams and the step scheduler, and checks everything that crosses in from Python.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "copy_engine.h"
#include "pinned_pool.h"
#include "step_scheduler.h"
#include "trace.h"

namespace offload_ext {

class Engine {
 public:
  // device < 0: the simulated device (CPU tensors on both sides of a copy); else a CUDA device index.
  // host_nice (0-19): the host-step threads' niceness; above 0 they give their CPU up at once to the threads
  // that launch GPU work and run the driver's callbacks.
  Engine(int device, int num_threads, bool pin_threads, int64_t slab_bytes, int host_nice = 0);
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Flat CPU tensors over pool blocks; a block goes back to its pool when the last tensor on it dies.
  at::Tensor pinned_empty(int64_t numel, at::ScalarType dtype);
  at::Tensor host_empty(int64_t numel, at::ScalarType dtype);
  at::Tensor host_zeros(int64_t numel, at::ScalarType dtype);
  void reserve_pinned(int64_t bytes);
  void reserve_pinned_blocks(const std::vector<int64_t>& blocks);
  // The pageable pool's counterpart: slabs holding exactly these blocks, faulted in on set-up threads.
  void reserve_host_blocks(const std::vector<int64_t>& blocks);
  // Once its owner is done with the pools (an Offloader closing, its state dropped): waits for the copies,
  // then unmaps every slab of both pools that holds no live block. Returns the bytes given back.
  int64_t release_free_memory();
  PinnedStats pinned_stats() const { return pinned_->stats(); }
  PinnedStats host_stats() const { return host_->stats(); }

  // Enqueues a copy on the `dir` stream. With notify_unit >= 0, `job` of that unit is queued once the
  // copy lands, and waits on the unit cover it from now on. Throws (and expects nothing) when the copy
  // cannot be enqueued.
  // `trace_unit` names the unit on the timeline (default: notify_unit). `then_step`: after the norm job,
  // queue the unit's speculative step (SPECULATIVE_STEP) too. `after_event`: see CopyEngine::copy (ignored on the
  // simulated device, whose compute is the calling thread).
  std::shared_ptr<Event> copy(Direction dir, const at::Tensor& dst, const at::Tensor& src, int notify_unit, Job job,
                              int trace_unit, bool then_step, uintptr_t after_event = 0);
  void compute_wait(const std::shared_ptr<Event>& e);
  // Waits for both copy streams; a stream's failure leaves the engine failed and is raised.
  void synchronize();

  int add_unit(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
               const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& param_out,
               const std::optional<at::Tensor>& accum, const std::vector<std::tuple<int, int64_t, int64_t>>& groups,
               const std::vector<at::Tensor>& alt, const std::optional<int64_t>& sr_seed, int64_t sr_stream,
               const std::vector<at::Tensor>& eight_bit);
  // Hyperparameters of parameter group `group` for the units notified from now on.
  void set_hyper(double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step, int group);
  // Queues a step of `unit` whose gradients are already in place.
  void notify(int unit);
  // Queues NORM or SCALE_STEP on a unit whose gradients are accumulated on the host (clipping).
  void run(int unit, Job job, float scale);
  double sq_norm(int unit) const { return scheduler_->sq_norm(unit); }
  // Speculative clipping: wait for every queued norm; redo a unit's speculative step, clipped.
  void wait_norms();
  void release_speculation() { scheduler_->release_speculation(); }
  void hold_speculation() { scheduler_->hold_speculation(); }
  void redo(int unit, float scale);
  // The unit's clipped redo happens on the device: see StepScheduler::take_over.
  void take_over(int unit);
  // Blocks until `unit`'s announced jobs are done (`params_only`: but a trailing moments pass, see
  // StepScheduler::set_params_first); on the timeline (lane "wait") as `reason` when it blocked.
  void wait_unit(int unit, const std::string& reason, bool params_only = false);
  void wait_all();
  // Shuts the work down, whatever failed before: checks and synchronizes the copy streams first (a
  // device fault there means no copy in flight lands), then waits for the host jobs already queued
  // (after a failure they are skipped at once). Never raises; returns the engine's first error, or "".
  std::string close();
  bool ready(int unit, bool params_only = false) const { return scheduler_->ready(unit, params_only); }
  void set_params_first(bool on) { scheduler_->set_params_first(on); }
  bool swapped(int unit) const { return scheduler_->swapped(unit); }
  // Raises the engine's failure (a host step's, a copy stream's, a callback's), if any, without waiting.
  void check();
  // The caller found the step broken (a non-finite norm): the engine fails with `why` as a host step's failure
  // would; nothing queued runs, every later call raises it.
  void fail(const std::string& why);
  // Called between the polls of every wait (the bindings check Python's signals there: Ctrl-C); may throw.
  void set_interrupt_check(std::function<void()> check) { interrupt_check_ = std::move(check); }
  void set_slice_elements(int64_t n) { scheduler_->set_slice_elements(n); }
  SchedulerStats scheduler_stats() const { return scheduler_->stats(); }
  int num_threads() const { return scheduler_->pool()->num_threads(); }
  int host_nice() const { return scheduler_->pool()->nice(); }
  bool threads_pinned() const { return scheduler_->pool()->pinned(); }

  // The timeline: recording from start_trace() until stop_trace(), which returns the events.
  void start_trace();
  std::vector<TraceEvent> stop_trace();

  // Testing aids.
  void inject_failure() { scheduler_->inject_failure(); }
  void fail_next_copy() { copies_->fail_next_copy(); }
  void fault_next_copy() { copies_->fault_next_copy(); }
  void set_debug_step_delay_us(int us) { scheduler_->set_debug_step_delay_us(us); }
  void set_debug_delay_us(int max_us) { copies_->set_debug_delay_us(max_us); }

 private:
  uintptr_t compute_stream() const;
  // add_unit's checks of an 8-bit unit (`eight_bit`: its absmaxes and the maps' codes, which it keeps in codes_).
  StepUnit eight_bit_unit(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                          const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& param_out,
                          std::vector<GroupRange> ranges, const std::vector<at::Tensor>& eight_bit);
  // Calls wait_for(timeout) (true: done) until done; between the calls a copy stream's failure is raised
  // (and kept: the engine stays failed), and interrupt_check_ runs. Copies land through host callbacks that
  // CUDA never runs after a device fault: without the checks a wait for them would never end.
  void poll(const std::function<bool(std::chrono::milliseconds)>& wait_for);
  void check_copies();
  // Bytes of `numel` elements of `dtype` for a pool block; throws naming `who` when negative or overflowing.
  static size_t block_bytes(const char* who, int64_t numel, at::ScalarType dtype);
  std::function<void()> interrupt_check_;

  const int device_;
  // Where the next buffer starts past its page boundary, in turns (see next_offset()).
  size_t next_offset();
  std::atomic<unsigned> buffers_{0};
  std::shared_ptr<PinnedPool> pinned_;
  std::shared_ptr<PinnedPool> host_;
  std::shared_ptr<StepScheduler> scheduler_;
  std::shared_ptr<TraceRecorder> trace_;
  std::deque<std::vector<float>> codes_;  // each 8-bit unit's maps (a deque: its units keep pointers into it)
  std::shared_ptr<CopyEngine> copies_;  // last: destroyed first, draining copies into the pools above
};

}  // namespace offload_ext
