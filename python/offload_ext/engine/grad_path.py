"""Gradient path: each trainable streamed parameter's gradient gathered into its unit's flat device
gradient buffer as it is produced, and sent to the host with the unit's last one.

Before a unit's backward (its checkpoint recompute) its buffer is claimed (its previous copy to the host
has landed), zeroed, and each parameter's .grad pointed at its span, so autograd adds the gradient there
in place, as into any .grad (and as DDP's gradient_as_bucket_view does): no copy of each from Python
(a copy per parameter cost as much as the whole offload overhead in a tiny-model test on the GPU
machine). A post-accumulate-grad hook per parameter counts it, copies a .grad of its own in (a unit
with no recompute, or a zero_grad() in between), and clears .grad, so a layer's gradients never
outlive its backward on the device. Units alternate between (up to) two gradient buffers. With
gradient accumulation on the device, each unit instead sums its micro-batches' gradients in a buffer of
its own (bf16, as torch sums .grad), its .grads left pointing at the sum until the last micro-batch,
which sends it once.
"""
from __future__ import annotations

from typing import Any, Callable

from torch import nn

from offload_ext.engine.backends import Backend, LayerBuffers
from offload_ext.planning.layout import Part, Span


class GradPath:
    def __init__(self, part: Part, host: list[LayerBuffers], backend: Backend, buffers: int,
                 sum_on_device: bool, on_flush: Callable[[int], None], on_unarmed: Callable[[], None]) -> None:
        self.part = part
        self.on_flush = on_flush  # position i's gradients went to the host for its step
        self.on_unarmed = on_unarmed  # a gradient arrived before the backward began: it begins it
        self.host = host
        self.backend = backend
        # Position i gathers into buffer i % len(buffers): a ring shared by the units, or with accumulation
        # on the device one buffer per unit, holding the sum over its step's micro-batches.
        self.summing = sum_on_device
        if sum_on_device:
            self.buffers = [backend.device_buffer(u.trainable_numel) for u in part.units]
        else:
            largest = max(1, max(u.trainable_numel for u in part.units))
            self.buffers = [backend.device_buffer(largest) for _ in range(buffers)]
        n = len(self.buffers)
        self.views = [{s.offset: self.buffers[i % n][s.offset:s.offset + s.numel].view(s.shape)
                       for s in u.trainable_spans} for i, u in enumerate(part.units)]  # per position: .grad views
        self.drained: list[Any] = [None] * n                          # per buffer: its last copy to the host
        self.received: list[set[int]] = [set() for _ in part.units]  # per position: offsets landed this backward
        self.claimed: set[int] = set()  # positions whose buffer the compute stream may write this backward
        self.first_micro, self.last_micro = True, True  # without summing: every backward copies in and sends
        self.handles: list[Any] = []  # the post-accumulate-grad hooks while registered
        self.armed = False  # inside Offloader.backward: a gradient landing outside it came from a plain backward

    def begin_micro(self, first: bool, last: bool) -> None:
        """The coming backward is the first and/or the last micro-batch of its step (matters when summing).
        Summing, a micro-batch before the last runs without the hooks: autograd adds each gradient into the
        sum its .grad points at, and there is nothing to send; a .grad of its own (zero_grad() in between)
        stays as autograd leaves it, and the last micro-batch's hook copies it in."""
        if self.summing:
            self.first_micro, self.last_micro = first, last
            self.hook() if last else self.unhook()

    def hook(self) -> None:
        """Register the gradient hooks (once)."""
        if self.handles:
            return
        for i, unit in enumerate(self.part.units):
            for s in unit.trainable_spans:
                self.handles.append(s.param.register_post_accumulate_grad_hook(
                    lambda p, i=i, s=s: self._on_grad(i, s, p)))

    def unhook(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def before_backward(self, i: int) -> None:
        """Position i's backward is about to run: its buffer claimed and zeroed and its .grads pointed into
        it (after the first micro-batch of a sum they point at the sum already)."""
        if self.summing and not self.first_micro:
            return
        self._claim(i)
        self.buffers[i % len(self.buffers)][: self.part.units[i].trainable_numel].zero_()
        for s in self.part.units[i].trainable_spans:
            s.param.grad = self.views[i][s.offset]

    def _claim(self, i: int) -> None:
        """The compute stream waits for the last copy to the host out of position i's buffer."""
        if i not in self.claimed:
            drained = self.drained[i % len(self.buffers)]
            if drained is not None:
                self.backend.compute_wait(drained)
            self.claimed.add(i)

    def _on_grad(self, i: int, s: Span, p: nn.Parameter) -> None:
        if not self.armed:  # a plain loss.backward() whose first gradients are this part's: it begins here
            self.on_unarmed()
        unit = self.part.units[i]
        view = self.views[i][s.offset]
        if p.grad.data_ptr() != view.data_ptr():
            # A .grad of its own (a unit without recompute, or a zero_grad() in between, which drops what
            # the earlier micro-batches summed, as in torch): into the buffer.
            self._claim(i)
            view.copy_(p.grad)
        # else autograd has added this gradient into the buffer in place
        p.grad = view if self.summing and not self.last_micro else None
        self.received[i].add(s.offset)
        if len(self.received[i]) == unit.trainable:
            self.received[i].clear()
            self.claimed.discard(i)
            if self.last_micro:
                src = self.buffers[i % len(self.buffers)][: unit.trainable_numel]
                self.drained[i % len(self.buffers)] = self.backend.flush_grads(unit.index, self.host[i], src)
                self.on_flush(i)

    def check_complete(self, name_of: Callable[[nn.Parameter], str]) -> None:
        """Raise if a unit got only some of its gradients in the last backward (and forget them)."""
        for i, received in enumerate(self.received):
            if not received:
                continue
            unit = self.part.units[i]
            missing = [name_of(s.param) for s in unit.trainable_spans if s.offset not in received]
            count = len(received)
            received.clear()
            raise RuntimeError(
                f"Offloader: {self.part.name} [{i}] got gradients for only {count} of its {unit.trainable} "
                f"trainable parameters (none for {missing[:4]}); freeze parameters that take no part in the loss "
                "(p.requires_grad_(False)) before building the Offloader")
