// The Python surface of offload_ext._C: torch ops with schemas for the kernels (torch.ops.offload_ext.*)
// and a small pybind11 module for the library's settings and build facts.
#include <torch/extension.h>
#include <torch/version.h>

#include <algorithm>
#include <thread>

#ifdef OFFLOAD_EXT_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

#include "adamw.h"
#include "copy_engine.h"
#include "cross_entropy.h"
#include "pinned_pool.h"
#include "step_scheduler.h"
#include "thread_pool.h"

namespace offload_ext {
namespace {

// Numbers in messages go through std::to_string, not iostreams: on the GPU machine the extension is
// built by a newer g++ than the libstdc++ it loads, and formatting an integer through a stream there
// crashed (seen 2026-11-29; strings and dtypes format fine).
std::string num(int64_t x) { return std::to_string(x); }
std::string num(double x) { return std::to_string(x); }

void check_span(const char* who, const at::Tensor& t, const char* name, int64_t numel) {
  TORCH_CHECK(t.device().is_cpu(), who, ": expected ", name, " on the CPU, got a tensor on ", t.device());
  TORCH_CHECK(t.is_contiguous(), who, ": expected ", name,
              " to be contiguous (the kernel steps one flat span); call .contiguous() on it first");
  TORCH_CHECK(t.numel() == numel, who, ": expected ", name, " to have ", num(numel), " elements like param, got ",
              num(t.numel()));
}

void check_dtype(const char* who, const at::Tensor& t, const char* name, at::ScalarType expected, const char* mode) {
  TORCH_CHECK(t.scalar_type() == expected, who, ": in ", mode, " mode expected ", name, " of dtype ", expected,
              ", got ", t.scalar_type());
}

// Validates one AdamW span's tensors (shapes, layout, the dtypes of a precision mode) and describes it.
StepUnit checked_unit(const char* who, const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                      const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& param_out) {
  const int64_t n = param.numel();
  check_span(who, param, "param", n);
  check_span(who, grad, "grad", n);
  check_span(who, exp_avg, "exp_avg", n);
  check_span(who, exp_avg_sq, "exp_avg_sq", n);
  StepUnit u{};
  u.numel = n;
  u.param = param.data_ptr();
  u.grad = grad.data_ptr();
  u.exp_avg = exp_avg.data_ptr();
  u.exp_avg_sq = exp_avg_sq.data_ptr();
  if (param.scalar_type() == at::kBFloat16) {
    const char* mode = "bf16 (bf16 param)";
    check_dtype(who, grad, "grad", at::kBFloat16, mode);
    check_dtype(who, exp_avg, "exp_avg", at::kBFloat16, mode);
    check_dtype(who, exp_avg_sq, "exp_avg_sq", at::kBFloat16, mode);
    TORCH_CHECK(!param_out.has_value(), who, ": param_out is only for fp32 master params; "
                "a bf16 param is updated in place");
    u.bf16_mode = true;
    return u;
  }
  TORCH_CHECK(param.scalar_type() == at::kFloat, who, ": expected param of dtype bfloat16 (bf16 mode) or ",
              "float32 (fp32/mixed mode), got ", param.scalar_type());
  const char* mode = "fp32/mixed (float32 param)";
  check_dtype(who, exp_avg, "exp_avg", at::kFloat, mode);
  check_dtype(who, exp_avg_sq, "exp_avg_sq", at::kFloat, mode);
  TORCH_CHECK(grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kBFloat16, who, ": in ", mode,
              " mode expected grad of dtype float32 or bfloat16, got ", grad.scalar_type());
  u.grad_type = grad.scalar_type() == at::kBFloat16 ? GradType::kBF16 : GradType::kFP32;
  if (param_out.has_value()) {
    check_span(who, *param_out, "param_out", n);
    check_dtype(who, *param_out, "param_out", at::kBFloat16, mode);
    u.param_out = reinterpret_cast<uint16_t*>(param_out->data_ptr());
  }
  return u;
}

void adamw_step(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& param_out, double lr,
                double beta1, double beta2, double eps, double weight_decay, int64_t step) {
  TORCH_CHECK(step >= 1, "adamw_step: expected step >= 1 (the 1-based count used for bias correction), got ", num(step));
  TORCH_CHECK(lr >= 0, "adamw_step: expected lr >= 0, got ", num(lr));
  TORCH_CHECK(beta1 >= 0 && beta1 < 1, "adamw_step: expected 0 <= beta1 < 1, got ", num(beta1));
  TORCH_CHECK(beta2 >= 0 && beta2 < 1, "adamw_step: expected 0 <= beta2 < 1, got ", num(beta2));
  TORCH_CHECK(eps >= 0, "adamw_step: expected eps >= 0, got ", num(eps));
  TORCH_CHECK(weight_decay >= 0, "adamw_step: expected weight_decay >= 0, got ", num(weight_decay));
  const StepUnit unit = checked_unit("adamw_step", param, grad, exp_avg, exp_avg_sq, param_out);
  adamw_unit(unit, unit.grad, {lr, beta1, beta2, eps, weight_decay, step}, *global_pool());
}

py::dict native_info() {
  py::dict info;
  info["torch_built_against"] = TORCH_VERSION;
  info["simd"] = simd_level_name(active_simd_level());
  auto pool = global_pool();
  info["num_threads"] = pool->num_threads();
  info["threads_pinned"] = pool->pinned();
#ifdef OFFLOAD_EXT_WITH_CUDA
  info["cuda"] = true;
  info["cuda_runtime_compiled"] = std::to_string(CUDART_VERSION / 1000) + "." + std::to_string(CUDART_VERSION % 1000 / 10);
#else
  info["cuda"] = false;
  info["cuda_runtime_compiled"] = py::none();
#endif
  return info;
}

int cuda_device_count() {
#ifdef OFFLOAD_EXT_WITH_CUDA
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
#else
  return 0;
#endif
}


// ------------------------------------------------------------------------------------------ Engine
// One offload engine: pinned and host memory pools, the copy streams and the step scheduler.

at::Tensor wrap_block(std::shared_ptr<void> block, int64_t numel, at::ScalarType dtype) {
  void* ptr = block.get();
  return torch::from_blob(ptr, {numel}, [block](void*) mutable { block.reset(); },
                          at::TensorOptions().dtype(dtype).device(at::kCPU));
}

void check_flat(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.is_contiguous(), "Engine: expected ", what, " to be contiguous");
}

// Threads for one-off set-up work (making and page-locking slabs): every CPU; training has not started.
int setup_threads() { return std::max(1, static_cast<int>(std::thread::hardware_concurrency())); }

class Engine {
 public:
  Engine(int device, int num_threads, bool pin_threads, int64_t slab_bytes)
      : device_(device),
        pinned_(std::make_shared<PinnedPool>(device >= 0, static_cast<size_t>(slab_bytes), setup_threads())),
        host_(std::make_shared<PinnedPool>(false, static_cast<size_t>(slab_bytes), setup_threads())),
        scheduler_(std::make_shared<StepScheduler>(std::make_shared<ThreadPool>(
            num_threads, pin_threads ? worker_cpus(num_threads) : std::vector<int>{}))),
        copies_(make_copy_engine(device)) {
    TORCH_CHECK(num_threads >= 1, "Engine: expected num_threads >= 1, got ", num(static_cast<int64_t>(num_threads)));
  }

  at::Tensor pinned_empty(int64_t numel, at::ScalarType dtype) {
    return wrap_block(pinned_->allocate(numel * c10::elementSize(dtype)), numel, dtype);
  }
  at::Tensor host_empty(int64_t numel, at::ScalarType dtype) {
    return wrap_block(host_->allocate(numel * c10::elementSize(dtype)), numel, dtype);
  }
  at::Tensor host_zeros(int64_t numel, at::ScalarType dtype) {
    return wrap_block(host_->allocate(numel * c10::elementSize(dtype), true), numel, dtype);
  }
  void reserve_pinned(int64_t bytes) { pinned_->reserve(static_cast<size_t>(bytes)); }

  py::dict memory_stats() const {
    py::dict d;
    const PinnedStats p = pinned_->stats();
    const PinnedStats h = host_->stats();
    d["pinned_reserved"] = p.reserved;
    d["pinned_in_use"] = p.in_use;
    d["pinned_slabs"] = p.slabs;
    d["page_locked"] = p.page_locked;
    d["host_reserved"] = h.reserved;
    d["host_in_use"] = h.in_use;
    return d;
  }

  std::shared_ptr<Event> copy(int dir, const at::Tensor& dst, const at::Tensor& src, int notify_unit, int job) {
    TORCH_CHECK(job >= 0 && job <= 3, "Engine.copy: job must be 0 (step), 1 (accumulate first), 2 (accumulate) or "
                "3 (accumulate and step), got ", num(static_cast<int64_t>(job)));
    check_flat(dst, "the copy's destination");
    check_flat(src, "the copy's source");
    TORCH_CHECK(dst.nbytes() == src.nbytes(), "Engine: copy between ", num(static_cast<int64_t>(src.nbytes())),
                " source bytes and ", num(static_cast<int64_t>(dst.nbytes())), " destination bytes");
    const Direction d = dir == 0 ? Direction::kH2D : Direction::kD2H;
    const at::Tensor& host = d == Direction::kH2D ? src : dst;
    const at::Tensor& dev = d == Direction::kH2D ? dst : src;
    TORCH_CHECK(host.device().is_cpu(), "Engine: the host side of a copy must be a CPU tensor, got ", host.device());
    if (device_ >= 0) {
      TORCH_CHECK(dev.is_cuda() && dev.get_device() == device_, "Engine: the device side of a copy must be on cuda:",
                  num(static_cast<int64_t>(device_)), ", got ", dev.device());
    } else {
      TORCH_CHECK(dev.device().is_cpu(), "Engine: on the simulated device both sides of a copy are CPU tensors");
    }
    CopyEngine::Callback on_done;
    if (notify_unit >= 0) {
      scheduler_->expect(notify_unit);
      auto sched = scheduler_;
      const Job kind = static_cast<Job>(job);
      on_done = [sched, notify_unit, kind] { sched->notify(notify_unit, kind); };
    }
    return copies_->copy(d, dst.data_ptr(), src.data_ptr(), src.nbytes(), compute_stream(), std::move(on_done));
  }

  void compute_wait(const std::shared_ptr<Event>& e) {
    TORCH_CHECK(e, "Engine.compute_wait: expected an event, got None");
    copies_->compute_wait(*e, compute_stream());
  }

  int add_unit(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
               const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& param_out,
               const std::optional<at::Tensor>& accum) {
    StepUnit u = checked_unit("Engine.add_unit", param, grad, exp_avg, exp_avg_sq, param_out);
    const int64_t n = u.numel;
    if (accum.has_value()) {
      check_span("Engine.add_unit", *accum, "accum", n);
      TORCH_CHECK(accum->scalar_type() == at::kBFloat16 && grad.scalar_type() == at::kBFloat16,
                  "Engine.add_unit: gradient accumulation works on bf16 grads into a bf16 accum, got grad ",
                  grad.scalar_type(), " and accum ", accum->scalar_type());
      u.accum = reinterpret_cast<uint16_t*>(accum->data_ptr());
    }
    return scheduler_->add_unit(u);
  }

  void set_hyper(double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step) {
    TORCH_CHECK(step >= 1, "Engine.set_hyper: expected step >= 1, got ", num(step));
    scheduler_->set_hyper({lr, beta1, beta2, eps, weight_decay, step});
  }

  py::dict stats() const {
    py::dict d;
    const SchedulerStats s = scheduler_->stats();
    d["step_busy_seconds"] = s.busy_seconds;
    d["units_stepped"] = s.units_stepped;
    d["wait_seconds"] = s.wait_seconds;
    d["num_threads"] = scheduler_->pool()->num_threads();
    d["threads_pinned"] = scheduler_->pool()->pinned();
    return d;
  }

  StepScheduler& scheduler() { return *scheduler_; }
  CopyEngine& copies() { return *copies_; }
  int device() const { return device_; }

 private:
  uintptr_t compute_stream() const {
#ifdef OFFLOAD_EXT_WITH_CUDA
    if (device_ >= 0) return reinterpret_cast<uintptr_t>(c10::cuda::getCurrentCUDAStream(device_).stream());
#endif
    return 0;
  }

  const int device_;
  std::shared_ptr<PinnedPool> pinned_;
  std::shared_ptr<PinnedPool> host_;
  std::shared_ptr<StepScheduler> scheduler_;
  std::shared_ptr<CopyEngine> copies_;  // last: destroyed first, draining copies into the pools above
};

}  // namespace
}  // namespace offload_ext

TORCH_LIBRARY(offload_ext, m) {
  m.def(
      "adamw_step(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
      "Tensor(d!)? param_out, float lr, float beta1, float beta2, float eps, float weight_decay, int step) -> ()");
  m.def("cross_entropy_rows(Tensor logits, Tensor labels, int ignore_index) -> (Tensor loss, Tensor lse)");
  m.def(
      "cross_entropy_rows_backward(Tensor logits, Tensor lse, Tensor labels, Tensor grad, int ignore_index, "
      "Tensor(a!) grad_logits) -> ()");
}

TORCH_LIBRARY_IMPL(offload_ext, CPU, m) {
  m.impl("adamw_step", &offload_ext::adamw_step);
  m.impl("cross_entropy_rows", &offload_ext::cross_entropy_rows_cpu);
  m.impl("cross_entropy_rows_backward", &offload_ext::cross_entropy_rows_backward_cpu);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "offload_ext native engine";
  m.def("native_info", &offload_ext::native_info, "Build and run-time facts of the native extension.");
  m.def("set_num_threads", &offload_ext::set_global_pool, py::arg("num_threads"), py::arg("pin") = false,
        py::call_guard<py::gil_scoped_release>(),
        "Replace the kernel thread pool (num_threads counts the calling thread).");
  m.def("set_simd_level", [](const std::string& name) {
        offload_ext::set_simd_level(offload_ext::parse_simd_level(name.c_str()));
      }, "Choose the kernels' ISA (scalar, avx2, avx512); at most what the CPU supports.");
  m.def("supported_simd_level", [] { return offload_ext::simd_level_name(offload_ext::supported_simd_level()); });
  m.def("set_memory_tuning", [](int64_t prefetch, bool stream_out) {
        offload_ext::set_memory_tuning({prefetch, stream_out});
      }, py::arg("prefetch"), py::arg("stream_out"),
      "Kernel memory tuning: software-prefetch distance in elements (0 = off) and non-temporal bf16 output.");
  m.def("memory_tuning", [] {
    const auto t = offload_ext::memory_tuning();
    return py::make_tuple(t.prefetch, t.stream_out);
  });
  m.def("get_num_threads", [] { return offload_ext::global_pool()->num_threads(); });
  m.def("default_num_threads", &offload_ext::default_num_threads);
  using offload_ext::Engine;
  using offload_ext::Event;
  using Release = py::call_guard<py::gil_scoped_release>;
  // Opaque to Python: handed back to Engine.compute_wait.
  py::class_<Event, std::shared_ptr<Event>>(m, "Event", "Completion of an enqueued copy.");
  py::class_<Engine>(m, "Engine", "Pinned memory, copy streams and the overlapped AdamW step scheduler.")
      .def(py::init<int, int, bool, int64_t>(), py::arg("device"), py::arg("num_threads"), py::arg("pin_threads"),
           py::arg("slab_bytes"))
      .def("pinned_empty", &Engine::pinned_empty, py::arg("numel"), py::arg("dtype"))
      .def("host_empty", &Engine::host_empty, py::arg("numel"), py::arg("dtype"))
      .def("host_zeros", &Engine::host_zeros, py::arg("numel"), py::arg("dtype"))
      .def("reserve_pinned", &Engine::reserve_pinned, Release())
      .def("memory_stats", &Engine::memory_stats)
      .def("copy", &Engine::copy, py::arg("direction"), py::arg("dst"), py::arg("src"), py::arg("notify_unit") = -1,
           py::arg("job") = 0)
      .def("compute_wait", &Engine::compute_wait, Release())
      .def("add_unit", &Engine::add_unit, py::arg("param"), py::arg("grad"), py::arg("exp_avg"),
           py::arg("exp_avg_sq"), py::arg("param_out") = py::none(), py::arg("accum") = py::none())
      .def("set_hyper", &Engine::set_hyper)
      .def("notify", [](Engine& e, int unit) {
        e.scheduler().expect(unit);
        e.scheduler().notify(unit);
      })  // a step of `unit` with gradients already in place
      .def("run", [](Engine& e, int unit, int job, float scale) {
        TORCH_CHECK(job == 4 || job == 5, "Engine.run: job must be 4 (norm) or 5 (scale and step), got ",
                    std::to_string(job));
        e.scheduler().expect(unit);
        e.scheduler().notify(unit, static_cast<offload_ext::Job>(job), scale);
      }, py::arg("unit"), py::arg("job"), py::arg("scale") = 1.0f,
      "Queue a job on a unit whose gradients are accumulated on the host (clipping).")
      .def("sq_norm", [](Engine& e, int unit) { return e.scheduler().sq_norm(unit); })
      .def("wait_unit", [](Engine& e, int unit) { e.scheduler().wait(unit); }, Release())
      .def("wait_all", [](Engine& e) { e.scheduler().wait_all(); }, Release())
      .def("ready", [](Engine& e, int unit) { return e.scheduler().ready(unit); },
           "Whether every announced job of `unit` is done (a copy from its params is safe), without waiting.")
      .def("set_debug_step_delay_us", [](Engine& e, int us) { e.scheduler().set_debug_step_delay_us(us); },
           "Testing aid: each slice of a scheduled job sleeps this long first, as on a slow host.")
      .def("set_slice_elements", [](Engine& e, int64_t n) { e.scheduler().set_slice_elements(n); },
           py::arg("elements"),
           "Elements a job steps before the scheduler chooses again (a lower unit may go first); results do "
           "not depend on it.")
      .def("check", [](Engine& e) { e.scheduler().check(); })
      .def("inject_failure", [](Engine& e) { e.scheduler().inject_failure(); })
      .def("synchronize", [](Engine& e) { e.copies().synchronize(); }, Release())
      .def("set_debug_delay_us", [](Engine& e, int us) { e.copies().set_debug_delay_us(us); })
      .def("stats", &Engine::stats);
  m.def("cuda_device_count", &offload_ext::cuda_device_count,
        "CUDA devices seen through the CUDA runtime this extension was compiled against (0 in a CPU build).");
}
