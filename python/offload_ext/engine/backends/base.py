"""The interface between the Offloader's hooks and a backend, and the per-layer host buffers both use (with their
optimizer state in each precision)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from offload_ext.config import eight_bit, moment_dtype
from offload_ext.engine.redo_tuning import RedoTuning
from offload_ext.optim.clipping import sq_sum
from offload_ext.optim.eight_bit import num_blocks, zero_code
from offload_ext.planning.host_sizes import absmax_slots


@dataclass(frozen=True)
class Hyper:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int  # 1-based count for bias correction


@dataclass
class LayerBuffers:
    """One streamed layer on the host. `params` is laid out trainable-first, then frozen."""

    params: torch.Tensor            # bf16, pinned: the H2D source
    grads: torch.Tensor             # bf16, pinned: the D2H target (trainable part only; the native
                                    # backend's layers share a small ring of these)
    exp_avg: torch.Tensor           # bf16 ("bf16", "bf16-sr"), fp32 ("mixed") or uint8 codes (8-bit)
    exp_avg_sq: torch.Tensor
    master: torch.Tensor | None     # fp32 master of the trainable part ("mixed" only)
    trainable: int                  # numel of the trainable prefix
    accum: torch.Tensor | None = None  # bf16 gradient sum over micro-batches (accumulation or clipping)
    # Speculative clipping (native): second buffers like (params or master, exp_avg, exp_avg_sq). A speculative
    # step writes the new state there and they swap roles; the old state stays for a redo. In "bf16" the
    # first is a whole second params buffer, page-locked, that the next forward copies from once swapped;
    # its frozen tail mirrors params' (mirror_frozen). The engine holds raw pointers: these keep them alive.
    alt: tuple[torch.Tensor, ...] = ()
    swapped: bool = False  # the fields below point at what was allocated as alt
    # 8-bit precisions: each moment's fp32 absmaxes, one a block of each group range (second buffers: alt's last two)
    exp_avg_absmax: torch.Tensor | None = None
    exp_avg_sq_absmax: torch.Tensor | None = None

    @property
    def trainable_params(self) -> torch.Tensor:
        return self.params[: self.trainable]

    def release_state(self) -> None:
        """Training is over: keep the weights (params), let the gradient buffers and optimizer state go."""
        self.grads = self.exp_avg = self.exp_avg_sq = self.params.new_empty(0)
        self.master, self.accum, self.alt = None, None, ()
        self.exp_avg_absmax = self.exp_avg_sq_absmax = None

    def swap_state(self) -> None:
        """A speculative step left the live state in the second buffers: swap the fields' roles."""
        param, exp_avg, exp_avg_sq, *absmax = self.alt
        if self.master is not None:  # mixed: the master moved
            self.master, param = param, self.master
        else:
            self.params, param = param, self.params
        self.exp_avg, exp_avg = exp_avg, self.exp_avg
        self.exp_avg_sq, exp_avg_sq = exp_avg_sq, self.exp_avg_sq
        if absmax:
            self.exp_avg_absmax, absmax[0] = absmax[0], self.exp_avg_absmax
            self.exp_avg_sq_absmax, absmax[1] = absmax[1], self.exp_avg_sq_absmax
        self.alt = (param, exp_avg, exp_avg_sq, *absmax)
        self.swapped = not self.swapped

    def mirror_frozen(self) -> None:
        """After params were written: the second params buffer ("bf16" speculation) gets the frozen tail
        too, which no step writes, so that a forward copying from either buffer sees the same weights."""
        if self.alt and self.master is None and self.trainable < self.params.numel():
            self.alt[0][self.trainable:].copy_(self.params[self.trainable:])


Alloc = Callable[[int, torch.dtype], torch.Tensor]  # the engine's host_zeros, or the page-locked zeros


def moments(zeros: Alloc, precision: str, trainable: int) -> tuple[torch.Tensor, torch.Tensor]:
    """exp_avg and exp_avg_sq at zero: 8-bit, each the code of 0 in its map."""
    pair = tuple(zeros(trainable, moment_dtype(precision)) for _ in range(2))
    if eight_bit(precision):
        for which, moment in enumerate(pair):
            moment.fill_(zero_code(which))
    return pair


def absmaxes(zeros: Alloc, precision: str, trainable: int, groups: tuple[tuple[int, int, int], ...] | None
             ) -> tuple[torch.Tensor, ...]:
    """8-bit: each moment's absmaxes at zero, one a block of each group range (views of the planned slots, which
    hold two ranges' worth: absmax_slots); none in the other precisions."""
    if not eight_bit(precision):
        return ()
    need = sum(num_blocks(end - begin) for _, begin, end in groups or ((0, 0, trainable),))
    slots = max(need, absmax_slots(trainable))
    return tuple(zeros(slots, torch.float32)[:need] for _ in range(2))


class Backend(ABC):
    """Memory, copies and the host-side AdamW of the streamed layers.

    Events are opaque: whatever `load`/`flush_grads` return is only handed back to `compute_wait`.
    """

    asynchronous = False  # finish_step may return before the layers are stepped

    def __init__(self, device: torch.device, precision: str, accumulate: bool = False) -> None:
        self.device = device
        self.precision = precision
        self.accumulate = accumulate  # layers sum their gradients in host accumulators (accum)
        self._first_micro, self._last_micro = True, True

    def plan(self, sizes: list[tuple[int, int]], own_grads: list[tuple[int, int]] = ()) -> None:
        """Told first the (numel, trainable numel) of every layer to come (and the units that will ask for a
        gradient buffer of their own): raise now, allocating nothing, if this machine cannot hold them."""

    def prepare(self, sizes: list[tuple[int, int]], own_grads: list[tuple[int, int]] = ()) -> None:
        """Told once, before new_layer, the (numel, trainable numel) of every layer to come; `own_grads`
        are units that will ask for a gradient buffer of their own."""

    @abstractmethod
    def new_layer(self, numel: int, trainable: int, own_grads: bool = False,
                  groups: tuple[tuple[int, int, int], ...] | None = None) -> LayerBuffers:
        """Host buffers for one layer: params (and master) for the caller to fill, zeroed moments.
        `groups`: (param group, begin, end) ranges over the trainable prefix, each stepped with its
        group's hyperparameters (None: all of it in group 0)."""

    def device_buffer(self, numel: int) -> torch.Tensor:
        """A bf16 buffer on the (possibly simulated) device."""
        return torch.zeros(numel, dtype=torch.bfloat16, device=self.device)

    @abstractmethod
    def load(self, index: int, layer: LayerBuffers, dst: torch.Tensor, after: Any = None) -> Any:
        """Copy layer `index`'s params host -> dst once the compute stream has reached this point (or the
        earlier one `after`, from mark_compute()) and the layer's pending host step (if any) is done."""

    def mark_compute(self) -> Any:
        """The compute stream's point now, for a load issued later that need not wait for the compute
        enqueued in between (None on the simulated device, whose compute is the calling thread)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def ready(self, index: int) -> bool:
        """Whether layer `index` has no host step pending, so `load` would not block."""
        return True

    @abstractmethod
    def compute_wait(self, event: Any) -> None:
        """Make the compute stream wait for a copy."""

    @abstractmethod
    def flush_grads(self, index: int, layer: LayerBuffers, src: torch.Tensor) -> Any:
        """Copy a layer's gathered grads device -> host once compute has produced them; then step it."""

    @abstractmethod
    def begin_step(self, hypers: list[Hyper]) -> None:
        """Hyperparameters, one per param group, for the layers stepped in the coming backward."""

    def begin_micro(self, first: bool, last: bool) -> None:
        """The coming backward is the first and/or last micro-batch of a step (gradient accumulation):
        only a `last` one steps layers as their gradients land; the others (and all of them when the
        step clips gradients) only accumulate the layers' gradients on the host."""
        self._first_micro, self._last_micro = first, last

    def hold_speculation(self) -> None:
        """Until clipped_step, no speculative step starts: each waits for the norm (offload_ext.optim.clipping
        asks it after a step that was redone). A backend that does not speculate has none to hold."""

    def device_sq_norm(self, grads: list[torch.Tensor]) -> torch.Tensor | float:
        """The float64 sum of squares over gradients on the device (the parameters kept there), queued
        without a sync (the caller reads it after the host norms): clip_grad_norm_'s rule, squares summed
        in float64."""
        if not grads:
            return 0.0
        return torch.stack([sq_sum(g) for g in grads]).sum()

    def grad_sq_norm(self) -> float:
        """Sum of squares of the accumulated gradients of the layers flushed since the first micro-batch."""
        raise NotImplementedError(f"{type(self).__name__} cannot clip gradients")

    def clipped_step(self, scale: float) -> None:
        """The norm is known: the layers that waited for it step with their accumulated gradients scaled
        (rounded to bf16, as torch's clipping does); speculative steps are committed (scale 1) or redone
        exactly, clipped; the held ones are released."""
        raise NotImplementedError(f"{type(self).__name__} cannot clip gradients")

    @abstractmethod
    def finish_step(self) -> float:
        """End the step: every layer flushed since begin_step has been stepped, or (an asynchronous
        backend) is queued and will be before it is next loaded. Returns the seconds spent waiting."""

    def settle(self) -> None:
        """Block until no host step is pending (before host buffers are read or written)."""

    def wait_seconds(self) -> float:
        """Seconds the calling thread has spent blocked on host steps so far."""
        return 0.0

    def stats(self) -> dict[str, Any]:
        return {}

    # Testing aids (offload_ext.testing): timing and failures a test cannot otherwise bring about.
    # A backend that cannot provide one raises NotImplementedError saying why.

    def set_copy_delay(self, max_us: int) -> None:
        """Before each copy, stall it a random 0..max_us microseconds (0 turns it off)."""
        raise NotImplementedError(f"{type(self).__name__} cannot delay its copies")

    def set_step_delay(self, us: int) -> None:
        """Each slice of a host step sleeps `us` microseconds first, as on a slow host (0 turns it off)."""
        raise NotImplementedError(f"{type(self).__name__} cannot delay its host steps")

    def fail_next_step(self) -> None:
        """The next host step fails as a real kernel failure would (its message says "injected failure")."""
        raise NotImplementedError(f"{type(self).__name__} cannot inject a step failure")

    def fail_next_copy(self) -> None:
        """The next copy raises while being enqueued (its message says "injected copy failure")."""
        raise NotImplementedError(f"{type(self).__name__} cannot inject a copy failure")

    def fault_next_copy(self) -> None:
        """The next copy faults on its stream as a device error would: it never lands, and every wait raises."""
        raise NotImplementedError(f"{type(self).__name__} cannot simulate a device fault")

    def fail(self, why: str) -> None:
        """The caller found the step broken: no host step queued runs from now on (a backend that steps only
        inside step() has none queued)."""

    @property
    def device_redo_units(self) -> frozenset[int]:
        """Units whose clipped redos run on the device now (engine.device_redo): none unless a backend does it."""
        return frozenset()

    @property
    def redo_tuning(self) -> RedoTuning | None:
        """The measurement that chooses how many layers the device redoes (engine.redo_tuning), if any."""
        return None

    def pending_units(self) -> list[int]:
        """Indices (in new_layer order) of the layers whose host step is not finished."""
        raise NotImplementedError(f"{type(self).__name__} cannot report pending host steps")

    def start_trace(self) -> None:
        """Record the backend's timeline (copies, host steps, waits) from now on."""

    def stop_trace(self) -> list[tuple[str, str, int, int, int]]:
        """Stop recording; the events as (lane, name, begin_ns, end_ns, unit) on time.monotonic_ns()."""
        return []

    def close(self) -> str | None:
        """Stop all work, whatever failed before; never raises. Returns the first error, if any."""
        return None

    def release_memory(self) -> None:
        """After close(), once the layers let their state go (LayerBuffers.release_state): free what only
        stepping needed, so that the weights copied out next do not come on top of it."""
