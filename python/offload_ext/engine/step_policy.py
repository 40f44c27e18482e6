"""Step policy: when a unit may be stepped on the host.

Plain: as its gradients land, during backward. Accumulation (grad_accum=N): the first N-1 backward
calls only sum each unit's gradients on the host; the N-th steps each unit as its sum completes.
Clipping (offload_ext.optim.clipping, which owns the norm, the scale and the speculation protocol): every
unit's gradients are kept until the global norm over all parameters is known, then scaled and stepped; or,
speculatively (native engine, the top of each stack), each unit is stepped as its last gradients land, as if
no clipping were needed, into a second set of state buffers, leaving the state before it intact: when the
norm is under the limit the steps stand (committed), otherwise each is redone exactly from the state before,
clipped.
"""
from __future__ import annotations

import torch

from offload_ext.engine.backends import Backend
from offload_ext.optim.clipping import Clipping

# What a refused (non-finite) norm leaves: speculative steps taken in backward stand on their units.
_REFUSED = (" and the Offloader is failed: close() it and continue from a checkpoint, with a lower lr or a loss "
            "that stays finite")


class StepPolicy:
    def __init__(self, grad_accum: int, max_grad_norm: float | None, speculative: bool,
                 sums_on_device: bool = False) -> None:
        self.grad_accum = grad_accum
        # Micro-batches summed on the device: the host sees one gradient per unit and step, as with one.
        self.sums_on_device = sums_on_device
        self.clipping = None if max_grad_norm is None else Clipping(max_grad_norm, who="Offloader",
                                                                     consequence=_REFUSED, speculative=speculative)
        self.micro = 0  # backward() calls since the last step(); > 0: host steps may be pending

    @property
    def max_grad_norm(self) -> float | None:
        return None if self.clipping is None else self.clipping.max_norm

    @property
    def last_clip_action(self) -> str | None:
        """The last step's clipping: "committed" / "redone" (speculative), "unclipped" / "clipped" (not)."""
        return None if self.clipping is None else self.clipping.last_clip_action

    @property
    def last_grad_norm(self) -> float | None:
        return None if self.clipping is None else self.clipping.last_grad_norm

    def begin_backward(self, backend: Backend) -> None:
        if self.micro == self.grad_accum:
            raise RuntimeError(f"Offloader: backward() called {self.micro + 1} times without step(), with "
                               f"grad_accum={self.grad_accum}; call step() after every {self.grad_accum} "
                               "backward() calls, or build the Offloader with a larger grad_accum")
        self.micro += 1
        last = self.micro == self.grad_accum
        steps_now = last and (self.clipping is None or self.clipping.speculative)
        if self.sums_on_device and not last:
            return  # the host sees only the last micro-batch
        first = self.micro == 1 or self.sums_on_device
        backend.begin_micro(first=first, last=steps_now)
        if first and self.clipping is not None:
            self.clipping.begin(backend)

    def check_step(self) -> None:
        if self.micro == 0:
            raise RuntimeError("Offloader: step() without a preceding backward; call loss.backward() (or "
                               "off.backward(loss)) before step()")
        if self.micro != self.grad_accum:
            raise RuntimeError(f"Offloader: step() after {self.micro} backward() calls, with grad_accum="
                               f"{self.grad_accum}: every step sums exactly grad_accum micro-batches")

    def finish_host_units(self, backend: Backend, device_grads: list[torch.Tensor]) -> None:
        """After backward: with clipping, torch.nn.utils.clip_grad_norm_ over every parameter (the norm
        summed in float64), then the host steps; otherwise the host steps are already under way."""
        if self.clipping is None:
            return
        on_device = backend.device_sq_norm(device_grads)  # queued first: it runs while the host norms are awaited
        sq = backend.grad_sq_norm() + float(on_device)
        scale = self.clipping.step(sq, backend.clipped_step, speculated=self.clipping.speculative)
        if scale != 1.0:  # x * 1.0 is x: the unclipped step skips a pass over every device gradient
            for g in device_grads:
                g.mul_(scale)

    def end_step(self) -> None:
        self.micro = 0
