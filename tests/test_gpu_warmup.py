"""offload-train's GPU warm-up thread: it runs a layer's kinds of work, hands its errors to the joining thread,
and leaves the run's generators and memory as they were."""
from __future__ import annotations

import pytest
import torch

from offload_ext.gpu_warmup import GpuWarmup


def test_the_warmup_runs_a_layers_work_and_joins_cleanly_on_the_cpu() -> None:
    GpuWarmup(torch.device("cpu"), seq_len=64).join()


def test_a_warmup_error_is_raised_on_the_joining_thread_naming_the_device() -> None:
    warmup = GpuWarmup(torch.device("cuda", 99), seq_len=64)  # no machine here has a hundredth GPU
    with pytest.raises(RuntimeError, match=r"warming the GPU libraries on cuda:99 failed"):
        warmup.join()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_warmup_leaves_the_cuda_generator_and_allocated_memory_as_they_were() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(3)
    rng, allocated = torch.cuda.get_rng_state(device), torch.cuda.memory_allocated(device)
    GpuWarmup(device, seq_len=4096).join()
    assert torch.equal(torch.cuda.get_rng_state(device), rng)
    assert torch.cuda.memory_allocated(device) == allocated
