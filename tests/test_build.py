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
    assert info["simd"] in ("scalar", "avx2", "avx512")
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
