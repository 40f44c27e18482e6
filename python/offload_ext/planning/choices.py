"""Choices: what the Offloader decides from a model and its OffloadConfig before allocating anything (the
layout, the step rule, which units speculate, whose clipped redo runs on the device), made once here for the
Offloader and for plan() alike."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from offload_ext.config import CHECKPOINTING, OffloadConfig, eight_bit
from offload_ext.planning.gpu import device_free_bytes
from offload_ext.planning.layout import GroupOf, Layout, Part, device_redo_units, plan_layout, speculative_units


@dataclass(frozen=True)
class Settings:
    """An OffloadConfig and the batch planned for."""

    config: OffloadConfig = OffloadConfig()
    batch_size: int | None = None
    seq_len: int | None = None
    loss_chunk_tokens: int = 4096
    loss_kernel: str = "auto"

    def with_changes(self, **change: Any) -> Settings:
        """These settings with `change` applied: the batch's fields here, any other the config's."""
        batch = {k: v for k, v in change.items() if k != "config" and k in {f.name for f in dataclasses.fields(self)}}
        rest = {k: v for k, v in change.items() if k not in batch}
        return dataclasses.replace(self, config=self.config.replace(**rest) if rest else self.config, **batch)


@dataclass(frozen=True)
class StepRule:
    """When units step: micro-batches per step, where their gradients are summed, and clipping (speculative:
    each unit stepped as its gradients land, redone exactly if the norm clips)."""

    grad_accum: int
    max_grad_norm: float | None
    speculative: bool
    sums_on_device: bool  # micro-batches summed on the device: the host sees one gradient per unit and step

    @property
    def accumulates(self) -> bool:
        """Whether units sum their gradients in host accumulators rather than stepping straight from them."""
        return self.host_grad_accum > 1 or self.max_grad_norm is not None

    @property
    def host_grad_accum(self) -> int:
        """Micro-batches whose gradients reach the host per step."""
        return 1 if self.sums_on_device else self.grad_accum


@dataclass(frozen=True)
class EngineChoices:
    """What the Offloader decides from the model and its settings before allocating anything."""

    layout: Layout
    rule: StepRule
    grad_slots: int | None
    speculative_units: frozenset[int]
    kept_layers: bool  # some streamed layers may run without recompute
    device_redo_units: frozenset[int] = frozenset()  # their clipped redos may run on the device (state pinned)
    # (layers per stack, units) whose redos the device runs, each a subset of device_redo_units: the run measures
    # them in turn and keeps the fastest (offload_ext.engine.redo_tuning); one of them: that one.
    redo_candidates: tuple[tuple[int, frozenset[int]], ...] = ()

    @property
    def sizes(self) -> tuple[tuple[int, int], ...]:
        """(numel, trainable numel) of every stack's unit, what the backend's plan() and prepare() are told."""
        return tuple((u.numel, u.trainable_numel) for part in self.layout.stacks for u in part.units)

    @property
    def own_grads(self) -> tuple[tuple[int, int], ...]:
        """The same for the part outside the stacks (offload_all), whose unit has a gradient buffer of its own."""
        outside = self.layout.outside
        return tuple((u.numel, u.trainable_numel) for u in outside.units) if outside is not None else ()

    def backend_options(self) -> dict[str, Any]:
        """The backend's keyword arguments these choices fix."""
        return dict(grad_slots=self.grad_slots, accumulate=self.rule.accumulates,
                    grad_accum=self.rule.host_grad_accum, speculative_units=self.speculative_units,
                    kept_layers=self.kept_layers,
                    device_redo_units=self.device_redo_units, redo_candidates=self.redo_candidates)


def choose(model: nn.Module, settings: Settings, device: torch.device, group_of: GroupOf,
           free_device: int | None = None) -> EngineChoices:
    """The layout, the step policy and the units that speculate under clipping (`free_device`: what the
    device may still allocate, for the choice of summing micro-batches there; None asks the device)."""
    c, t = settings.config, settings.config.tuning
    layout = plan_layout(model, c.offload_all, group_of, t.resident_layers, c.base_dtype)
    if c.base_dtype is not None and not any(s.quant for u in layout.units for s in u.spans):
        raise ValueError(f"Offloader: base_dtype={c.base_dtype!r} holds the frozen linear weights of the streamed "
                         "layers, and this model's are all trained: it is for LoRA/PEFT, whose base is frozen "
                         "(leave base_dtype=None for a full fine-tune)")
    # Speculative clipping needs the native engine's second state buffers; the python backend clips after backward.
    speculative = t.speculative_clip and t.backend == "native" and c.max_grad_norm is not None
    spec = speculative_units(layout) if speculative else frozenset()
    # no unit that speculates (a frozen base's layers): the plain clipped step, every unit waiting for the norm
    rule = StepRule(c.grad_accum, c.max_grad_norm, speculative and bool(spec),
                    sums_on_device(t.accumulate_on_device, c.grad_accum, layout.parts, device, free_device))
    ckpt, n = c.activation_checkpointing, layout.fewest_stack_layers if layout.stacks else 0
    # a bad spec is refused once the layout is known (check_checkpointing): here it keeps nothing
    kept = (ckpt in CHECKPOINTING or type(ckpt) is int) and checkpointed_count(ckpt, n) < n
    streamed = min((len(part.units) for part in layout.stacks), default=0)  # past it, a count names the same units
    candidates = tuple((min(k, streamed), device_redo_units(layout, k) & spec)
                       for k in device_redo_counts(c, rule.speculative, n))
    redo = frozenset().union(*(units for _, units in candidates))
    return EngineChoices(layout, rule, t.grad_slots, spec, kept, redo, candidates)


def device_redo_counts(c: OffloadConfig, speculative: bool, stack_layers: int) -> tuple[int, ...]:
    """How many top layers of each stack may redo a clipped step on the device: the count asked, or (None) the
    candidates the run measures, a third first. It needs speculation over single micro-batches (each layer's
    gradient kept on the host), in "bf16", "mixed" or the 8-bit precisions (the bf16 CUDA kernel has no stochastic
    rounding, the 8-bit one has). The next forward runs each host-redone layer as its redo ends, then the
    device-redone ones, which must be ready by then: with g ms of device copies per layer, c ms of host redo and
    a ms of forward, that asks the host to keep n (g - a) / (g - a + c) layers (B1: g ~12.5, c ~9, a ~3.3: half).
    Measured, B1 lost more than that model says as the device took more layers (a third or less gained up to
    7 %, half and more lost up to 10 %; B2 with half: 18 % faster than none): so the run measures a third, half,
    a sixth and none, and keeps the fastest (offload_ext.engine.redo_tuning). In 8 bits also two thirds: a
    device redo copies half the bytes of bf16's, and the host's pass is 1.8x longer."""
    applies = speculative and c.grad_accum == 1 and c.precision in ("bf16", "mixed", "bf16-8bit", "bf16-8bit-sr")
    asked = c.tuning.device_redo_layers
    if asked is None:
        if not applies:
            return (0,)
        more = (2 * stack_layers // 3,) if eight_bit(c.precision) else ()
        return tuple(dict.fromkeys((stack_layers // 3, stack_layers // 2, *more, stack_layers // 6, 0)))
    if type(asked) is not int or not 0 <= asked <= stack_layers:
        raise ValueError(f"Offloader: device_redo_layers must be None (chosen) or an int in [0, {stack_layers}] "
                         f"(layers of the shortest stack), got {asked!r}")
    if asked and not applies:
        raise ValueError("Offloader: device_redo_layers > 0 needs speculative clipping of single micro-batches "
                         "(max_grad_norm set, speculative_clip=True, backend='native', grad_accum=1) in precision "
                         f"'bf16', 'mixed', 'bf16-8bit' or 'bf16-8bit-sr'; got precision={c.precision!r}, "
                         f"grad_accum={c.grad_accum}, speculative={speculative}: pass device_redo_layers=None or 0")
    return (asked,)


def sums_on_device(choice: bool | None, grad_accum: int, parts: Sequence[Part], device: torch.device,
                   free: int | None = None) -> bool:
    """Whether gradients of several micro-batches are summed on the device (one copy to the host per step)
    rather than on the host (one per micro-batch). None chooses: on a GPU, when the sums (2 bytes per
    trainable streamed parameter) take at most a quarter of what this process may still allocate there
    (`free`, else asked of the device); on the simulated device, not (pass True to run that path there)."""
    if grad_accum == 1:
        return False
    if choice is not None:
        return choice
    if device.type != "cuda":
        return False
    need = 2 * sum(u.trainable_numel for part in parts for u in part.units)
    return need <= (device_free_bytes(device) if free is None else free) / 4


def checkpointed_count(spec: str | int, layers: int) -> int:
    """How many of a stack's lowest layers recompute. "auto" starts by keeping the top one: what it saves in
    the first step is what the choice is measured from."""
    if spec == "all":
        return layers
    if spec == "none":
        return 0
    if spec == "auto":
        return layers - 1
    return int(spec)


def check_checkpointing(spec: str | int, shortest: int, gpu_memory_budget: int | None,
                        device: torch.device) -> None:
    """Raise on a bad activation_checkpointing (before anything is allocated); `shortest` is the fewest layers
    a stack has (resident and streamed)."""
    named = isinstance(spec, str) and spec in CHECKPOINTING
    if isinstance(spec, bool) or not (named or isinstance(spec, int)):
        raise ValueError(f"Offloader: activation_checkpointing must be one of {CHECKPOINTING} or a number of layers "
                         f"per stack, got {spec!r}")
    if isinstance(spec, int) and not 0 <= spec <= shortest:
        raise ValueError(f"Offloader: activation_checkpointing={spec} layers, but a stack has {shortest}: give a "
                         f"number in [0, {shortest}] (0 is 'none', {shortest} is 'all')")
    if gpu_memory_budget is not None and (spec != "auto" or gpu_memory_budget <= 0):
        raise ValueError(f"Offloader: gpu_memory_budget={gpu_memory_budget!r} is read by "
                         "activation_checkpointing='auto' only, and must be a positive number of bytes")
    if spec == "auto" and device.type != "cuda" and gpu_memory_budget is None:
        raise ValueError("Offloader: activation_checkpointing='auto' on the simulated device needs gpu_memory_budget "
                         "(bytes the kept layers' saved tensors may take): there is no allocator to ask")
