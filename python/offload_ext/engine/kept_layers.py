"""Kept layers: streamed layers run without activation checkpointing, their saved tensors kept until their
backward, the saved views of their weights replaced by references to them; and which layers are kept.

A kept layer's saved views of its weights (the weight a linear saves for its input gradient, its
transpose, ...) point into a device buffer that is refilled with other layers before the layer's backward
runs. At pack time such a view becomes a reference (ring, position, the view's geometry); at unpack the
position is bound again, which makes the compute stream wait for the copy that refilled the buffer, as
every bind does, and the view is rebuilt over the buffer: race-free by construction. A kept layer's
backward begins at a hook on its output, which binds it, prefetches the layer below and claims its
gradient buffer: what the recompute does for a checkpointed layer. Since a position's buffer never changes,
that entry's bind alone already puts the right weights under the saved views (on the simulated device,
training stays bit-exact with the pack hook disabled); the references make each saved weight's validity its
own (its bind, its awaited copy) rather than depend on the entry hook running first, and the pack hook is
where "auto" counts what a layer saves.

Which layers: `activation_checkpointing` "all" (every layer recomputes), "none", N (the lowest N of each
stack recompute, the rest are kept) or "auto" (as many kept as a GPU memory budget holds, measured in the
first step). The top layers are the ones kept: their backward comes first, so without a recompute there
the host receives gradients from the first moment of backward; and the top layer's weights are often still
on the device then.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from offload_ext.engine.device_ring import DeviceRing

_MARGIN_BYTES = 1 << 30   # "auto" leaves this much of the budget free, plus 5 % of the process's cap, for
_MARGIN_FRACTION = 0.05   # the allocator's fragmentation and what the first step did not show


@dataclass(frozen=True)
class _WeightRef:
    ring: DeviceRing
    position: int
    buffer: int
    dtype: torch.dtype
    offset: int
    size: torch.Size
    stride: tuple[int, ...]


class SavedWeights:
    """The saved-tensor hooks of kept layers; while `measuring`, the bytes the kept layers save beyond their
    inputs (which a checkpoint keeps too), each storage counted once."""

    def __init__(self, rings: Sequence[DeviceRing]) -> None:
        self._where = {buf.untyped_storage().data_ptr(): (ring, b)
                       for ring in rings for b, buf in enumerate(ring.buffers)}
        self.measuring = False
        self._seen: set[int] = set()
        self._inputs: set[int] = set()
        self.saved_bytes = 0

    def pack(self, t: torch.Tensor) -> Any:
        if t.layout != torch.strided:
            return t
        ptr = t.untyped_storage().data_ptr()
        hit = self._where.get(ptr)
        if hit is None:
            if self.measuring and ptr not in self._seen and ptr not in self._inputs:
                self._seen.add(ptr)
                self.saved_bytes += t.untyped_storage().nbytes()
            return t
        ring, b = hit
        return _WeightRef(ring, ring.holds[b], b, t.dtype, t.storage_offset(), t.size(), t.stride())

    def unpack(self, x: Any) -> torch.Tensor:
        if not isinstance(x, _WeightRef):
            return x
        x.ring.bind(x.position)  # the compute stream waits for the copy that put the layer back
        buf = x.ring.buffers[x.buffer]
        return torch.empty(0, dtype=x.dtype, device=buf.device).set_(buf.untyped_storage(), x.offset, x.size,
                                                                     x.stride)

    def inputs(self, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """While measuring: the storages of a layer's tensor arguments, not counted as what keeping it costs."""
        if self.measuring:
            for a in (*args, *kwargs.values()):
                if isinstance(a, torch.Tensor) and a.layout == torch.strided:
                    self._inputs.add(a.untyped_storage().data_ptr())


def on_backward(out: Any, enter: Callable[[], None]) -> Any:
    """Call `enter` once per backward, before any of the layer's backward runs: a hook on each output tensor
    that takes a gradient (the first whose gradient is ready calls it)."""
    entered = [None]

    def hook(grad: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        if entered[0] != task:
            entered[0] = task
            enter()

    for t in (out if isinstance(out, (tuple, list)) else (out,)):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(hook)
    return out


def auto_kept(layers: int, saved_bytes: int, budget: int, peak: int) -> int:
    """How many layers of each stack "auto" keeps: each costs what the kept top layers saved in the first step
    (`saved_bytes`, the stacks' sum), on top of that step's `peak`, within `budget` bytes."""
    if saved_bytes <= 0:
        return layers  # the layers save nothing beyond their inputs: keeping them all costs nothing
    return max(0, min(layers, (budget - peak + saved_bytes) // saved_bytes))


def device_budget(device: torch.device) -> int:
    """"auto"'s default budget on a GPU: what this process may allocate there, less a margin."""
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    cap = int((fraction(device) if fraction else 1.0) * torch.cuda.get_device_properties(device).total_memory)
    return int(cap * (1 - _MARGIN_FRACTION)) - _MARGIN_BYTES
