// The Python surface of offload_ext._C: torch ops with schemas for the kernels (torch.ops.offload_ext.*)
// and a small pybind11 module for the library's settings and build facts.
#include <torch/extension.h>
#include <torch/version.h>

#ifdef OFFLOAD_EXT_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#include "adamw.h"
#include "thread_pool.h"

namespace offload_ext {
namespace {

// Numbers in messages go through std::to_string, not iostreams: see the note in README
// ("Building on the GPU machine") on the libstdc++ a newer compiler leaves behind.
std::string num(int64_t x) { return std::to_string(x); }
std::string num(double x) { return std::to_string(x); }

void check_span(const at::Tensor& t, const char* name, int64_t numel) {
  TORCH_CHECK(t.device().is_cpu(), "adamw_step: expected ", name, " on the CPU, got a tensor on ", t.device());
  TORCH_CHECK(t.is_contiguous(), "adamw_step: expected ", name,
              " to be contiguous (the kernel steps one flat span); call .contiguous() on it first");
  TORCH_CHECK(t.numel() == numel, "adamw_step: expected ", name, " to have ", num(numel),
              " elements like param, got ", num(t.numel()));
}

void check_dtype(const at::Tensor& t, const char* name, at::ScalarType expected, const char* mode) {
  TORCH_CHECK(t.scalar_type() == expected, "adamw_step: in ", mode, " mode expected ", name, " of dtype ",
              expected, ", got ", t.scalar_type());
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
  const int64_t n = param.numel();
  check_span(param, "param", n);
  check_span(grad, "grad", n);
  check_span(exp_avg, "exp_avg", n);
  check_span(exp_avg_sq, "exp_avg_sq", n);
  const AdamWHyper h{lr, beta1, beta2, eps, weight_decay, step};
  auto pool = global_pool();
  const SimdLevel level = active_simd_level();

  if (param.scalar_type() == at::kBFloat16) {
    const char* mode = "bf16 (bf16 param)";
    check_dtype(grad, "grad", at::kBFloat16, mode);
    check_dtype(exp_avg, "exp_avg", at::kBFloat16, mode);
    check_dtype(exp_avg_sq, "exp_avg_sq", at::kBFloat16, mode);
    TORCH_CHECK(!param_out.has_value(), "adamw_step: param_out is only for fp32 master params; "
                "a bf16 param is updated in place");
    auto bits = [](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); };
    adamw_bf16(bits(param), bits(grad), bits(exp_avg), bits(exp_avg_sq), n, h, *pool, level);
    return;
  }
  TORCH_CHECK(param.scalar_type() == at::kFloat, "adamw_step: expected param of dtype bfloat16 (bf16 mode) or ",
              "float32 (fp32/mixed mode), got ", param.scalar_type());
  const char* mode = "fp32/mixed (float32 param)";
  check_dtype(exp_avg, "exp_avg", at::kFloat, mode);
  check_dtype(exp_avg_sq, "exp_avg_sq", at::kFloat, mode);
  TORCH_CHECK(grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kBFloat16, "adamw_step: in ", mode,
              " mode expected grad of dtype float32 or bfloat16, got ", grad.scalar_type());
  uint16_t* out = nullptr;
  if (param_out.has_value()) {
    check_span(*param_out, "param_out", n);
    check_dtype(*param_out, "param_out", at::kBFloat16, mode);
    out = reinterpret_cast<uint16_t*>(param_out->data_ptr());
  }
  const GradType gt = grad.scalar_type() == at::kBFloat16 ? GradType::kBF16 : GradType::kFP32;
  adamw_fp32(param.data_ptr<float>(), grad.data_ptr(), gt, exp_avg.data_ptr<float>(), exp_avg_sq.data_ptr<float>(),
             out, n, h, *pool, level);
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

}  // namespace
}  // namespace offload_ext

TORCH_LIBRARY(offload_ext, m) {
  m.def(
      "adamw_step(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
      "Tensor(d!)? param_out, float lr, float beta1, float beta2, float eps, float weight_decay, int step) -> ()");
}

TORCH_LIBRARY_IMPL(offload_ext, CPU, m) {
  m.impl("adamw_step", &offload_ext::adamw_step);
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
  m.def("cuda_device_count", &offload_ext::cuda_device_count,
        "CUDA devices seen through the CUDA runtime this extension was compiled against (0 in a CPU build).");
}
