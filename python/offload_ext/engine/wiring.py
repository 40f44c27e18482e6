"""The Offloader's layers wired to the engine: each streamed layer's forward bound to its device buffer (and,
in its recompute, its gradient buffer made ready), which layers recompute and which keep their saved tensors
(activation_checkpointing, "auto" measured after the first step), and each part's device ring and gradient
path."""
from __future__ import annotations

from collections.abc import Callable

import torch

from offload_ext.engine.activation_offload import HostActivations, Key
from offload_ext.engine.device_ring import DeviceRing
from offload_ext.engine.grad_path import GradPath
from offload_ext.engine.kept_layers import auto_kept, device_budget
from offload_ext.engine.layers import unwrap_layer, wrap_layer


def _before_layer(ring: DeviceRing, path: GradPath, i: int) -> Callable[[], None]:
    """What runs before stack position i's forward: its weights bound, and in its checkpoint recompute
    (inside backward) its gradient buffer made ready for the gradients about to come. A kept layer's
    backward begins with it too (called inside backward, it does what the recompute does)."""
    def before() -> None:
        recompute = torch._C._current_graph_task_id() != -1
        ring.before_layer(i, recompute)
        if recompute:
            path.before_backward(i)
            ring.upload_stepped()
    return before


class LayerWiring:
    """The Offloader's layer wiring, a mixin: it reads the Offloader's layout, rings, gradient paths, saved
    weights and checkpointing choice."""

    def _wrap_layers(self) -> None:
        """Each stack's lowest `self._checkpointed` layers (resident ones first) recompute, the rest are kept."""
        r = self.layout.resident_per_stack
        for k, (stack, ring, path) in enumerate(zip(self.layout.stacks, self._rings, self._grad_paths)):
            for j, layer in enumerate(self.layout.resident[k * r:(k + 1) * r]):
                unwrap_layer(layer)  # nothing to fetch: kept, their saved tensors need no reference either
                wrap_layer(layer, lambda: None, self._compile_layers,
                           None if j < self._checkpointed else (self._saved, lambda: None), self._host_slot(k, j))
            for i, layer in enumerate(stack.layers):
                before = _before_layer(ring, path, i)
                kept = None if r + i < self._checkpointed else (self._saved, before)
                unwrap_layer(layer)
                wrap_layer(layer, before, self._compile_layers, kept, self._host_slot(k, r + i))

    def _host_slot(self, stack: int, position: int) -> tuple[HostActivations, Key, Key | None] | None:
        """With activation_offload, where a checkpointed layer's input waits: its key, and the layer below's."""
        if self._host_activations is None or position >= self._checkpointed:
            return None
        return self._host_activations, (stack, position), (stack, position - 1) if position else None

    @property
    def kept_layers(self) -> int:
        """How many layers of each stack run without recompute (their saved tensors kept until backward)."""
        return self.layout.fewest_stack_layers - self._checkpointed

    def _choose_kept(self, grown: int) -> None:
        """activation_checkpointing="auto", after the first step: keep as many layers as the budget holds, each
        costing what the top layer saved in that step's first forward, on top of that step's peak and what the
        device step left allocated (`grown` bytes)."""
        if self.device.type == "cuda":
            budget = self._budget if self._budget is not None else device_budget(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        else:  # no allocator to ask: the budget is the kept layers' alone
            budget, peak = self._budget, self._saved.saved_bytes
        kept = auto_kept(self.layout.fewest_stack_layers, self._saved.saved_bytes, budget, peak + grown)
        self._checkpointed = self.layout.fewest_stack_layers - kept
        self.auto_choice = {"kept_layers": kept, "saved_bytes_per_layer": self._saved.saved_bytes,
                            "budget_bytes": budget, "first_step_peak_bytes": peak, "device_step_growth_bytes": grown}
        self._wrap_layers()

    def _device_side(self, device_layers: int, eager_uploads: bool) -> tuple[list[DeviceRing], list[GradPath]]:
        """Per part, the device buffers: `device_layers` for weights (one for the part outside the
        stacks, bound throughout) and up to two for gradients."""
        rings, paths = [], []
        for part in self.layout.parts:
            host = [self._host[u.index] for u in part.units]
            buffers = min(len(part.units), device_layers) if part.layers else 1
            # Eager uploads only where a step, once queued, is final: no clipping redoes it, and the
            # backend steps in the background (the python backend steps inside step()).
            eager = (eager_uploads and bool(part.layers) and self._backend.asynchronous
                     and self._policy.max_grad_norm is None)
            ring = DeviceRing(part, host, self._backend, buffers, eager)
            rings.append(ring)
            paths.append(GradPath(part, host, self._backend, min(2, buffers), self._policy.sums_on_device,
                                  on_flush=ring.flushed, on_unarmed=self._backward_reached))
        return rings, paths
