// TraceRecorder: events appended under a lock; the clock is std::chrono::steady_clock.
#include "trace.h"

#include <chrono>
#include <utility>

namespace offload_ext {

int64_t TraceRecorder::now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void TraceRecorder::record(std::string lane, std::string name, int64_t begin_ns, int64_t end_ns, int unit) {
  if (!enabled()) return;
  std::lock_guard<std::mutex> lock(mutex_);
  events_.push_back({std::move(lane), std::move(name), begin_ns, end_ns, unit});
}

std::vector<TraceEvent> TraceRecorder::take() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<TraceEvent> out;
  out.swap(events_);
  return out;
}

}  // namespace offload_ext
