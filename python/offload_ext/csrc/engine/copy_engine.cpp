// CopyEngine implementations: CUDA streams with an event pool, and the simulated device's
// memcpy threads.
#include "copy_engine.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#ifdef OFFLOAD_EXT_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace offload_ext {

namespace {

int random_delay_us(int max_us) {
  if (max_us <= 0) return 0;
  thread_local std::mt19937 rng(std::random_device{}());
  return std::uniform_int_distribution<int>(0, max_us)(rng);
}

// ---------------------------------------------------------------- simulated device

class HostEvent final : public Event {
 public:
  void synchronize() override {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return done_; });
    if (!fault_.empty()) throw std::runtime_error(fault_);
  }
  void set() { finish({}); }
  // Its stream failed: it never lands, and waiting for it raises `fault`.
  void fail(const std::string& fault) { finish(fault); }

 private:
  void finish(const std::string& fault) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
      fault_ = fault;
    }
    cv_.notify_all();
  }
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::string fault_;
};

// One thread per direction, running its queue in order like a stream.
class HostStream {
 public:
  struct Job {
    void* dst;
    const void* src;
    size_t bytes;
    std::shared_ptr<HostEvent> done;
    CopyEngine::Callback on_done;
    bool fault = false;  // fault_next_copy: this copy is where the simulated device fails
  };

  HostStream(std::atomic<int>& delay_us, std::function<void(const CopyEngine::Callback&)> run_callback,
             const char* name)
      : delay_us_(delay_us), run_callback_(std::move(run_callback)), name_(name), thread_([this] { loop(); }) {}
  ~HostStream() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  // Queues `job` and makes it the one synchronize() waits for. Nothing changes if it throws, so a
  // failed push can neither run the job's callback nor leave synchronize() waiting for it.
  void push(Job job) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!fault_.empty()) throw std::runtime_error(fault_);  // as every CUDA call after a device fault
      jobs_.push_back(std::move(job));
      last_ = jobs_.back().done;
    }
    cv_.notify_all();
  }
  std::shared_ptr<HostEvent> last() {
    std::lock_guard<std::mutex> lock(mutex_);
    return last_;
  }
  std::string fault() {
    std::lock_guard<std::mutex> lock(mutex_);
    return fault_;
  }

 private:
  void loop() {
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
        if (jobs_.empty()) return;  // stopping, queue drained
        job = std::move(jobs_.front());
        jobs_.pop_front();
        if (job.fault) {
          fail_locked(job);
          continue;
        }
      }
      if (const int us = random_delay_us(delay_us_.load())) std::this_thread::sleep_for(std::chrono::microseconds(us));
      if (job.bytes) std::memcpy(job.dst, job.src, job.bytes);
      if (job.on_done) run_callback_(job.on_done);
      job.done->set();
    }
  }

  // A device fault, as CUDA has it: this copy and every one queued behind it never land, and no callback
  // runs; requires mutex_.
  void fail_locked(Job& job) {
    fault_ = std::string("CopyEngine: the simulated device faulted on the ") + name_ +
             " copy stream (fault_next_copy): the copies in flight never land";
    job.done->fail(fault_);
    for (Job& queued : jobs_) queued.done->fail(fault_);
    jobs_.clear();
  }

  std::atomic<int>& delay_us_;
  const std::function<void(const CopyEngine::Callback&)> run_callback_;
  const char* const name_;
  std::string fault_;  // guarded by mutex_; set once the stream faulted
  std::condition_variable cv_;
  std::mutex mutex_;
  std::deque<Job> jobs_;
  std::shared_ptr<HostEvent> last_;
  bool stopping_ = false;
  std::thread thread_;  // last: starts after the members it uses exist
};

class HostCopyEngine final : public CopyEngine {
 public:
  HostCopyEngine() {
    auto run = [this](const Callback& cb) { run_callback(cb); };
    streams_[0] = std::make_unique<HostStream>(delay_us_, run, "H2D");
    streams_[1] = std::make_unique<HostStream>(delay_us_, run, "D2H");
  }
  std::shared_ptr<Event> copy(Direction dir, void* dst, const void* src, size_t bytes, uintptr_t /*compute*/,
                              Callback on_done, uintptr_t /*after*/) override {
    throw_if_failure_injected();
    auto done = std::make_shared<HostEvent>();
    streams_[static_cast<int>(dir)]->push({dst, src, bytes, done, std::move(on_done), take_fault_injection()});
    return done;
  }
  void compute_wait(const Event& e, uintptr_t) override { const_cast<Event&>(e).synchronize(); }
  void check() override {
    rethrow_callback_error();
    for (auto& s : streams_) {
      const std::string fault = s->fault();
      if (!fault.empty()) throw std::runtime_error(fault);
    }
  }
  void synchronize() override {
    for (auto& s : streams_) {
      if (auto last = s->last()) last->synchronize();
    }
  }

 private:
  std::unique_ptr<HostStream> streams_[2];
};

// ---------------------------------------------------------------- CUDA

#ifdef OFFLOAD_EXT_WITH_CUDA

void cuda_check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string("CopyEngine: ") + what + ": " + cudaGetErrorString(err));
}

// Restores the calling thread's current device on scope exit.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cuda_check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) cuda_check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }

 private:
  int previous_ = 0;
};

class EventPool {
 public:
  explicit EventPool(int device) : device_(device) {}
  ~EventPool() {
    for (cudaEvent_t e : free_) cudaEventDestroy(e);
  }
  cudaEvent_t get() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!free_.empty()) {
        cudaEvent_t e = free_.back();
        free_.pop_back();
        return e;
      }
    }
    DeviceGuard guard(device_);
    cudaEvent_t e;
    cuda_check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
    return e;
  }
  void put(cudaEvent_t e) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_.push_back(e);
  }

 private:
  const int device_;
  std::mutex mutex_;
  std::vector<cudaEvent_t> free_;
};

class CudaEvent final : public Event {
 public:
  CudaEvent(std::shared_ptr<EventPool> pool, cudaStream_t stream) : pool_(std::move(pool)), event_(pool_->get()) {
    cuda_check(cudaEventRecord(event_, stream), "cudaEventRecord");
  }
  ~CudaEvent() override { pool_->put(event_); }  // re-recording later never affects earlier waits
  void synchronize() override { cuda_check(cudaEventSynchronize(event_), "cudaEventSynchronize"); }
  cudaEvent_t get() const { return event_; }

 private:
  std::shared_ptr<EventPool> pool_;
  cudaEvent_t event_;
};

// What a host callback runs: the copy engine's guard around the caller's callback.
struct HostCallback {
  CopyEngine::Callback on_done;
  std::function<void(const CopyEngine::Callback&)> run;
};

void CUDART_CB run_host_callback(void* payload) {
  std::unique_ptr<HostCallback> cb(static_cast<HostCallback*>(payload));
  cb->run(cb->on_done);  // noexcept: an exception is kept for check()
}

void CUDART_CB sleep_host_callback(void* payload) {
  std::this_thread::sleep_for(std::chrono::microseconds(reinterpret_cast<uintptr_t>(payload)));
}

class CudaCopyEngine final : public CopyEngine {
 public:
  explicit CudaCopyEngine(int device) : device_(device), events_(std::make_shared<EventPool>(device)) {
    DeviceGuard guard(device_);
    // The weight and gradient copies get the device's highest stream priority: side streams that share the
    // copy engines (activation offload, clipped redos on the device) are created at the lowest.
    int least = 0, greatest = 0;
    cuda_check(cudaDeviceGetStreamPriorityRange(&least, &greatest), "cudaDeviceGetStreamPriorityRange");
    for (auto& s : streams_) {
      cuda_check(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, greatest), "cudaStreamCreateWithPriority");
    }
  }
  ~CudaCopyEngine() override {
    for (auto& s : streams_) {
      cudaStreamSynchronize(s);
      cudaStreamDestroy(s);
    }
  }

  std::shared_ptr<Event> copy(Direction dir, void* dst, const void* src, size_t bytes, uintptr_t compute,
                              Callback on_done, uintptr_t after) override {
    DeviceGuard guard(device_);
    throw_if_failure_injected();
    if (take_fault_injection()) {
      throw std::invalid_argument("CopyEngine: fault_next_copy simulates a device fault on the simulated device only "
                                  "(device='cpu'); on CUDA inject a real one (a device-side assert)");
    }
    cudaStream_t s = streams_[static_cast<int>(dir)];
    if (after != 0) {
      cuda_check(cudaStreamWaitEvent(s, reinterpret_cast<cudaEvent_t>(after), 0), "cudaStreamWaitEvent");
    } else {
      CudaEvent marker(events_, reinterpret_cast<cudaStream_t>(compute));
      cuda_check(cudaStreamWaitEvent(s, marker.get(), 0), "cudaStreamWaitEvent");
    }
    if (const int us = random_delay_us(delay_us_.load())) {
      cuda_check(cudaLaunchHostFunc(s, sleep_host_callback, reinterpret_cast<void*>(static_cast<uintptr_t>(us))),
                 "cudaLaunchHostFunc");
    }
    const cudaMemcpyKind kind = dir == Direction::kH2D ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost;
    if (bytes) cuda_check(cudaMemcpyAsync(dst, src, bytes, kind, s), "cudaMemcpyAsync");
    auto landed = std::make_shared<CudaEvent>(events_, s);
    // The callback goes last: once it is enqueued nothing here can throw, so a copy() that throws never
    // runs on_done (see the header). The event before it marks the copy, not the callback, as done.
    if (on_done) {
      auto payload = std::make_unique<HostCallback>(
          HostCallback{std::move(on_done), [this](const Callback& cb) { run_callback(cb); }});
      cuda_check(cudaLaunchHostFunc(s, run_host_callback, payload.get()), "cudaLaunchHostFunc");
      payload.release();  // owned by run_host_callback from here
    }
    return landed;
  }

  void compute_wait(const Event& e, uintptr_t compute) override {
    DeviceGuard guard(device_);
    cuda_check(cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(compute), static_cast<const CudaEvent&>(e).get(), 0),
               "cudaStreamWaitEvent");
  }
  void synchronize() override {
    check();  // a stream that failed never finishes its host callbacks
    for (auto& s : streams_) cuda_check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  }
  void check() override {
    rethrow_callback_error();
    const char* names[] = {"H2D", "D2H"};
    for (int k = 0; k < 2; ++k) {
      const cudaError_t err = cudaStreamQuery(streams_[k]);
      if (err == cudaSuccess || err == cudaErrorNotReady) continue;
      // After a device fault CUDA runs no host callback again: the copies in flight never land.
      throw std::runtime_error(std::string("CopyEngine: the device reported ") + cudaGetErrorName(err) + " (" +
                               cudaGetErrorString(err) + ") on the " + names[k] +
                               " copy stream: the copies in flight never land and the CUDA context is unusable; "
                               "close() the Offloader and restart the process");
    }
  }

 private:
  const int device_;
  std::shared_ptr<EventPool> events_;
  cudaStream_t streams_[2] = {nullptr, nullptr};
};

#endif  // OFFLOAD_EXT_WITH_CUDA

}  // namespace

void CopyEngine::run_callback(const Callback& on_done) noexcept {
  try {
    on_done();
  } catch (...) {
    std::lock_guard<std::mutex> lock(error_mutex_);
    if (!callback_error_) callback_error_ = std::current_exception();
  }
}

void CopyEngine::rethrow_callback_error() {
  std::lock_guard<std::mutex> lock(error_mutex_);
  if (callback_error_) std::rethrow_exception(callback_error_);
}

void CopyEngine::throw_if_failure_injected() {
  if (fail_next_.exchange(false)) throw std::runtime_error("CopyEngine: injected copy failure (fail_next_copy)");
}

std::shared_ptr<CopyEngine> make_copy_engine(int device) {
  if (device < 0) return std::make_shared<HostCopyEngine>();
#ifdef OFFLOAD_EXT_WITH_CUDA
  return std::make_shared<CudaCopyEngine>(device);
#else
  throw std::runtime_error("CopyEngine: this offload_ext build has no CUDA support; reinstall with a CUDA toolkit "
                           "and a CUDA build of torch, or use device='cpu'");
#endif
}

}  // namespace offload_ext
