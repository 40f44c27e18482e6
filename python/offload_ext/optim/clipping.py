"""Gradient clipping by the global norm, one rule for the Offloader and CPUAdamW, and the protocol of steps
taken before the norm is known (speculation).

The rule is torch.nn.utils.clip_grad_norm_'s: each gradient's squares summed in float64 (`sq_sum`; `sum_squares`
where the extension's one-pass op takes the gradient: the same exact squares summed in another order), the norm
the square root of their total, scale = min(1, max_norm / (norm + 1e-6)), each gradient multiplied by it in
its own dtype before its step. A non-finite norm is refused, as clip_grad_norm_(error_if_nonfinite=True)
refuses it: min(1.0, nan) is 1.0, and an unclipped step would otherwise be taken silently.

Speculation: a unit may be stepped as its gradients land, as if no clipping were needed, with the state
before the step kept. Once the norm is known such steps are committed (scale 1) or redone exactly from the
state before, with the scaled gradients; the units that waited for the norm step then. After a step whose
speculative steps were redone, clipping tends to trigger again: the next step's are held (not run in
backward, where they would be wasted work) until the norm is known, then released.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch

from offload_ext import ops


def sq_sum(t: torch.Tensor) -> torch.Tensor:
    """The float64 sum of the squares of `t`'s elements, as a 0-dim tensor on its device (no sync)."""
    return t.double().pow(2).sum()


def sum_squares(t: torch.Tensor) -> torch.Tensor:
    """sq_sum's sum, of the same exact squares in another order (within (n - 1) 2^-53 of it, relative), by one read
    of `t` where the extension takes it (a contiguous bf16 tensor on a device it is built for, or fp32 on the
    CPU): sq_sum copies `t` to float64, squares and sums, three passes over 8 bytes an element and two fresh
    allocations of that size, tens of seconds a step over an 8 B model's gradients on the host."""
    takes = t.dtype == torch.bfloat16 or (t.dtype == torch.float32 and t.device.type == "cpu")
    if takes and t.is_contiguous() and ops.native_on(t.device.type):
        return ops.sum_squares(t)
    return sq_sum(t)


class HoldsSpeculation(Protocol):
    def hold_speculation(self) -> None:
        """Until the clipped step: no speculative step starts; each waits for the norm."""


class Clipping:
    """max_grad_norm's rule and the state it leaves: the last norm and what the last step did.

    `speculative`: units step before the norm is known (the Offloader's native engine). `who` names the
    owner in the refusal of a non-finite norm, `consequence` says what that refusal leaves behind.
    """

    def __init__(self, max_norm: float, *, who: str, consequence: str, speculative: bool = False) -> None:
        self.max_norm = max_norm
        self.speculative = speculative
        self._who, self._consequence = who, consequence
        self.last_grad_norm: float | None = None
        # "committed" / "redone" (its steps were speculative), "unclipped" / "clipped" (they waited for the norm)
        self.last_clip_action: str | None = None

    def begin(self, stepper: HoldsSpeculation) -> None:
        """A step's first backward begins: after a step that was redone, its speculative steps are held."""
        if self.last_clip_action == "redone":
            stepper.hold_speculation()

    def step(self, sq: float, clipped_step: Callable[[float], None], *, speculated: bool,
             undo: Callable[[], None] | None = None) -> float:
        """The norm from `sq` (the float64 sum of every gradient's squares), then `clipped_step(scale)`, which
        commits (scale 1) or redoes the speculative steps and steps the units that waited. Returns the scale.
        A non-finite norm raises FloatingPointError before any of that, once `undo` (where the steps taken
        speculatively can be taken back) has run."""
        self.last_grad_norm = math.sqrt(sq) if math.isfinite(sq) else sq
        if not math.isfinite(sq):
            if undo is not None:
                undo()
            raise FloatingPointError(f"{self._who}: the total gradient norm is {self.last_grad_norm} (a non-finite "
                                     f"gradient); the step is not applied{self._consequence}")
        scale = min(1.0, self.max_norm / (self.last_grad_norm + 1e-6))
        clipped_step(scale)
        clipped = scale < 1.0
        if speculated:
            self.last_clip_action = "redone" if clipped else "committed"
        else:
            self.last_clip_action = "clipped" if clipped else "unclipped"
        return scale
