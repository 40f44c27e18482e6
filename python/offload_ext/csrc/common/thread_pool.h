// ThreadPool: the library's own persistent worker threads, so the AdamW kernels neither
// oversubscribe against torch's OpenMP pool nor pay thread start-up per call.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace offload_ext {

class ThreadPool {
 public:
  // `num_threads` counts the calling thread, which works too: a pool of 1 has no workers.
  // `cpus`, when not empty, pins worker k to cpus[k % cpus.size()].
  // `nice` (0-19), when above 0, is the workers' niceness: a thread of normal priority that wakes on a CPU
  // they hold (the one launching GPU work, the CUDA driver's callbacks) takes it from them at once.
  // Throws std::runtime_error, with every worker already started joined again, when a thread cannot start
  // (a container's thread limit).
  explicit ThreadPool(int num_threads, std::vector<int> cpus = {}, int nice = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }
  bool pinned() const { return !cpus_.empty(); }
  int nice() const { return nice_; }
  // Gives the calling thread the workers' niceness (for a thread that calls parallel_for and works as one).
  void lower_calling_thread() const;

  // Runs fn(task) for every task in [0, num_tasks) on the workers and the caller, returns when
  // all are done, and rethrows the first exception any task raised. One loop runs at a time.
  void parallel_for(int64_t num_tasks, const std::function<void(int64_t)>& fn);

 private:
  void worker_main(int index);
  void run_tasks();
  void stop_workers();  // wakes every worker to return and joins it

  std::vector<std::thread> workers_;
  std::vector<int> cpus_;
  const int nice_;
  std::mutex run_mutex_;  // serialises parallel_for callers

  std::mutex mutex_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  uint64_t generation_ = 0;
  bool stopping_ = false;
  int busy_workers_ = 0;
  const std::function<void(int64_t)>* job_ = nullptr;
  int64_t num_tasks_ = 0;
  std::atomic<int64_t> next_task_{0};
  std::exception_ptr error_;
  std::exception_ptr start_error_;  // a worker that could not take its niceness: every parallel_for raises it
};

// Testing aid: from now on, every pool created fails to start its worker `started` (0-based) as under a
// thread limit (-1: off).
void set_thread_start_failure(int started);

// Usable CPUs of this process (its affinity mask), in order.
std::vector<int> allowed_cpus();

// Default of the global pool (adamw_step, CPUAdamW): every usable CPU, since a standalone optimizer has no
// GPU-driving thread to leave a core for. The Offloader's engine pool has its own, smaller default.
int default_num_threads();

// CPUs for the workers of a pinned pool of num_threads: the highest-numbered usable CPUs, so the
// lowest (where the process's main thread usually runs) stays free.
std::vector<int> worker_cpus(int num_threads);

// The shared pool the kernels use. Replacing it never disturbs a loop already running:
// callers hold a shared_ptr for the duration of their loop.
std::shared_ptr<ThreadPool> global_pool();
// pin: place workers on the highest-numbered usable CPUs, leaving the lowest (where the
// process's main thread usually runs) free.
void set_global_pool(int num_threads, bool pin);

}  // namespace offload_ext
