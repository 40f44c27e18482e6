// CopyEngine: the H2D and D2H "streams" of the offload engine, one copy per layer per direction,
// with completion events from a pool and host callbacks when a copy lands. Two implementations:
// CUDA streams (cudaMemcpyAsync, cudaEvent, cudaLaunchHostFunc) and, for the simulated device,
// one worker thread per direction doing memcpy with real completion signals.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>

namespace offload_ext {

enum class Direction { kH2D = 0, kD2H = 1 };

// Completion of one enqueued operation. Destroying it never blocks or cancels the operation.
class Event {
 public:
  virtual ~Event() = default;
  virtual void synchronize() = 0;  // block the calling thread until it has landed
};

class CopyEngine {
 public:
  using Callback = std::function<void()>;
  virtual ~CopyEngine() = default;

  // Copies `bytes` from src to dst on the stream of `dir`. It starts after everything already on
  // that stream and after all work enqueued so far on the compute stream `compute` (the CUDA stream
  // handle; ignored on the simulated device, whose compute is the calling thread). `on_done` (may be
  // empty) runs on an engine thread once the copy has landed; it must not call back into CUDA or Python.
  // When copy() throws, on_done never runs: the caller may undo what it did in on_done's name.
  // `after` (a cudaEvent_t, 0: none) replaces the compute stream's point now by an earlier one the caller
  // recorded: a copy wanted then but issued only now (its source was still being written) need not wait
  // for the compute enqueued since.
  virtual std::shared_ptr<Event> copy(Direction dir, void* dst, const void* src, size_t bytes, uintptr_t compute,
                                      Callback on_done, uintptr_t after = 0) = 0;
  // Make the compute stream wait for `e` (the simulated device blocks the caller instead).
  virtual void compute_wait(const Event& e, uintptr_t compute) = 0;
  // Wait for everything enqueued on both copy streams.
  // Throws when a stream has failed, as after a device fault (CUDA then runs no host callback, so no copy in
  // flight ever lands), or when a copy's callback threw; never blocks.
  virtual void check() = 0;
  virtual void synchronize() = 0;
  // Testing aid (simulated device only): the next copy faults on its stream as a device error would: it never
  // lands, no callback runs on that stream again, and check() reports the fault from then on.
  void fault_next_copy() { fault_next_.store(true); }
  // Testing aid: before each copy, stall its stream for a random 0..max_us microseconds (0 = off).
  void set_debug_delay_us(int max_us) { delay_us_.store(max_us); }
  // Testing aid: the next copy() throws before it enqueues anything, as a failing cudaMemcpyAsync would.
  void fail_next_copy() { fail_next_.store(true); }

 protected:
  // Called by copy() before it enqueues anything: throws the injected failure, once.
  void throw_if_failure_injected();
  bool take_fault_injection() { return fault_next_.exchange(false); }
  // Runs on_done on a copy or driver thread: an exception it throws is kept for check(), never the end of
  // the process.
  void run_callback(const Callback& on_done) noexcept;
  void rethrow_callback_error();
  std::atomic<int> delay_us_{0};

 private:
  std::atomic<bool> fail_next_{false};
  std::atomic<bool> fault_next_{false};
  std::mutex error_mutex_;
  std::exception_ptr callback_error_;  // guarded by error_mutex_
};

// device < 0: the simulated device. Otherwise a CUDA device index (needs the CUDA build).
std::shared_ptr<CopyEngine> make_copy_engine(int device);

}  // namespace offload_ext
