"""The native engine's part in gradient clipping: the job a landed gradient copy runs while a step clips, the
norm's sums, and the clipped step. The protocol (when to hold, the norm, the scale) is
offload_ext.optim.clipping's; this carries it out on the engine.

Under clipping a unit either waits for the norm (its gradient summed on the host, then one SCALE_STEP) or
speculates: the engine steps it as its last gradients land into second state buffers, keeping the state
before; once the norm is known the step stands, or is redone exactly from that state, clipped: on the host,
or for device_redo_units on the device (offload_ext.engine.device_redo, the backend's).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from offload_ext import ops
from offload_ext.engine.redo_tuning import RedoTuning
from offload_ext.planning.host_sizes import NativeHostPlan


class EngineClipping:
    """Which units speculate, and the engine jobs and calls that clip a step."""

    def __init__(self, jobs: Any, speculative_units: frozenset[int], device_redo_units: frozenset[int],
                 grad_accum: int, redo_candidates: Sequence[tuple[int, frozenset[int]]] = ()) -> None:
        self._jobs = jobs
        # As asked: the host plan may narrow the units, never to none (NativeHostPlan.fitted).
        self.speculative = bool(speculative_units)
        # Speculation over single micro-batches: each unit's gradient lands in a pinned buffer of its own, kept (as
        # its accum) until the norm decides between the step standing and a redo.
        self.keep_grads = self.speculative and grad_accum == 1
        # These units (given second buffers) step as their gradients land; the others wait for the norm.
        self.units = speculative_units
        self.device_redo_units = device_redo_units  # their state is page-locked: the device may redo them
        # which of them the device redoes when clipping triggers: measured among the candidates (none given: all)
        self._candidates = tuple(redo_candidates) or ((len(device_redo_units), device_redo_units),)
        self.tuning = RedoTuning(self._candidates)
        self._device_sq: dict[int, torch.Tensor] = {}  # this step's per-unit sums of squares taken on the device

    def adopt(self, plan: NativeHostPlan) -> None:
        """Speculate (and redo on the device) on the units `plan`'s host memory holds second buffers for."""
        self.units, self.device_redo_units = plan.speculative_units, plan.device_redo_units
        self.tuning = RedoTuning(tuple((layers, units & self.device_redo_units) for layers, units in self._candidates))

    def begin(self) -> None:
        """A step's first micro-batch begins."""
        self._device_sq.clear()

    def hold(self, engine: Any) -> None:
        """No speculative step starts until the clipped step (clipping asks it after a step that was redone)."""
        if self.speculative:
            engine.hold_speculation()

    def job(self, index: int, last: bool) -> Any | None:
        """The job a landed copy of unit `index`'s gradients runs when the step speculates and this is its last
        micro-batch (None otherwise): the norm, followed by a SPECULATIVE_STEP for a unit that speculates
        (then_step), or with the norm taken on the device the speculative step itself."""
        if not (self.speculative and last):
            return None
        if self.device_norm(index, last):
            return self._jobs.SPECULATIVE_STEP
        return self._jobs.NORM if self.keep_grads else self._jobs.ACCUMULATE_NORM

    def device_norm(self, index: int, last: bool) -> bool:
        """Whether unit `index`'s norm is taken on the device, from the gradient about to be copied: a single
        micro-batch's gradient of a unit that speculates (a sum over micro-batches exists on the host only;
        a unit that waits for the norm has its host NORM job mark its landing)."""
        return self.keep_grads and last and index in self.units

    def then_step(self, index: int, last: bool, device_norm: bool) -> bool:
        """Whether the copy's norm job is followed by the unit's speculative step."""
        return last and index in self.units and not device_norm

    def take_device_norm(self, index: int, src: torch.Tensor) -> None:
        """On the stream that produced `src`, before its copy: no host pass over it."""
        self._device_sq[index] = ops.sum_squares(src)

    def sq_norm(self, engine: Any, flushed: set[int]) -> float:
        """The sum of squares of the gradients of the units flushed this step."""
        units = sorted(flushed)
        if self.speculative:
            # Each unit's norm came with its last gradients, ahead of its speculative step; the norms of
            # copies still in flight are announced already, so this waits for them too.
            engine.wait_norms()
            host = sum(engine.sq_norm(u) for u in units if u not in self._device_sq)
            device = float(torch.stack(list(self._device_sq.values())).sum()) if self._device_sq else 0.0
            return host + device
        # The last gradient copies may still be in flight: their accumulate jobs are queued only when
        # they land, and a norm job queued before them would read last micro-batch's sum.
        engine.wait_all()
        for u in units:
            engine.run(u, self._jobs.NORM)
        engine.wait_all()
        return sum(engine.sq_norm(u) for u in units)

    def step(self, engine: Any, flushed: set[int], scale: float,
             redo_on_device: Callable[[int, float], None]) -> None:
        """The norm is known: each flushed unit that waited steps once, clipped or not; clipping triggered, each
        speculative step is redone exactly (the lowest unit first); then the held ones are released."""
        redoing = scale != 1.0 and bool(self.units & flushed)
        self.tuning.observe(time.perf_counter(), redoing)
        on_device = self.tuning.units & self.units & flushed if redoing else frozenset()
        for i in sorted(flushed):
            if i not in self.units:
                engine.run(i, self._jobs.SCALE_STEP, scale)
            elif scale != 1.0 and i not in on_device:
                engine.redo(i, scale)
        for i in sorted(on_device):  # the lowest first: the next forward reaches them in that order
            redo_on_device(i, scale)
        # Held since the norm was known: speculative steps not yet started now step in place (clipped
        # ones became scaled steps in redo()).
        engine.release_speculation()
