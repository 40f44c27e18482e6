// Engine: argument checks at the Python boundary, pool blocks wrapped as tensors, and the bookkeeping
// that keeps the scheduler's expected jobs in step with the copies actually enqueued.
#include "engine.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <thread>
#include <utility>

#ifdef OFFLOAD_EXT_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

#include "../common/messages.h"
#include "../common/thread_pool.h"

namespace offload_ext {
namespace {

// The tensor owns its pool block: the deleter keeps the block's shared_ptr until the storage dies.
at::Tensor wrap_block(std::shared_ptr<void> block, int64_t numel, at::ScalarType dtype) {
  void* ptr = block.get();
  return at::from_blob(ptr, {numel}, [block](void*) mutable { block.reset(); },
                       at::TensorOptions().dtype(dtype).device(at::kCPU));
}

void check_flat(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.is_contiguous(), "Engine.copy: expected ", what, " to be contiguous; call .contiguous() first");
}

// Checked before the thread pool is built from it, which a count below one would break.
int checked_threads(int num_threads) {
  TORCH_CHECK(num_threads >= 1, "Engine: expected num_threads >= 1, got ", num(static_cast<int64_t>(num_threads)));
  return num_threads;
}

// Threads for one-off set-up work (making and page-locking slabs): every CPU; training has not started.
int setup_threads() { return std::max(1, static_cast<int>(std::thread::hardware_concurrency())); }

// kSpeculativeStep: the unit's norm was taken on the device, before the copy.
bool is_copy_job(Job job) {
  return job == Job::kStep || job == Job::kAccumulateFirst || job == Job::kAccumulate || job == Job::kAccumulateStep ||
         job == Job::kSpeculativeStep || carries_norm(job);
}

// A job announced to the scheduler while it is being enqueued, taken back unless commit() is reached.
// The announcement must come first: a landed copy's callback notifies from the copy thread, possibly
// before the enqueueing call returns, and a job notified before it was expected would let waits return
// while it still runs. Taking it back when the enqueue throws (CopyEngine::copy then never runs the
// callback) keeps a job that will never be queued from leaving wait_unit and wait_all blocked forever.
class PendingJob {
 public:
  PendingJob(StepScheduler& scheduler, int unit, bool norm = false)
      : scheduler_(scheduler), unit_(unit), norm_(norm) {
    scheduler_.expect(unit_, norm_);
  }
  ~PendingJob() {
    if (!committed_) scheduler_.withdraw(unit_, norm_);
  }
  PendingJob(const PendingJob&) = delete;
  PendingJob& operator=(const PendingJob&) = delete;
  void commit() { committed_ = true; }

 private:
  StepScheduler& scheduler_;
  const int unit_;
  const bool norm_;  // the job carries a norm (wait_norms covers it)
  bool committed_ = false;
};

}  // namespace

Engine::Engine(int device, int num_threads, bool pin_threads, int64_t slab_bytes, int host_nice)
    : device_(device),
      pinned_(std::make_shared<PinnedPool>(device >= 0, static_cast<size_t>(slab_bytes), setup_threads())),
      host_(std::make_shared<PinnedPool>(false, static_cast<size_t>(slab_bytes), setup_threads())),
      scheduler_(std::make_shared<StepScheduler>(std::make_shared<ThreadPool>(
          checked_threads(num_threads), pin_threads ? worker_cpus(num_threads) : std::vector<int>{}, host_nice))),
      trace_(std::make_shared<TraceRecorder>()),
      copies_(make_copy_engine(device)) {
  scheduler_->set_trace(trace_);
}

size_t Engine::next_offset() {
  // A pass streams up to eight of a unit's buffers (param, grad, moments, their second copies, master).
  // Starting each at the same place in its page put all streams on the same cache sets and let loads
  // alias the stores before them: on the GPU machine's host a speculative step of a B1 layer took 16 ms
  // on half the units and 9 ms on the rest, and 9 ms on all with starts 576 bytes apart
  // (bench_host_passes). Successive buffers take eight starts 576 bytes apart, in turn.
  constexpr size_t kStride = 576, kTurns = 8;
  return buffers_.fetch_add(1, std::memory_order_relaxed) % kTurns * kStride;
}

size_t Engine::block_bytes(const char* who, int64_t numel, at::ScalarType dtype) {
  const auto size = static_cast<int64_t>(c10::elementSize(dtype));
  // A tensor's byte count must fit int64 (and the pools round it up to a page): a product that wraps would
  // hand out a small block claiming a huge tensor.
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max() / 2;
  TORCH_CHECK(numel >= 0 && numel <= kMax / size, "Engine.", who, ": expected 0 <= numel <= ", num(kMax / size),
              " for ", dtype, " (its bytes must fit in 63 bits), got ", num(numel));
  return static_cast<size_t>(numel * size);
}

at::Tensor Engine::pinned_empty(int64_t numel, at::ScalarType dtype) {
  return wrap_block(pinned_->allocate(block_bytes("pinned_empty", numel, dtype), false, next_offset()), numel, dtype);
}

at::Tensor Engine::host_empty(int64_t numel, at::ScalarType dtype) {
  return wrap_block(host_->allocate(block_bytes("host_empty", numel, dtype), false, next_offset()), numel, dtype);
}

at::Tensor Engine::host_zeros(int64_t numel, at::ScalarType dtype) {
  return wrap_block(host_->allocate(block_bytes("host_zeros", numel, dtype), true, next_offset()), numel, dtype);
}

void Engine::reserve_pinned(int64_t bytes) { pinned_->reserve(static_cast<size_t>(bytes)); }

namespace {
std::vector<size_t> block_sizes(const char* who, const std::vector<int64_t>& blocks) {
  std::vector<size_t> sizes;
  for (int64_t b : blocks) {
    TORCH_CHECK(b >= 0, "Engine.", who, ": expected block sizes >= 0, got ", num(b));
    sizes.push_back(static_cast<size_t>(b));
  }
  return sizes;
}
}  // namespace

void Engine::reserve_pinned_blocks(const std::vector<int64_t>& blocks) {
  pinned_->reserve_blocks(block_sizes("reserve_pinned_blocks", blocks));
}

void Engine::reserve_host_blocks(const std::vector<int64_t>& blocks) {
  host_->reserve_blocks(block_sizes("reserve_host_blocks", blocks));
}

int64_t Engine::release_free_memory() {
  try {
    synchronize();  // an unlocked slab must not be the end of a copy still running
  } catch (const std::exception&) {
    // A stream that failed (a device fault) runs nothing more: no copy can still reach a slab.
  }
  return static_cast<int64_t>(pinned_->trim() + host_->trim());
}

std::shared_ptr<Event> Engine::copy(Direction dir, const at::Tensor& dst, const at::Tensor& src, int notify_unit,
                                    Job job, int trace_unit, bool then_step, uintptr_t after_event) {
  // The enums come from Python, where an enum can still be built from any int.
  TORCH_CHECK(dir == Direction::kH2D || dir == Direction::kD2H, "Engine.copy: expected Direction.H2D or "
              "Direction.D2H, got ", num(static_cast<int64_t>(dir)));
  TORCH_CHECK(is_copy_job(job), "Engine.copy: expected a job a landed gradient triggers (Job.STEP, "
              "ACCUMULATE_FIRST, ACCUMULATE, ACCUMULATE_STEP, NORM, ACCUMULATE_NORM or SPECULATIVE_STEP), got ",
              num(static_cast<int64_t>(job)), "; SCALE_STEP and REDO are queued by the engine");
  TORCH_CHECK(!then_step || carries_norm(job), "Engine.copy: then_step (a SPECULATIVE_STEP behind the norm) goes "
              "with Job.NORM or Job.ACCUMULATE_NORM only");
  TORCH_CHECK(notify_unit >= 0 || job == Job::kStep, "Engine.copy: a job is only queued for a notify_unit; "
              "pass notify_unit= the unit whose gradients this copy brings");
  TORCH_CHECK((job != Job::kSpeculativeStep && !then_step) || scheduler_->has_second_buffers(notify_unit),
              "Engine.copy: a speculative step needs the unit's second state buffers; unit ",
              num(static_cast<int64_t>(notify_unit)), " was added without alt=");
  check_flat(dst, "the copy's destination");
  check_flat(src, "the copy's source");
  TORCH_CHECK(dst.nbytes() == src.nbytes(), "Engine.copy: expected as many destination bytes as source bytes, got ",
              num(static_cast<int64_t>(src.nbytes())), " source and ", num(static_cast<int64_t>(dst.nbytes())),
              " destination bytes");
  const at::Tensor& host = dir == Direction::kH2D ? src : dst;
  const at::Tensor& dev = dir == Direction::kH2D ? dst : src;
  TORCH_CHECK(host.device().is_cpu(), "Engine.copy: expected the host side of a copy on the CPU, got ",
              host.device());
  if (device_ >= 0) {
    TORCH_CHECK(dev.is_cuda() && dev.get_device() == device_, "Engine.copy: expected the device side of a copy on "
                "cuda:", num(static_cast<int64_t>(device_)), ", got ", dev.device());
  } else {
    TORCH_CHECK(dev.device().is_cpu(), "Engine.copy: on the simulated device expected both sides of a copy on the "
                "CPU, got ", dev.device());
  }
  CopyEngine::Callback on_done;
  if (trace_->enabled()) {
    // Issue to landing (the callback runs once the copy has landed, behind the compute it waited for).
    const int unit = trace_unit >= 0 ? trace_unit : notify_unit;
    const char* lane = dir == Direction::kH2D ? "H2D" : "D2H";
    on_done = [trace = trace_, lane, unit, issued = TraceRecorder::now_ns()] {
      trace->record(lane, std::string(lane) + " u" + std::to_string(unit), issued, TraceRecorder::now_ns(), unit);
    };
  }
  if (notify_unit < 0) {
    return copies_->copy(dir, dst.data_ptr(), src.data_ptr(), src.nbytes(), compute_stream(), std::move(on_done),
                         after_event);
  }
  // A speculative step whose norm the device took counts as a norm until its copy lands: wait_norms then
  // also means every speculative step is queued, so that a redo finds it (and goes behind it).
  PendingJob pending(*scheduler_, notify_unit, carries_norm(job) || job == Job::kSpeculativeStep);
  std::optional<PendingJob> pending_step;
  if (then_step) pending_step.emplace(*scheduler_, notify_unit);
  on_done = [sched = scheduler_, notify_unit, job, then_step, traced = std::move(on_done)] {
    try {
      if (traced) traced();
      sched->notify(notify_unit, job, 1.0f, then_step);
    } catch (...) {  // out of memory on the copy thread: the engine fails, every wait raises it
      sched->fail(std::current_exception());
    }
  };
  auto event = copies_->copy(dir, dst.data_ptr(), src.data_ptr(), src.nbytes(), compute_stream(), std::move(on_done),
                             after_event);
  pending.commit();
  if (pending_step) pending_step->commit();
  return event;
}

namespace {
// A wait shorter than this did not block (the jobs were done): it stays off the timeline.
constexpr int64_t kBlockedNs = 2000;
// How often a blocked wait looks at the copy streams and Python's signals.
constexpr std::chrono::milliseconds kPoll{50};
}  // namespace

void Engine::check_copies() {
  try {
    copies_->check();
  } catch (...) {
    scheduler_->fail(std::current_exception());  // kept: every later call raises it
    throw;
  }
}

void Engine::fail(const std::string& why) { scheduler_->fail(std::make_exception_ptr(std::runtime_error(why))); }

void Engine::check() {
  check_copies();
  scheduler_->check();
}

void Engine::poll(const std::function<bool(std::chrono::milliseconds)>& wait_for) {
  while (!wait_for(kPoll)) {
    check_copies();
    if (interrupt_check_) interrupt_check_();
  }
}

void Engine::synchronize() {
  try {
    copies_->synchronize();
  } catch (...) {
    scheduler_->fail(std::current_exception());
    throw;
  }
}

void Engine::wait_norms() {
  poll([&](std::chrono::milliseconds t) { return scheduler_->wait_norms(t); });
}

std::string Engine::close() {
  try {
    check_copies();
    synchronize();  // every callback that will ever run has run: nothing more is notified
  } catch (...) {
    // Failed (kept by the scheduler): the copies in flight never land; their jobs are not waited for.
  }
  while (!scheduler_->drain(kPoll)) {
  }
  return scheduler_->error_message();
}

void Engine::wait_unit(int unit, const std::string& reason, bool params_only) {
  const int64_t begin = TraceRecorder::now_ns();
  poll([&](std::chrono::milliseconds t) { return scheduler_->wait(unit, params_only, t); });
  const int64_t end = TraceRecorder::now_ns();
  if (end - begin > kBlockedNs) {
    trace_->record("wait", reason.empty() ? "wait u" + std::to_string(unit) : reason, begin, end, unit);
  }
}

void Engine::wait_all() {
  const int64_t begin = TraceRecorder::now_ns();
  poll([&](std::chrono::milliseconds t) { return scheduler_->wait_all(t); });
  const int64_t end = TraceRecorder::now_ns();
  if (end - begin > kBlockedNs) trace_->record("wait", "wait for every host step", begin, end, -1);
}

void Engine::start_trace() {
  trace_->take();  // anything from an earlier trace is dropped
  trace_->set_enabled(true);
}

std::vector<TraceEvent> Engine::stop_trace() {
  trace_->set_enabled(false);
  return trace_->take();
}

void Engine::compute_wait(const std::shared_ptr<Event>& e) {
  TORCH_CHECK(e, "Engine.compute_wait: expected an event from Engine.copy, got None");
  try {
    copies_->compute_wait(*e, compute_stream());  // the simulated device blocks here: a fault ends it
  } catch (...) {
    scheduler_->fail(std::current_exception());
    throw;
  }
}

void Engine::set_hyper(double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step,
                       int group) {
  TORCH_CHECK(step >= 1, "Engine.set_hyper: expected step >= 1 (the 1-based count for bias correction), got ",
              num(step));
  TORCH_CHECK(group >= 0, "Engine.set_hyper: expected a parameter group >= 0, got ", num(static_cast<int64_t>(group)));
  scheduler_->set_hyper(group, {lr, beta1, beta2, eps, weight_decay, step});
}

void Engine::notify(int unit) {
  PendingJob pending(*scheduler_, unit);
  scheduler_->notify(unit);
  pending.commit();
}

void Engine::take_over(int unit) {
  TORCH_CHECK(unit >= 0, "Engine.take_over: expected a unit >= 0, got ", num(static_cast<int64_t>(unit)));
  scheduler_->take_over(unit);
}

void Engine::redo(int unit, float scale) {
  TORCH_CHECK(unit >= 0, "Engine.redo: expected a unit >= 0, got ", num(static_cast<int64_t>(unit)));
  // A NaN or negative scale would commit a step no clipping rule gives; a non-finite norm is decided
  // before any redo (see NativeBackend.clipped_step).
  TORCH_CHECK(std::isfinite(scale) && scale >= 0.0f, "Engine.redo: expected a finite clipping scale >= 0, got ",
              scale);
  scheduler_->redo(unit, scale);
}

void Engine::run(int unit, Job job, float scale) {
  TORCH_CHECK(job == Job::kNorm || job == Job::kScaleStep, "Engine.run: expected Job.NORM or Job.SCALE_STEP, got ",
              num(static_cast<int64_t>(job)), "; the other jobs come with a gradient copy (Engine.copy)");
  TORCH_CHECK(std::isfinite(scale) && scale >= 0.0f, "Engine.run: expected a finite clipping scale >= 0, got ",
              scale);
  PendingJob pending(*scheduler_, unit, job == Job::kNorm);
  scheduler_->notify(unit, job, scale);
  pending.commit();
}

uintptr_t Engine::compute_stream() const {
#ifdef OFFLOAD_EXT_WITH_CUDA
  if (device_ >= 0) return reinterpret_cast<uintptr_t>(c10::cuda::getCurrentCUDAStream(device_).stream());
#endif
  return 0;
}

}  // namespace offload_ext
