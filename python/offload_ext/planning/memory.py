"""Memory model: the host RAM (pinned and pageable) and the GPU memory a model needs under the Offloader's
settings, and the largest batch x seq that fits, all worked out from shapes before anything is allocated.

The Offloader takes its decisions (layout, step policy, which units speculate) from `choose`
(planning/choices.py), its backend sizes its host buffers with planning/host_sizes.py, and its device parts
allocate what `DeviceFacts` counts (planning/gpu.py), so a plan and a real run share one computation. The host
figures are exact: the blocks the engine reserves. The GPU figures count each device buffer the way it is
allocated, and for activations a Llama-style decoder layer and the chunked loss (`layer_activation_bytes`,
`loss_rows`: what a checkpointed layer's and the loss's live tensors add up to, see their docstrings); what
torch's allocator statistics do not see is a stated margin. planning/plan.py turns these into offload_ext.plan
and the refusals.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from offload_ext.planning.choices import EngineChoices, Settings, checkpointed_count, choose
from offload_ext.planning.gpu import GpuEstimate, Shape, gpu_estimate
from offload_ext.planning.host_sizes import (
    Alternative,
    HostNeed,
    NativeHostPlan,
    frozen_units,
    proc_bytes,
    python_alternatives,
    python_host_need,
)
from offload_ext.planning.layout import GroupOf

_GB = 1e9
# Host memory of the CUDA runtime and torch's CUDA kernels once a context exists (an estimate: the GPU
# machine's processes held about 2 GB before their first buffer, the interpreter and torch included).
CUDA_HOST = 1_500_000_000


# ---------------------------------------------------------------------------------------------- host


@dataclass(frozen=True)
class HostPlan:
    need: HostNeed
    alternatives: tuple[Alternative, ...]
    speculating: tuple[int, int] | None  # (units that speculate, units asked to) under speculative clipping


def host_plan(choices: EngineChoices, backend: str, precision: str, available: int | None,
              frozen: bool = False) -> HostPlan:
    """The backend's host buffers for these choices, as its plan() reserves them (`frozen`: every parameter
    frozen, as under LoRA with its adapters not counted)."""
    sizes, own = choices.sizes, choices.own_grads
    spec = choices.speculative_units
    if frozen:
        sizes, own, spec = frozen_units(sizes), frozen_units(own), frozenset()
    if backend == "native":
        asked = NativeHostPlan.choose(precision, sizes, own, grad_slots=choices.grad_slots,
                                      accumulate=choices.rule.accumulates, speculative_units=spec,
                                      grad_accum=choices.rule.host_grad_accum, kept_layers=choices.kept_layers,
                                      device_redo_units=choices.device_redo_units)
        fitted = asked.fitted(available)
        counts = (len(fitted.speculative_units), len(asked.speculative_units)) if asked.speculative_units else None
        return HostPlan(fitted.need(), tuple(fitted.alternatives()), counts)
    args = (precision, sizes, own, choices.rule.accumulates)
    return HostPlan(python_host_need(*args), tuple(python_alternatives(*args)), None)


def process_rss() -> int:
    """This process's resident memory now (0 where /proc is missing)."""
    return proc_bytes("/proc/self/status", "VmRSS").get("VmRSS", 0)


def process_peak_rss() -> int:
    """The most resident memory this process has held so far (0 where /proc is missing): what a plan's expected
    peak RSS is checked against."""
    return proc_bytes("/proc/self/status", "VmHWM").get("VmHWM", 0)


# ---------------------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Machine:
    """What the plan is for: the device, and the memory each side has available (None: unknown)."""

    device: torch.device
    host_available: int | None
    gpu_available: int | None
    gpu_total: int | None = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


@dataclass(frozen=True)
class Evaluation:
    """One setting's figures on one machine."""

    settings: Settings
    choices: EngineChoices
    host: HostPlan
    gpu: GpuEstimate

    def host_fits(self, machine: Machine) -> bool:
        return machine.host_available is None or self.host.need.total <= machine.host_available

    def gpu_fits(self, machine: Machine) -> bool:
        return machine.gpu_available is None or self.gpu.needed <= machine.gpu_available

    def fits(self, machine: Machine) -> bool:
        return self.host_fits(machine) and self.gpu_fits(machine)


def _native_loss(settings: Settings, machine: Machine) -> bool:
    """Whether the loss's cross-entropy is the extension's: "auto" picks it on CUDA (losses.resolve_loss_kernel;
    a CUDA device planned from elsewhere is taken to have the CUDA build)."""
    return settings.loss_kernel == "native" or (settings.loss_kernel == "auto" and machine.cuda)


def evaluate(model: nn.Module, settings: Settings, machine: Machine, group_of: GroupOf = lambda p: 0,
             frozen: bool = False) -> Evaluation:
    """The figures of `settings` on `machine` (`frozen`: as LoRA would train, every base parameter frozen)."""
    s = settings
    choices = choose(model, s, machine.device, group_of, machine.gpu_available if machine.cuda else None)
    host = host_plan(choices, s.config.tuning.backend, s.config.precision, machine.host_available, frozen)
    return Evaluation(s, choices, host, _gpu_at(model, s, choices, machine, s.batch_size, s.seq_len, frozen))


def _gpu_at(model: nn.Module, s: Settings, choices: EngineChoices, machine: Machine, batch: int | None,
            seq: int | None, frozen: bool = False) -> GpuEstimate:
    c = s.config
    return gpu_estimate(model, choices, c.precision, c.tuning.device_layers, machine.cuda, batch, seq,
                        s.loss_chunk_tokens, _native_loss(s, machine), frozen, kept_per_stack(s, choices),
                        c.activation_offload)


def kept_per_stack(s: Settings, choices: EngineChoices) -> int:
    """The layers of each stack the plan counts as kept ("auto": none, as "all")."""
    spec = "all" if s.config.activation_checkpointing == "auto" else s.config.activation_checkpointing
    layers = choices.layout.fewest_stack_layers
    return layers - checkpointed_count(spec, layers)


def host_activation_bytes(model: nn.Module, s: Settings, choices: EngineChoices) -> int:
    """activation_offload's host slots for the planned batch: one bf16 input per checkpointed layer."""
    shape = Shape.of(model)
    if not s.config.activation_offload or not s.batch_size or not s.seq_len or shape is None:
        return 0
    layout = choices.layout
    checkpointed = layout.stack_layers - kept_per_stack(s, choices) * len(layout.stacks)
    return checkpointed * 2 * s.batch_size * s.seq_len * shape.hidden


def _largest(fits: Callable[[int], bool], limit: int = 1 << 24) -> int:
    """The largest n in [1, limit] with fits(n) (fits decreasing in n), 0 if none."""
    if not fits(1):
        return 0
    low = 1
    while low < limit and fits(min(2 * low, limit)):
        low = min(2 * low, limit)
    high = min(2 * low, limit + 1)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def largest_batch(model: nn.Module, ev: Evaluation, machine: Machine, seq: int) -> int:
    """The largest batch of `seq` tokens whose step fits the device (0: none; host memory does not depend on it)."""
    return _largest(lambda b: _gpu_at(model, ev.settings, ev.choices, machine, b, seq).needed <= machine.gpu_available)


def largest_seq(model: nn.Module, ev: Evaluation, machine: Machine) -> int:
    """The longest sequence whose step at batch 1 fits the device (0: none)."""
    return _largest(lambda n: _gpu_at(model, ev.settings, ev.choices, machine, 1, n).needed <= machine.gpu_available)
