"""build_info() reports what was built; CI (OFFLOAD_EXT_EXPECT_CUDA=1) insists the CUDA parts were."""
from __future__ import annotations

import os

import pytest
import torch

import offload_ext


def test_build_info_reports_version_torch_simd_and_threads() -> None:
    info = offload_ext.build_info()
    assert info["version"] == offload_ext.__version__
    assert info["native"] is True
    assert info["torch_built_against"] == torch.__version__.split("+")[0]
    assert info["simd"] in offload_ext.ops.SIMD_LEVELS
    assert info["num_threads"] == offload_ext.get_num_threads() >= 1
    assert isinstance(info["cuda"], bool)


@pytest.mark.skipif(os.environ.get("OFFLOAD_EXT_EXPECT_CUDA") != "1", reason="set by CI, which builds with CUDA")
def test_cuda_parts_were_compiled() -> None:
    info = offload_ext.build_info()
    assert info["cuda"] is True, info
    assert info["cuda_runtime_compiled"] == torch.version.cuda
    for op in ("cross_entropy_rows", "cross_entropy_rows_backward"):  # the *.cu kernels are in the build
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"offload_ext::{op}", "CUDA"), op


def test_standalone_kernels_use_every_usable_cpu_by_default() -> None:
    assert offload_ext.ops.default_num_threads() == len(os.sched_getaffinity(0))


def test_a_build_without_a_gpu_targets_the_architectures_torch_was_built_for(monkeypatch) -> None:
    from offload_ext import _build

    home = _build.find_cuda_home()
    if home is None:
        pytest.skip("no CUDA toolkit here")
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    said = _build.choose_arch_list(False, ["sm_80", "sm_90", "compute_90"], home)
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0+PTX"
    assert "TORCH_CUDA_ARCH_LIST=8.0;9.0+PTX" in said and "no GPU visible" in said


def test_a_given_arch_list_or_a_visible_gpu_is_left_to_torch(monkeypatch) -> None:
    from offload_ext import _build

    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert "from the environment" in _build.choose_arch_list(False, ["sm_80"], "/nonexistent")
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0"
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    assert "visible GPU" in _build.choose_arch_list(True, ["sm_80"], "/nonexistent")
    assert "TORCH_CUDA_ARCH_LIST" not in os.environ
