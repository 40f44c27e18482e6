"""Shared test fixtures: the kernel settings are process-wide, so tests restore them."""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch

import offload_ext


def pytest_configure(config) -> None:
    # offload-train's machine-wide cache of the embedded corpus (offload_ext.train.data.cache_dir): one of the
    # session's own, shared by its tests and the processes they start, never the user's; gone at its end.
    config.offload_ext_cache = tempfile.mkdtemp(prefix="offload_ext_cache_")
    os.environ["OFFLOAD_EXT_CACHE"] = config.offload_ext_cache


def pytest_collection_modifyitems(config, items) -> None:
    # The one CUDA marker (pytest.mark.gpu, declared in pyproject.toml): without a CUDA device its tests skip.
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_unconfigure(config) -> None:
    shutil.rmtree(getattr(config, "offload_ext_cache", ""), ignore_errors=True)


@pytest.fixture
def restore_kernel_settings():
    native = offload_ext.ops.native()
    threads = offload_ext.get_num_threads()
    level = offload_ext.build_info()["simd"]
    tuning = native.memory_tuning()
    yield
    offload_ext.set_num_threads(threads)
    offload_ext.set_simd_level(level)
    native.set_memory_tuning(*tuning)


def bf16_ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable bf16 values lie between a and b, elementwise (0 = identical)."""

    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.contiguous().view(torch.int16).to(torch.int32)
        # Map sign-magnitude bit patterns onto a monotonic integer line.
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)

    return (ordered(a) - ordered(b)).abs()
