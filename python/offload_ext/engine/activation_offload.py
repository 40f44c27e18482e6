"""Activation offload: the input a checkpointed layer keeps for its recompute, held in host memory between
its forward and its backward instead of on the device.

A checkpointed layer keeps one tensor through forward: its input (batch x seq x hidden). With
activation_offload, the layer runs as a checkpoint of its own whose input is copied to a pinned host slot
on a side stream as soon as the layer has read it; the device copy is then free. In backward each layer's
input comes back on that stream when its backward begins, and the next one down is started at once, so at
most two inputs are on the device during backward (double-buffered) while the copies overlap the
recompute. The host slots (one per layer position, reused every step) bound the host memory to one input
per checkpointed layer. The side stream has the lowest priority and the engine's weight and gradient copy
streams the highest, so where both have work queued the weights the next layer needs go first.

The checkpoint is offload_ext.engine.recompute's, with the input kept here instead of on the device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

Key = tuple[int, int]  # (stack, position)


class HostActivations:
    """The host slots and the side stream; `take` waits for what `fetch` started."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device, priority=0) if self.cuda else None  # 0: the lowest priority
        self.slots: dict[Key, torch.Tensor] = {}
        self.back: dict[Key, tuple[torch.Tensor, Any]] = {}  # inputs on their way back to the device

    def _slot(self, key: Key, like: torch.Tensor) -> torch.Tensor:
        slot = self.slots.get(key)
        if slot is None or slot.shape != like.shape or slot.dtype != like.dtype:
            slot = torch.empty(like.shape, dtype=like.dtype, pin_memory=self.cuda)
            self.slots[key] = slot
        return slot

    def store(self, key: Key, x: torch.Tensor) -> None:
        """Copy x to its host slot after the compute enqueued so far; x's device memory may be reused once the
        copy has read it (record_stream tells the allocator)."""
        slot = self._slot(key, x)
        self.back.pop(key, None)
        if not self.cuda:
            slot.copy_(x)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            slot.copy_(x, non_blocking=True)
        x.record_stream(self.stream)

    def fetch(self, key: Key) -> None:
        """Start bringing key's input back (if it is stored and not on its way already)."""
        if key in self.back or key not in self.slots:
            return
        slot = self.slots[key]
        if not self.cuda:
            self.back[key] = (slot.clone(), None)
            return
        with torch.cuda.stream(self.stream):  # after this slot's store: the same stream, in order
            dev = torch.empty(slot.shape, dtype=slot.dtype, device=self.device)
            dev.copy_(slot, non_blocking=True)
            landed = torch.cuda.Event()
            landed.record(self.stream)
        self.back[key] = (dev, landed)

    def take(self, key: Key) -> torch.Tensor:
        """Key's input on the device, the compute stream waiting for its copy."""
        self.fetch(key)
        dev, landed = self.back.pop(key)
        if landed is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(landed)
            dev.record_stream(current)
        return dev


@dataclass(frozen=True)
class HostSlot:
    """One checkpointed layer's input held in `host` (an offload_ext.engine.recompute.InputStore): stored under `key`,
    and when it is taken back the input of the layer below (`below`) starts on its way."""
    host: HostActivations
    key: Key
    below: Key | None

    def store(self, x: torch.Tensor) -> None:
        self.host.store(self.key, x)

    def take(self) -> torch.Tensor:
        x = self.host.take(self.key)
        if self.below is not None:
            self.host.fetch(self.below)  # the next input down travels while this layer recomputes
        return x
