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

The checkpoint is torch's reentrant rule (recompute under grad, then a nested backward into the same
parameters), with the RNG state of the forward restored for the recompute, as torch.utils.checkpoint does.
"""
from __future__ import annotations

from collections.abc import Callable
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


def _drop(t: torch.Tensor) -> None:
    return None


def _never(_: None) -> torch.Tensor:
    raise RuntimeError("activation_offload: a checkpointed forward's saved tensor was unpacked")


class _OffloadedCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, host: HostActivations, key: Key, below: Key | None, run: Callable[..., torch.Tensor],
                rest: tuple[Any, ...], kwargs: dict[str, Any], x: torch.Tensor) -> torch.Tensor:
        ctx.host, ctx.key, ctx.below, ctx.run, ctx.rest, ctx.kwargs = host, key, below, run, rest, kwargs
        ctx.rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(host.device) if host.cuda else None
        # Under grad, as the recompute will run (kernels are chosen by it: SDPA's differ and draw their dropout
        # differently without), with nothing saved, as torch's own checkpoint runs its forward.
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_drop, _never):
            out = run(x.detach().requires_grad_(x.requires_grad), *rest, **kwargs)
        host.store(key, x)
        return tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in out) if isinstance(out, tuple) \
            else out.detach()

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        x = ctx.host.take(ctx.key).requires_grad_()
        if ctx.below is not None:
            ctx.host.fetch(ctx.below)  # the next input down travels while this layer recomputes
        devices = [ctx.host.device] if ctx.host.cuda else []
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            torch.set_rng_state(ctx.rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, ctx.host.device)
            out = ctx.run(x, *ctx.rest, **ctx.kwargs)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return None, None, None, None, None, None, x.grad


def offloadable(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a layer call's input can be held on the host: a tensor first (the hidden states) that needs a
    gradient, and no other argument that does (those the layer's ordinary checkpoint handles). Under the
    reentrant rule the layer's output needs a gradient only if its input does: the parameters are not inputs
    of the Function, so the first layer above a frozen embedding (or a model fed raw features) is left to the
    ordinary checkpoint, or its parameters would get no gradient."""
    if not args or not isinstance(args[0], torch.Tensor) or not args[0].requires_grad:
        return False
    return not any(isinstance(v, torch.Tensor) and v.requires_grad for v in (*args[1:], *kwargs.values()))


def offloaded_checkpoint(host: HostActivations, key: Key, below: Key | None, run: Callable[..., Any],
                         args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """run(*args, **kwargs) checkpointed with args[0] held on the host until its backward, when `below`'s input
    is fetched."""
    return _OffloadedCheckpoint.apply(host, key, below, run, args[1:], kwargs, args[0])
