"""Options: the Offloader's settings, checked before anything is allocated."""
from __future__ import annotations

from dataclasses import dataclass

import torch

# "bf16": bf16 params and moments, rounded to nearest; "bf16-sr": the same buffers, params and exp_avg_sq
# rounded stochastically (offload_ext.optim.stochastic_rounding); "mixed": fp32 master and moments, bf16 params
# for the device.
PRECISIONS = ("bf16", "bf16-sr", "mixed")
BACKENDS = ("native", "python")


@dataclass(frozen=True)
class Options:
    precision: str
    backend: str
    compile_layers: bool
    num_threads: int | None
    pin_threads: bool
    grad_slots: int | None
    slice_elements: int | None
    device_layers: int
    offload_all: bool
    grad_accum: int
    max_grad_norm: float | None
    async_step: bool | None
    host_nice: int = 0

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"Offloader: precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"Offloader: backend must be 'native' or 'python', got {self.backend!r}")
        if self.grad_accum < 1:
            raise ValueError(f"Offloader: grad_accum must be >= 1 (backward() calls per step()), got {self.grad_accum}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"Offloader: max_grad_norm must be > 0 (or None for no clipping), got "
                             f"{self.max_grad_norm}")
        if self.grad_slots is not None and self.grad_slots < 1:
            raise ValueError(f"Offloader: grad_slots must be >= 1 (pinned gradient staging slots), got "
                             f"{self.grad_slots}")
        if self.slice_elements is not None and self.slice_elements < 1:
            raise ValueError(f"Offloader: slice_elements must be >= 1 (elements a host step does before the "
                             f"engine chooses again), got {self.slice_elements}")
        if self.device_layers < 2:
            raise ValueError(f"Offloader: device_layers must be >= 2 (one layer computes while the next is "
                             f"copied), got {self.device_layers}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"Offloader: num_threads must be >= 1 (host step threads), got {self.num_threads}")
        if not 0 <= self.host_nice <= 19:
            raise ValueError(f"Offloader: host_nice must be in [0, 19] (the host-step threads' niceness; 0 keeps the "
                             f"process's priority), got {self.host_nice}")
        if self.backend == "python" and self.host_nice:
            raise ValueError("Offloader: host_nice needs backend='native': the python backend's host steps run on the "
                             "calling thread")
        if self.backend == "python" and (self.async_step or self.slice_elements is not None):
            what = "async_step=True" if self.async_step else "slice_elements"
            raise ValueError(f"Offloader: {what} needs backend='native'; the python backend steps every layer "
                             "inside step(), after backward, by design")


def check_hyper(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    if not lr >= 0:
        raise ValueError(f"Offloader: lr must be >= 0, got {lr}")
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise ValueError(f"Offloader: betas must be two numbers in [0, 1), got {betas}")
    if not eps >= 0:
        raise ValueError(f"Offloader: eps must be >= 0, got {eps}")
    if not weight_decay >= 0:
        raise ValueError(f"Offloader: weight_decay must be >= 0, got {weight_decay}")


def resolve_device(device: str | torch.device) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"Offloader: device={str(device)!r} but CUDA is not available here "
                               "(torch.cuda.is_available() is False); use device='cpu' for the simulated device")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ValueError(f"Offloader: device must be 'cuda', 'cuda:N' or 'cpu' (simulated), got {device!r}")
    return dev
