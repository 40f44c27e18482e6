"""Gradient path: each trainable streamed parameter's gradient gathered into its unit's flat device
gradient buffer as it is produced, and sent to the host with the unit's last one.

A post-accumulate-grad hook per parameter copies .grad into the buffer and frees it at once, so a
layer's gradients never outlive its backward on the device. Units alternate between (up to) two
gradient buffers; a buffer is reused only once its previous copy to the host has landed.
"""
from __future__ import annotations

from typing import Any, Callable

from torch import nn

from .backends import Backend, LayerBuffers
from .layout import Part, Span


class GradPath:
    def __init__(self, part: Part, host: list[LayerBuffers], backend: Backend, buffers: int) -> None:
        self.part = part
        self.host = host
        self.backend = backend
        largest = max(1, max(u.trainable_numel for u in part.units))
        self.buffers = [backend.device_buffer(largest) for _ in range(buffers)]
        self.drained: list[Any] = [None] * buffers                  # per buffer: its last copy to the host
        self.received: list[set[int]] = [set() for _ in part.units]  # per position: offsets landed this backward

    def hook(self) -> list[Any]:
        """Register the gradient hooks; returns their handles."""
        handles = []
        for i, unit in enumerate(self.part.units):
            for s in unit.trainable_spans:
                handles.append(s.param.register_post_accumulate_grad_hook(
                    lambda p, i=i, s=s: self._on_grad(i, s, p)))
        return handles

    def _on_grad(self, i: int, s: Span, p: nn.Parameter) -> None:
        unit = self.part.units[i]
        b = i % len(self.buffers)
        if not self.received[i] and self.drained[b] is not None:
            self.backend.compute_wait(self.drained[b])  # the buffer's last copy to the host has landed
        self.buffers[b][s.offset:s.offset + s.numel].copy_(p.grad.reshape(-1))
        p.grad = None
        self.received[i].add(s.offset)
        if len(self.received[i]) == unit.trainable:
            self.received[i].clear()
            src = self.buffers[b][: unit.trainable_numel]
            self.drained[b] = self.backend.flush_grads(unit.index, self.host[i], src)

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
