"""offload-train's GPU warm-up thread: it runs a layer's kinds of work, hands its errors to the joining thread,
leaves the run's generators as they were and keeps no memory of its own."""
from __future__ import annotations

import pytest
import torch

from offload_ext.train import gpu_warmup
from offload_ext.train.gpu_warmup import GpuWarmup


def test_the_warmup_runs_a_layers_work_and_joins_cleanly_on_the_cpu() -> None:
    GpuWarmup(torch.device("cpu"), seq_len=64).join()


def test_a_device_that_cannot_be_used_is_a_clear_error_naming_it() -> None:
    with pytest.raises(RuntimeError, match=r"warming the GPU libraries on cuda:99 failed"):
        # no machine here has a hundredth GPU: refused when CUDA starts (no GPU) or on the thread (a GPU machine)
        GpuWarmup(torch.device("cuda", 99), seq_len=64).join()


def test_an_error_on_the_warmup_thread_is_raised_by_join_on_the_callers_thread(monkeypatch) -> None:
    def broken(device: torch.device, seq_len: int) -> None:
        raise ValueError("no kernel image for this device")  # what a wrong build's first launch says

    monkeypatch.setattr(gpu_warmup, "_warm", broken)
    warmup = GpuWarmup(torch.device("cpu"), seq_len=64)
    with pytest.raises(RuntimeError, match=r"on cpu failed: ValueError: no kernel image for this device"):
        warmup.join()


@pytest.mark.gpu
def test_the_warmup_leaves_the_cuda_generator_as_it_was_and_keeps_no_memory_of_its_own() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(3)
    rng = torch.cuda.get_rng_state(device)
    GpuWarmup(device, seq_len=4096).join()
    assert torch.equal(torch.cuda.get_rng_state(device), rng)
    # cuBLAS's workspaces (32 MiB each for cuBLAS and cuBLASLt on Hopper) stay with the handle the thread gave
    # back to torch's pool, for the next thread that takes it; a second warm-up takes the same handle, so
    # anything more would be the warm-up's own tensors, kept.
    allocated = torch.cuda.memory_allocated(device)
    GpuWarmup(device, seq_len=4096).join()
    assert torch.cuda.memory_allocated(device) == allocated
