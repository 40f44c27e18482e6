"""Step policy: when a unit may be stepped on the host.

Plain: as its gradients land, during backward. Accumulation (grad_accum=N): the first N-1 backward
calls only sum each unit's gradients on the host; the N-th steps each unit as its sum completes.
Clipping: every unit's gradients are kept until the global norm over all parameters is known, then
scaled and stepped; or, speculatively (native engine, the top of each stack), each unit is stepped as
its last gradients land, as if no clipping were needed, into a second set of state buffers, leaving the
state before it intact: when the norm is under the limit the steps stand (committed), otherwise each is
redone exactly from the state before, clipped.
"""
from __future__ import annotations

import math

import torch

from offload_ext.engine.backends import Backend


class StepPolicy:
    def __init__(self, grad_accum: int, max_grad_norm: float | None, speculative: bool,
                 sums_on_device: bool = False) -> None:
        self.grad_accum = grad_accum
        # Micro-batches summed on the device: the host sees one gradient per unit and step, as with one.
        self.sums_on_device = sums_on_device
        self.max_grad_norm = max_grad_norm
        self.speculative = speculative and max_grad_norm is not None
        # The last step's clipping: "committed" / "redone" (speculative), "unclipped" / "clipped" (not).
        self.last_clip_action: str | None = None
        self.micro = 0  # backward() calls since the last step(); > 0: host steps may be pending
        self.last_grad_norm: float | None = None

    @property
    def accumulates(self) -> bool:
        """Whether units sum their gradients in host accumulators rather than stepping straight from them."""
        return self.host_grad_accum > 1 or self.max_grad_norm is not None

    @property
    def host_grad_accum(self) -> int:
        """Micro-batches whose gradients reach the host per step."""
        return 1 if self.sums_on_device else self.grad_accum

    def begin_backward(self, backend: Backend) -> None:
        if self.micro == self.grad_accum:
            raise RuntimeError(f"Offloader: backward() called {self.micro + 1} times without step(), with "
                               f"grad_accum={self.grad_accum}; call step() after every {self.grad_accum} "
                               "backward() calls, or build the Offloader with a larger grad_accum")
        self.micro += 1
        last = self.micro == self.grad_accum
        steps_now = last and (self.max_grad_norm is None or self.speculative)
        if not self.sums_on_device:
            backend.begin_micro(first=self.micro == 1, last=steps_now)
        elif last:  # the only micro-batch the host sees
            backend.begin_micro(first=True, last=steps_now)

    def check_step(self) -> None:
        if self.micro == 0:
            raise RuntimeError("Offloader: step() without a preceding off.backward(loss); call off.backward(loss) "
                               "(not loss.backward()) before step()")
        if self.micro != self.grad_accum:
            raise RuntimeError(f"Offloader: step() after {self.micro} backward() calls, with grad_accum="
                               f"{self.grad_accum}: every step sums exactly grad_accum micro-batches")

    def finish_host_units(self, backend: Backend, device_grads: list[torch.Tensor]) -> None:
        """After backward: with clipping, torch.nn.utils.clip_grad_norm_ over every parameter (the norm
        summed in float64), then the host steps; otherwise the host steps are already under way."""
        if self.max_grad_norm is None:
            return
        on_device = backend.device_sq_norm(device_grads)  # queued first: it runs while the host norms are awaited
        sq = backend.grad_sq_norm() + float(on_device)
        self.last_grad_norm = math.sqrt(sq) if math.isfinite(sq) else sq
        if not math.isfinite(sq):
            # clip_grad_norm_(error_if_nonfinite=True)'s rule: an error, never a step. (min(1.0, nan) is 1.0: an
            # unclipped step would have been committed silently.) Speculative steps taken in backward stand on
            # their units: the Offloader stays failed until closed.
            raise FloatingPointError(f"Offloader: the total gradient norm is {self.last_grad_norm} (a non-finite "
                                     "gradient); the step is not applied and the Offloader is failed: close() it "
                                     "and continue from a checkpoint, with a lower lr or a loss that stays finite")
        scale = min(1.0, self.max_grad_norm / (self.last_grad_norm + 1e-6))
        backend.clipped_step(scale)
        clipped = scale < 1.0
        if self.speculative:
            self.last_clip_action = "redone" if clipped else "committed"
        else:
            self.last_clip_action = "clipped" if clipped else "unclipped"
        if scale != 1.0:  # x * 1.0 is x: the unclipped step skips a pass over every device gradient
            for g in device_grads:
                g.mul_(scale)

    def end_step(self) -> None:
        self.micro = 0
