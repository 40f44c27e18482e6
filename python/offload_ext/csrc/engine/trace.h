// TraceRecorder: a timeline of the engine's work (copies, host step slices, waits), kept only while
// enabled, on the steady clock (CLOCK_MONOTONIC: Python's time.monotonic_ns() reads the same one).
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace offload_ext {

struct TraceEvent {
  std::string lane;   // "H2D", "D2H", "host step", "wait"
  std::string name;
  int64_t begin_ns;
  int64_t end_ns;
  int unit;           // -1: none
};

class TraceRecorder {
 public:
  static int64_t now_ns();
  void set_enabled(bool on) { enabled_.store(on, std::memory_order_relaxed); }
  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }
  // Safe from any thread (a CUDA host callback included); a no-op while disabled.
  void record(std::string lane, std::string name, int64_t begin_ns, int64_t end_ns, int unit);
  // The events recorded so far, in recording order; the recorder starts empty again.
  std::vector<TraceEvent> take();

 private:
  std::atomic<bool> enabled_{false};
  std::mutex mutex_;
  std::vector<TraceEvent> events_;  // guarded by mutex_
};

}  // namespace offload_ext
