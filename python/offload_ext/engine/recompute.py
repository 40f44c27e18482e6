"""Activation checkpointing of one layer call, with as little of the launching thread's time as the rule allows.

The rule is torch's non-reentrant one: the forward builds the layer's graph under grad but keeps none of the
tensors its ops save; the first time the backward asks for one, the layer is run again from its inputs, and the
run stops as soon as the last saved tensor is back (so the layer's last op, which saves its inputs before it
computes, is not recomputed: in a Llama layer the down projection, a quarter of its matmul work). What differs
is the bookkeeping: torch's checkpoint keeps each saved tensor behind a holder with weak references, per-device
handles and a frame stack for nesting; here a saved tensor is an index into one list per call. On an
overhead-bound step, where the thread that launches the kernels sets the pace, that is time saved: on the CPU a
16-layer tiny Llama's forward and backward took ~29 ms against ~38 with torch's checkpoint (~18 unwrapped).

Exactness: the recompute runs under the forward's RNG state (dropout draws the same) and autocast state, on the
same inputs, so it saves the same tensors in the same order; the gradients are those of an unwrapped forward
bit for bit. Nothing is nested: torch.autograd.grad reaches the layer's parameters as without checkpointing.

Where the layer's input waits is the caller's choice: with the call's other arguments (on the device), or, with
an InputStore, in host memory (offload_ext.engine.activation_offload's slots, fetched back as the backward reaches the
layer); then the device copy is free as soon as the layer has read it.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import torch


class InputStore(Protocol):
    """Somewhere a layer's input waits between its forward and its backward."""

    def store(self, x: torch.Tensor) -> None: ...

    def take(self) -> torch.Tensor:
        """The input back on its device, the compute stream ready to read it."""
        ...


class _Stop(Exception):
    """Raised by the recompute's pack hook once every saved tensor is back: the rest of the layer is not run."""


def _autocast_state(device_type: str) -> list[tuple[str, bool, torch.dtype]]:
    types = [device_type] if device_type == "cpu" else [device_type, "cpu"]
    return [(t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in types]


def _device_of(args: tuple[Any, ...]) -> torch.device:
    return next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))


class _Call:
    """One checkpointed call: what its recompute needs, how many tensors its forward saved, and the recomputed
    ones until each is unpacked."""

    def __init__(self, run: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                 store: InputStore | None) -> None:
        self.run, self.args, self.kwargs, self.store = run, args, kwargs, store
        self.count = 0
        self.saved: list[torch.Tensor | None] = []
        device = _device_of(args)
        self.cuda = device if device.type == "cuda" else None
        self.rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state(device) if self.cuda else None
        self.autocast = _autocast_state(device.type)
        self.cache = torch.is_autocast_cache_enabled()
        self.input_grad = store is not None and args[0].requires_grad

    def pack(self, _: torch.Tensor) -> int:
        self.count += 1
        return self.count - 1

    def unpack(self, i: int) -> torch.Tensor:
        if i >= len(self.saved) or self.saved[i] is None:  # first use, or used before (a graph kept for reuse)
            self._recompute()
        t, self.saved[i] = self.saved[i], None
        return t

    def keep_input(self) -> None:
        """With a store, hand it the input (the forward has read it) and drop the reference here."""
        if self.store is not None:
            self.store.store(self.args[0])
            self.args = (None, *self.args[1:])

    def _recompute(self) -> None:
        args = self.args
        if self.store is not None:  # what the forward saw, its need of a gradient too (ops save by it)
            args = (self.store.take().detach().requires_grad_(self.input_grad), *args[1:])
        saved: list[torch.Tensor | None] = []

        def pack(t: torch.Tensor) -> None:
            saved.append(t)
            if len(saved) == self.count:
                raise _Stop

        with contextlib.ExitStack() as scope:
            scope.enter_context(torch.random.fork_rng(devices=[self.cuda] if self.cuda else []))
            scope.enter_context(torch.enable_grad())
            for device_type, enabled, dtype in self.autocast:
                scope.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=self.cache))
            scope.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, _never))
            torch.set_rng_state(self.rng)
            if self.cuda_rng is not None:
                torch.cuda.set_rng_state(self.cuda_rng, self.cuda)
            with contextlib.suppress(_Stop):
                self.run(*args, **self.kwargs)
        if len(saved) != self.count:
            raise RuntimeError(f"offload_ext: a checkpointed layer's recompute saved {len(saved)} tensors where its "
                               f"forward saved {self.count}: the layer must run the same ops on the same inputs "
                               "each time (no data-dependent branches on values that change between them)")
        self.saved = saved


def _never(_: None) -> torch.Tensor:
    raise RuntimeError("offload_ext: a tensor saved inside a recompute was unpacked")


def recompute_checkpoint(run: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                         store: InputStore | None = None) -> Any:
    """run(*args, **kwargs) checkpointed, its input (args[0], a tensor when `store` is given) kept on the device
    or, with `store`, there."""
    call = _Call(run, args, kwargs, store)
    with torch.autograd.graph.saved_tensors_hooks(call.pack, call.unpack):
        out = run(*args, **kwargs)
    call.keep_input()
    return out
