// The Python surface of offload_ext._C: the op schemas and CPU kernels (torch.ops.offload_ext.*), and a
// pybind11 module for the library's settings, build facts and the Engine.
#include <torch/extension.h>
#include <torch/version.h>

#ifdef OFFLOAD_EXT_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#include "common/thread_pool.h"
#include "engine/copy_engine.h"
#include "engine/engine.h"
#include "engine/step_scheduler.h"
#include "kernels/adamw.h"
#include "ops/adamw8bit_op.h"
#include "ops/adamw_op.h"
#include "ops/cross_entropy.h"
#include "ops/dequantize.h"
#include "ops/sr_round.h"
#include "ops/sum_squares.h"

namespace {

// Between the polls of a blocked wait (which runs without the GIL): Ctrl-C raises KeyboardInterrupt there.
void check_python_signals() {
  py::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() != 0) throw py::error_already_set();
}

std::unique_ptr<offload_ext::Engine> make_engine(int device, int num_threads, bool pin_threads, int64_t slab_bytes,
                                                 int host_nice) {
  std::unique_ptr<offload_ext::Engine> engine;
  {
    // Its threads start here, and a failed start joins those already running: never with the GIL held.
    py::gil_scoped_release nogil;
    engine = std::make_unique<offload_ext::Engine>(device, num_threads, pin_threads, slab_bytes, host_nice);
  }
  engine->set_interrupt_check(check_python_signals);
  return engine;
}

py::dict native_info() {
  py::dict info;
  info["torch_built_against"] = TORCH_VERSION;
  info["simd"] = offload_ext::simd_level_name(offload_ext::active_simd_level());
  auto pool = offload_ext::global_pool();
  info["num_threads"] = pool->num_threads();
  info["threads_pinned"] = pool->pinned();
#ifdef OFFLOAD_EXT_WITH_CUDA
  info["cuda"] = true;
  info["cuda_runtime_compiled"] =
      std::to_string(CUDART_VERSION / 1000) + "." + std::to_string(CUDART_VERSION % 1000 / 10);
#else
  info["cuda"] = false;
  info["cuda_runtime_compiled"] = py::none();
#endif
  return info;
}

py::dict memory_stats(const offload_ext::Engine& e) {
  const offload_ext::PinnedStats p = e.pinned_stats();
  const offload_ext::PinnedStats h = e.host_stats();
  py::dict d;
  d["pinned_reserved"] = p.reserved;
  d["pinned_in_use"] = p.in_use;
  d["pinned_slabs"] = p.slabs;
  d["page_locked"] = p.page_locked;
  d["host_reserved"] = h.reserved;
  d["host_in_use"] = h.in_use;
  return d;
}

py::dict step_stats(const offload_ext::Engine& e) {
  const offload_ext::SchedulerStats s = e.scheduler_stats();
  py::dict d;
  d["step_busy_seconds"] = s.busy_seconds;
  d["units_stepped"] = s.units_stepped;
  d["wait_seconds"] = s.wait_seconds;
  d["num_threads"] = e.num_threads();
  d["threads_pinned"] = e.threads_pinned();
  d["host_nice"] = e.host_nice();
  return d;
}

}  // namespace

TORCH_LIBRARY(offload_ext, m) {
  // The fake (meta) kernels and the cross-entropy's autograd formula are registered in Python, there.
  m.set_python_module("offload_ext.ops");
  m.def(
      "adamw_step(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
      "Tensor(d!)? param_out, float lr, float beta1, float beta2, float eps, float weight_decay, int step, "
      "int? sr_seed=None, int sr_stream=0, int sr_offset=0, float grad_scale=1.0) -> ()");
  m.def(
      "adamw8bit_step(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
      "Tensor(d!) exp_avg_absmax, Tensor(e!) exp_avg_sq_absmax, Tensor exp_avg_code, Tensor exp_avg_sq_code, "
      "float lr, float beta1, float beta2, float eps, float weight_decay, int step, int? sr_seed=None, "
      "int sr_stream=0, int sr_offset=0) -> ()");
  // overwrite: the backward may write the logits' gradient over the logits (only safe when nothing else
  // saved them); the forward kernels ignore it.
  m.def("cross_entropy_rows(Tensor logits, Tensor labels, int ignore_index, bool overwrite=False) -> "
        "(Tensor loss, Tensor lse)");
  m.def(
      "cross_entropy_rows_backward(Tensor logits, Tensor lse, Tensor labels, Tensor grad, int ignore_index, "
      "Tensor(a!) grad_logits) -> ()");
  m.def("sum_squares(Tensor x) -> Tensor");
  m.def(
      "sr_round_bf16(Tensor param32, Tensor exp_avg32, Tensor exp_avg_sq32, Tensor(a!) param, Tensor(b!) exp_avg, "
      "Tensor(c!) exp_avg_sq, int seed, int stream, int step, int offset) -> ()");
  m.def("dequantize_base(Tensor storage, str fmt, int rows, int cols, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(offload_ext, CPU, m) {
  m.impl("adamw_step", &offload_ext::adamw_step_cpu);
  m.impl("adamw8bit_step", &offload_ext::adamw8bit_step_cpu);
  m.impl("cross_entropy_rows", &offload_ext::cross_entropy_rows_cpu);
  m.impl("cross_entropy_rows_backward", &offload_ext::cross_entropy_rows_backward_cpu);
  m.impl("sum_squares", &offload_ext::sum_squares_cpu);
  m.impl("sr_round_bf16", &offload_ext::sr_round_bf16_cpu);
  m.impl("dequantize_base", &offload_ext::dequantize_base_cpu);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using offload_ext::Direction;
  using offload_ext::Engine;
  using offload_ext::Event;
  using offload_ext::Job;
  using Release = py::call_guard<py::gil_scoped_release>;

  m.doc() = "offload_ext native engine";
  m.def("native_info", &native_info, "Build and run-time facts of the native extension.");
  m.def("set_num_threads", &offload_ext::set_global_pool, py::arg("num_threads"), py::arg("pin") = false, Release(),
        "Replace the kernel thread pool (num_threads counts the calling thread).");
  m.def("set_simd_level", [](const std::string& name) {
        offload_ext::set_simd_level(offload_ext::parse_simd_level(name.c_str()));
      }, "Choose the kernels' ISA (scalar, avx2, avx512); at most what the CPU supports.");
  m.def("supported_simd_level", [] { return offload_ext::simd_level_name(offload_ext::supported_simd_level()); });
  m.def("set_memory_tuning", [](int64_t prefetch, bool stream_out, std::optional<std::string> prefetch_level) {
        const auto level = prefetch_level ? offload_ext::parse_prefetch_level(prefetch_level->c_str())
                                          : offload_ext::memory_tuning().prefetch_level;
        offload_ext::set_memory_tuning({prefetch, stream_out, level});
      }, py::arg("prefetch"), py::arg("stream_out"), py::arg("prefetch_level") = py::none(),
      "Kernel memory tuning: software-prefetch distance in elements (0 = off), non-temporal bf16 output, and the "
      "cache the prefetches fill (l1, l2, nta; None keeps the current one).");
  m.def("memory_tuning", [] {
    const auto t = offload_ext::memory_tuning();
    return py::make_tuple(t.prefetch, t.stream_out, offload_ext::prefetch_level_name(t.prefetch_level));
  });
  m.def("set_thread_start_failure", &offload_ext::set_thread_start_failure, py::arg("started"),
        "Testing aid: every thread pool created from now on fails to start its worker `started` (0-based), as "
        "under a thread limit; -1: off.");
  m.def("get_num_threads", [] { return offload_ext::global_pool()->num_threads(); });
  m.def("default_num_threads", &offload_ext::default_num_threads,
        "The kernel pool's default size: every CPU this process may run on (its affinity mask).");

  py::enum_<Direction>(m, "Direction", "The copy stream of Engine.copy.")
      .value("H2D", Direction::kH2D)
      .value("D2H", Direction::kD2H);
  py::enum_<Job>(m, "Job", "What the engine does to a unit: after a gradient copy lands (Engine.copy), or "
                 "queued directly (Engine.run).")
      .value("STEP", Job::kStep, "step with the landed gradient")
      .value("ACCUMULATE_FIRST", Job::kAccumulateFirst, "accum = landed gradient (first micro-batch)")
      .value("ACCUMULATE", Job::kAccumulate, "accum += landed gradient, in bf16")
      .value("ACCUMULATE_STEP", Job::kAccumulateStep,
             "step with accum + landed gradient, summed in the step's pass (last micro-batch; accum is not written)")
      .value("NORM", Job::kNorm, "sum of squares of accum, read with Engine.sq_norm")
      .value("SCALE_STEP", Job::kScaleStep, "accum *= scale (rounded to bf16), then step")
      .value("ACCUMULATE_NORM", Job::kAccumulateNorm, "accum += landed gradient, then its sum of squares")
      .value("SPECULATIVE_STEP", Job::kSpeculativeStep,
             "step with accum into the second state buffers, which become the live ones (speculative clipping)")
      .value("REDO", Job::kRedo, "accum *= scale, step again from the state before the speculative step");

  // Opaque to Python: handed back to Engine.compute_wait.
  py::class_<Event, std::shared_ptr<Event>>(m, "Event", "Completion of an enqueued copy.");
  py::class_<Engine>(m, "Engine", "Pinned memory, copy streams and the overlapped AdamW step scheduler.")
      .def(py::init(&make_engine), py::arg("device"), py::arg("num_threads"), py::arg("pin_threads"),
           py::arg("slab_bytes"), py::arg("host_nice") = 0)
      .def("pinned_empty", &Engine::pinned_empty, py::arg("numel"), py::arg("dtype"))
      .def("host_empty", &Engine::host_empty, py::arg("numel"), py::arg("dtype"))
      .def("host_zeros", &Engine::host_zeros, py::arg("numel"), py::arg("dtype"))
      .def("reserve_pinned", &Engine::reserve_pinned, py::arg("bytes"), Release())
      .def("reserve_pinned_blocks", &Engine::reserve_pinned_blocks, py::arg("blocks"), Release(),
           "Page-lock slabs that hold exactly these blocks (bytes each), to be taken by pinned_empty.")
      .def("reserve_host_blocks", &Engine::reserve_host_blocks, py::arg("blocks"), Release(),
           "Fault in pageable slabs that hold exactly these blocks (bytes each), to be taken by host_empty "
           "and host_zeros.")
      .def("release_free_memory", &Engine::release_free_memory, Release(),
           "Wait for the copies, then unmap the slabs of both pools that hold no live block; the bytes freed.")
      .def("memory_stats", &memory_stats)
      .def("copy", &Engine::copy, py::arg("direction"), py::arg("dst"), py::arg("src"), py::arg("notify_unit") = -1,
           py::arg("job") = Job::kStep, py::arg("trace_unit") = -1, py::arg("then_step") = false,
           py::arg("after_event") = 0,
           "Enqueue a copy; with notify_unit, queue `job` of that unit once it lands. Raises (and leaves "
           "nothing expected of the unit) when the copy cannot be enqueued. trace_unit: the unit the timeline "
           "names (default notify_unit). after_event: a recorded cudaEvent_t handle (torch.cuda.Event.cuda_event) "
           "the copy waits for instead of the compute stream's point now (0: that point).")
      .def("compute_wait", &Engine::compute_wait, py::arg("event"), Release())
      .def("add_unit", &Engine::add_unit, py::arg("param"), py::arg("grad"), py::arg("exp_avg"),
           py::arg("exp_avg_sq"), py::arg("param_out") = py::none(), py::arg("accum") = py::none(),
           py::arg("groups") = std::vector<std::tuple<int, int64_t, int64_t>>{},
           py::arg("alt") = std::vector<at::Tensor>{}, py::arg("sr_seed") = py::none(), py::arg("sr_stream") = 0,
           py::arg("eight_bit") = std::vector<at::Tensor>{},
           "A unit to step; `groups`: (parameter group, begin, end) ranges covering it, in order (default: all "
           "of it in group 0); `alt`: second state buffers [like param, like exp_avg, like exp_avg_sq (8-bit: "
           "and like each absmax)] for speculative clipping; `sr_seed` (bf16 units): stochastic rounding from stream "
           "(sr_seed, sr_stream); `eight_bit`: [exp_avg_absmax, exp_avg_sq_absmax, codes] of a unit whose moments "
           "are uint8 codes (codes: exp_avg's 256 then exp_avg_sq's; an absmax per 256 elements of each range).")
      .def("set_hyper", &Engine::set_hyper, py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
           py::arg("weight_decay"), py::arg("step"), py::arg("group") = 0)
      .def("notify", &Engine::notify, py::arg("unit"), "Queue a step of `unit` with gradients already in place.")
      .def("run", &Engine::run, py::arg("unit"), py::arg("job"), py::arg("scale") = 1.0f,
           "Queue Job.NORM or Job.SCALE_STEP on a unit whose gradients are accumulated on the host (clipping).")
      .def("sq_norm", &Engine::sq_norm, py::arg("unit"))
      .def("wait_norms", &Engine::wait_norms, Release(), "Block until every queued norm job is done (they go first); "
           "speculative steps not yet started are held from then on, until release_speculation() or wait_all().")
      .def("hold_speculation", &Engine::hold_speculation, "Hold every speculative step from now on, as once the norm "
           "is known, until release_speculation() or wait_all() (after a step that clipped).")
      .def("release_speculation", &Engine::release_speculation, "The norm decided (after any redo): held "
           "speculative steps run in place as plain steps.")
      .def("redo", &Engine::redo, py::arg("unit"), py::arg("scale"),
           "Redo the unit's speculative step exactly, with its gradients scaled (clipping triggered).")
      .def("take_over", &Engine::take_over, py::arg("unit"), Release(),
           "The unit's clipped redo runs on the device: drop its speculative step if not started (swapping as if "
           "it ran), else wait for it; then swapped(unit) names the buffers to fill.")
      .def("wait_unit", &Engine::wait_unit, py::arg("unit"), py::arg("reason") = "", py::arg("params_only") = false,
           Release(), "Block until the unit's announced jobs are done (params_only: all but a moments pass behind its "
           "params); a wait that blocked goes on the timeline as `reason`.")
      .def("start_trace", &Engine::start_trace, "Record the timeline (copies, host step slices, waits) from now on.")
      .def("stop_trace", [](Engine& e) {
        py::list out;
        for (const auto& ev : e.stop_trace()) out.append(py::make_tuple(ev.lane, ev.name, ev.begin_ns, ev.end_ns, ev.unit));
        return out;
      }, "Stop recording; the events as (lane, name, begin_ns, end_ns, unit), on time.monotonic_ns()'s clock.")
      .def("wait_all", &Engine::wait_all, Release())
      .def("close", &Engine::close, Release(),
           "Shut the work down whatever failed: check and synchronize the copy streams, then wait for the host "
           "jobs queued (skipped after a failure). Never raises; returns the first error's message, or ''.")
      .def("ready", &Engine::ready, py::arg("unit"), py::arg("params_only") = false,
           "Whether every announced job of `unit` is done (params_only: its params are final, a copy from them is "
           "safe), without waiting.")
      .def("set_params_first", &Engine::set_params_first, py::arg("on"),
           "A step after the norm stores the params in one pass and the moments in a later one (default on); "
           "off: one pass.")
      .def("swapped", &Engine::swapped, py::arg("unit"),
           "Whether the unit's live state is in its second (alt) buffers: after an odd number of speculative steps.")
      .def("fail", &Engine::fail, py::arg("why"),
           "Fail the engine with `why`: nothing queued runs and every later call raises it, until close().")
      .def("check", &Engine::check, "Raise a failed step's error, if any, without waiting.")
      .def("set_slice_elements", &Engine::set_slice_elements, py::arg("elements"),
           "Elements a job steps before the scheduler chooses again (a lower unit may go first); results do "
           "not depend on it.")
      .def("synchronize", &Engine::synchronize, Release())
      .def("stats", &step_stats)
      .def("inject_failure", &Engine::inject_failure, "Testing aid: the next job stepped fails like a kernel would.")
      .def("fault_next_copy", &Engine::fault_next_copy,
           "Testing aid (simulated device): the next copy faults on its stream as a device error would; it "
           "never lands, and every wait raises the fault.")
      .def("fail_next_copy", &Engine::fail_next_copy,
           "Testing aid: the next copy raises before it is enqueued, as a failing cudaMemcpyAsync would.")
      .def("set_debug_step_delay_us", &Engine::set_debug_step_delay_us, py::arg("us"),
           "Testing aid: each slice of a scheduled job sleeps this long first, as on a slow host.")
      .def("set_debug_delay_us", &Engine::set_debug_delay_us, py::arg("max_us"),
           "Testing aid: before each copy, stall its stream for a random 0..max_us microseconds.");
}
