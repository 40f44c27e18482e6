// ThreadPool implementation and the process-wide pool the kernels share.
#include "thread_pool.h"

#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>
#include <system_error>

namespace offload_ext {

namespace {
std::atomic<int> g_failing_start{-1};  // see set_thread_start_failure()
}  // namespace

void set_thread_start_failure(int started) { g_failing_start.store(started); }

ThreadPool::ThreadPool(int num_threads, std::vector<int> cpus, int nice) : cpus_(std::move(cpus)), nice_(nice) {
  if (num_threads < 1) {
    throw std::invalid_argument("ThreadPool: num_threads must be >= 1, got " + std::to_string(num_threads));
  }
  if (nice < 0 || nice > 19) {
    throw std::invalid_argument("ThreadPool: nice must be in [0, 19] (0: the process's own priority), got " +
                                std::to_string(nice));
  }
  workers_.reserve(num_threads - 1);
  for (int i = 0; i < num_threads - 1; ++i) {
    try {
      if (i == g_failing_start.load()) throw std::system_error(EAGAIN, std::generic_category(), "injected");
      workers_.emplace_back([this, i] { worker_main(i); });
    } catch (const std::system_error& e) {
      // The destructor does not run for a constructor that throws: the workers started must be joined
      // here, or destroying them (joinable) ends the process and the condition variable's waiters hang.
      stop_workers();
      throw std::runtime_error("ThreadPool: could not start worker thread " + std::to_string(i + 1) + " of " +
                               std::to_string(num_threads - 1) + " (" + e.what() +
                               "): the process is out of threads (a container's pids limit, ulimit -u) or memory; "
                               "ask for fewer threads (num_threads=)");
    }
  }
}

ThreadPool::~ThreadPool() { stop_workers(); }

void ThreadPool::stop_workers() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
  workers_.clear();
}

void ThreadPool::run_tasks() {
  for (;;) {
    const int64_t task = next_task_.fetch_add(1, std::memory_order_relaxed);
    if (task >= num_tasks_) return;
    try {
      (*job_)(task);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!error_) error_ = std::current_exception();
    }
  }
}

namespace {

// Sets the calling thread's niceness (Linux keeps one per thread); throws naming the value on failure.
void set_thread_nice(int nice) {
  if (setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), nice) != 0) {
    throw std::runtime_error("ThreadPool: could not set a thread's niceness to " + std::to_string(nice) + ": " +
                             std::strerror(errno));
  }
}

}  // namespace

void ThreadPool::lower_calling_thread() const {
  if (nice_ > 0) set_thread_nice(nice_);
}

void ThreadPool::worker_main(int index) {
  pthread_setname_np(pthread_self(), "offload-step");  // what /proc and a profiler show for the engine's threads
  if (!cpus_.empty()) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpus_[index % cpus_.size()], &set);
    pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
  }
  try {
    lower_calling_thread();
  } catch (...) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!start_error_) start_error_ = std::current_exception();
  }
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      work_cv_.wait(lock, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
    }
    run_tasks();
    std::lock_guard<std::mutex> lock(mutex_);
    if (--busy_workers_ == 0) done_cv_.notify_one();
  }
}

void ThreadPool::parallel_for(int64_t num_tasks, const std::function<void(int64_t)>& fn) {
  if (num_tasks <= 0) return;
  std::lock_guard<std::mutex> run_lock(run_mutex_);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (start_error_) std::rethrow_exception(start_error_);
  }
  if (workers_.empty() || num_tasks == 1) {
    for (int64_t t = 0; t < num_tasks; ++t) fn(t);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    job_ = &fn;
    num_tasks_ = num_tasks;
    next_task_.store(0, std::memory_order_relaxed);
    busy_workers_ = static_cast<int>(workers_.size());
    error_ = nullptr;
    ++generation_;
  }
  work_cv_.notify_all();
  run_tasks();
  std::exception_ptr error;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    done_cv_.wait(lock, [&] { return busy_workers_ == 0; });
    job_ = nullptr;
    error = error_;
    error_ = nullptr;
  }
  if (error) std::rethrow_exception(error);
}

std::vector<int> allowed_cpus() {
  std::vector<int> cpus;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &set)) cpus.push_back(c);
    }
  }
  if (cpus.empty()) {
    const unsigned n = std::max(1u, std::thread::hardware_concurrency());
    for (unsigned c = 0; c < n; ++c) cpus.push_back(static_cast<int>(c));
  }
  return cpus;
}

int default_num_threads() { return static_cast<int>(allowed_cpus().size()); }

namespace {
std::mutex g_pool_mutex;
std::shared_ptr<ThreadPool> g_pool;  // guarded by g_pool_mutex
}  // namespace

std::shared_ptr<ThreadPool> global_pool() {
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  if (!g_pool) g_pool = std::make_shared<ThreadPool>(default_num_threads());
  return g_pool;
}

std::vector<int> worker_cpus(int num_threads) {
  const std::vector<int> all = allowed_cpus();
  const int take = std::min<int>(num_threads - 1, static_cast<int>(all.size()) - 1);
  std::vector<int> cpus;
  for (int i = 0; i < take; ++i) cpus.push_back(all[all.size() - 1 - i]);
  return cpus;
}

void set_global_pool(int num_threads, bool pin) {
  if (num_threads < 1) {
    throw std::invalid_argument("set_num_threads: expected a thread count >= 1, got " + std::to_string(num_threads));
  }
  auto pool = std::make_shared<ThreadPool>(num_threads, pin ? worker_cpus(num_threads) : std::vector<int>{});
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  g_pool = std::move(pool);
}

}  // namespace offload_ext
