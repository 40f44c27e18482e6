"""The pure-PyTorch backend: torch streams and events, pinned tensors, torch's fused AdamW after backward.

It is the honest baseline for the native backend: the same hooks and layout, and a copy is never
used before it has landed (in forward and in activation-checkpointing recompute alike). Its CPU step
runs in step(), after backward: torch's fused AdamW on each layer in the order the gradient copies
land, so the first layers are stepped while the GPU finishes backward ("bf16-sr": the same in
stochastic_rounding's torch ops, the native kernel's reference; the 8-bit precisions: eight_bit's rule in torch
ops, each group range of a layer a span of its own). On the simulated device, copies run
on one worker thread per direction and events are futures (torch_copies); pinned buffers come from one
page-locked arena (pinned_arena).
"""
from __future__ import annotations

import random
import time
from typing import Any

import torch

from offload_ext.config import eight_bit, stochastic
from offload_ext.engine.backends.base import Backend, Hyper, LayerBuffers, absmaxes, moments
from offload_ext.engine.backends.pinned_arena import PinnedArena
from offload_ext.engine.backends.torch_copies import CudaCopies, ThreadCopies
from offload_ext.engine.timeline import Timeline, span
from offload_ext.optim.clipping import sq_sum
from offload_ext.optim.eight_bit import num_blocks, reference_adamw8bit_step
from offload_ext.optim.stochastic_rounding import adamw_step_sr
from offload_ext.planning import host_sizes
from offload_ext.planning.host_sizes import HostNeed, python_alternatives, python_arena_elements, python_host_need


def _zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(numel, dtype=dtype)


class PythonBackend(Backend):
    def __init__(self, device: torch.device, precision: str, *, accumulate: bool = False, sr_seed: int = 0) -> None:
        super().__init__(device, precision, accumulate)
        self._sr_seed = sr_seed
        self._copies = CudaCopies(device) if device.type == "cuda" else ThreadCopies()
        self._pin = device.type == "cuda"
        self._layers: list[LayerBuffers] = []
        # What torch's AdamW steps: per layer, (group, parameter, begin, end) for each group range.
        self._params: list[list[tuple[int, torch.nn.Parameter, int, int]]] = []
        self._fp32_grads: list[torch.Tensor] = []       # mixed: grads upcast for torch's fp32 AdamW
        self._optimizer: torch.optim.AdamW | None = None
        self._pending: list[tuple[int, Any]] = []
        self._unfolded: dict[int, tuple[Any, bool]] = {}  # layer -> (D2H event, first micro-batch)
        self._accumulated: set[int] = set()  # layers with a gradient sum this step
        self._hypers: list[Hyper] = []
        self._timeline: Timeline | None = None  # while tracing: its own host steps and waits
        self._torch_groups: list[int] = []
        self._arena: PinnedArena | None = None
        self._copy_delay_us = 0  # testing aids: see Backend
        self._fail_next_copy = False
        self._fail_next_step = False

    def host_need(self, sizes: list[tuple[int, int]], own_grads: list[tuple[int, int]] = ()) -> HostNeed:
        """The host buffers prepare() and new_layer() will take for these units."""
        return python_host_need(self.precision, tuple(sizes), tuple(own_grads), self.accumulate)

    def plan(self, sizes: list[tuple[int, int]], own_grads: list[tuple[int, int]] = ()) -> None:
        alternatives = python_alternatives(self.precision, tuple(sizes), tuple(own_grads), self.accumulate)
        host_sizes.check_host_memory(self.host_need(sizes, own_grads), host_sizes.available_host_bytes(), alternatives)

    def prepare(self, sizes: list[tuple[int, int]], own_grads: list[tuple[int, int]] = ()) -> None:
        """One pinned arena for every layer's params and grads."""
        elements = python_arena_elements(tuple(sizes), tuple(own_grads))
        self._arena = PinnedArena(elements, torch.bfloat16, self._pin)

    def _pinned(self, numel: int) -> torch.Tensor:
        assert self._arena is not None, "prepare() was not called"
        return self._arena.take(numel)

    def new_layer(self, numel: int, trainable: int, own_grads: bool = False,
                  groups: tuple[tuple[int, int, int], ...] | None = None) -> LayerBuffers:
        # Here every layer has a grad buffer of its own, so own_grads changes nothing.
        params = self._pinned(numel)
        ranges = groups or ((0, 0, trainable),)
        absmax = absmaxes(_zeros, self.precision, trainable, groups)
        layer = LayerBuffers(
            params,
            self._pinned(trainable),  # the gradients: always written by a D2H before use
            *moments(_zeros, self.precision, trainable),
            master=torch.empty(trainable, dtype=torch.float32) if self.precision == "mixed" else None,
            trainable=trainable,
            accum=torch.empty(trainable, dtype=torch.bfloat16) if self.accumulate else None,
            exp_avg_absmax=absmax[0] if absmax else None,
            exp_avg_sq_absmax=absmax[1] if absmax else None,
        )
        stepped = layer.master if self.precision == "mixed" else layer.trainable_params
        if self.precision == "mixed":
            self._fp32_grads.append(torch.empty(trainable, dtype=torch.float32))
        # One torch parameter per group range (views), each in its group's torch param group; its .grad
        # is set only while _step_layers steps it.
        self._params.append([(g, torch.nn.Parameter(stepped[b:e]), b, e) for g, b, e in ranges])
        self._layers.append(layer)
        self._optimizer = None  # rebuilt lazily over all layers
        return layer

    def arena_bounds(self) -> tuple[int, int]:
        """Start and end address of the one pinned arena every params and grads buffer lies in."""
        assert self._arena is not None, "prepare() was not called"
        t = self._arena.tensor
        return t.data_ptr(), t.data_ptr() + t.nbytes

    def _copy(self, stream: Any, dst: torch.Tensor, src: torch.Tensor, after: Any = None) -> Any:
        if self._fail_next_copy:
            self._fail_next_copy = False
            raise RuntimeError("PythonBackend: injected copy failure (fail_next_copy)")
        stall_us = random.randint(0, self._copy_delay_us) if self._copy_delay_us else 0
        return self._copies.copy(stream, dst, src, stall_us, after)

    def load(self, index: int, layer: LayerBuffers, dst: torch.Tensor, after: Any = None) -> Any:
        return self._copy(self._copies.h2d, dst, layer.params, after)

    def compute_wait(self, event: Any) -> None:
        self._copies.compute_wait(event)

    def flush_grads(self, index: int, layer: LayerBuffers, src: torch.Tensor) -> Any:
        if index in self._unfolded:
            self._fold(index)  # the previous micro-batch's copy must be added before it is overwritten
        event = self._copy(self._copies.d2h, layer.grads, src)
        if self.accumulate:
            self._unfolded[index] = (event, self._first_micro)
        if self._last_micro:
            self._pending.append((index, event))
        return event

    def _fold(self, index: int) -> None:
        """Add a landed micro-batch gradient into the layer's accumulator (bf16, like torch's .grad)."""
        event, first = self._unfolded.pop(index)
        self._copies.host_wait(event)
        layer = self._layers[index]
        if first:
            layer.accum.copy_(layer.grads)
        else:
            layer.accum.add_(layer.grads)
        self._accumulated.add(index)

    def begin_micro(self, first: bool, last: bool) -> None:
        super().begin_micro(first, last)
        if first:
            self._accumulated.clear()

    def grad_sq_norm(self) -> float:
        return sum(float(sq_sum(self._layers[i].accum)) for i in sorted(self._accumulated))

    def clipped_step(self, scale: float) -> None:
        for i in self._accumulated:
            self._layers[i].accum.mul_(scale)
        self._step_layers(set(self._accumulated))

    def begin_step(self, hypers: list[Hyper]) -> None:
        self._hypers = hypers

    def _torch_optimizer(self) -> torch.optim.AdamW:
        if self._optimizer is None:
            by_group: dict[int, list[torch.nn.Parameter]] = {}
            for ranges in self._params:
                for g, p, _, _ in ranges:
                    by_group.setdefault(g, []).append(p)
            self._torch_groups = sorted(by_group)  # the Offloader's group of each torch param group
            self._optimizer = torch.optim.AdamW([{"params": by_group[g]} for g in self._torch_groups], lr=1e-3,
                                                fused=True)
            for ranges, layer in zip(self._params, self._layers):
                for _, p, b, e in ranges:
                    # Views of the layer's moment buffers, so state_dict/load_state_dict see one truth.
                    self._optimizer.state[p] = {"step": torch.tensor(0.0), "exp_avg": layer.exp_avg[b:e],
                                                "exp_avg_sq": layer.exp_avg_sq[b:e]}
        return self._optimizer

    def finish_step(self) -> float:
        """Step each layer as soon as its gradient copy has landed, in arrival order, rather than
        waiting for every copy first."""
        assert self._hypers, "begin_step was not called"
        waited = 0.0
        pending, self._pending = self._pending, []
        for index, event in pending:
            t0 = time.perf_counter()
            with span(self._timeline, "wait", f"u{index}'s gradient copy", index):
                self._copies.host_wait(event)
            if index in self._unfolded:
                self._fold(index)
            waited += time.perf_counter() - t0
            with span(self._timeline, "host step", f"step u{index}", index):
                self._step_layers({index})
        t0 = time.perf_counter()
        for index in list(self._unfolded):  # accumulation without a step here (clipping comes next)
            self._fold(index)
        return waited + time.perf_counter() - t0

    def _step_layers(self, stepped: set[int]) -> None:
        """torch's fused AdamW over the layers in `stepped`, from their gradient (sum)."""
        if self._fail_next_step:
            self._fail_next_step = False
            raise RuntimeError(f"PythonBackend: injected failure while stepping layers {sorted(stepped)}")
        if eight_bit(self.precision):
            self._step_layers_8bit(stepped)
            return
        if self.precision == "bf16-sr":
            self._step_layers_sr(stepped)
            return
        opt = self._torch_optimizer()
        for g, group in zip(self._torch_groups, opt.param_groups):
            h = self._hypers[g]
            group.update(lr=h.lr, betas=(h.beta1, h.beta2), eps=h.eps, weight_decay=h.weight_decay)
        for i in stepped:  # torch's AdamW steps exactly the parameters that have a .grad
            layer = self._layers[i]
            grad = layer.accum if layer.accum is not None else layer.grads
            if self.precision == "mixed":
                grad = self._fp32_grads[i].copy_(grad)
            for _, p, b, e in self._params[i]:
                opt.state[p]["step"].fill_(self._hypers[0].step - 1)  # torch's fused step increments it
                p.grad = grad[b:e]
        opt.step()
        for i in stepped:
            for _, p, _, _ in self._params[i]:
                p.grad = None
            if self.precision == "mixed":
                self._layers[i].trainable_params.copy_(self._layers[i].master)

    def _step_layers_sr(self, stepped: set[int]) -> None:
        """The layers in `stepped` stepped with stochastic rounding: layer i draws stream i (the engine's
        unit i), each group range from its offset in the layer."""
        for i in stepped:
            layer = self._layers[i]
            grad = layer.accum if layer.accum is not None else layer.grads
            for g, _, b, e in self._params[i]:
                h = self._hypers[g]
                adamw_step_sr(layer.params[b:e], grad[b:e], layer.exp_avg[b:e], layer.exp_avg_sq[b:e], lr=h.lr,
                              beta1=h.beta1, beta2=h.beta2, eps=h.eps, weight_decay=h.weight_decay, step=h.step,
                              sr_seed=self._sr_seed, sr_stream=i, sr_offset=b)

    def _step_layers_8bit(self, stepped: set[int]) -> None:
        """The layers in `stepped` stepped by the 8-bit rule in torch ops (eight_bit.reference_adamw8bit_step):
        each group range a span of its own, its blocks counted from its start (the "-sr" precision: layer i draws
        stream i, as in "bf16-sr")."""
        seed = self._sr_seed if stochastic(self.precision) else None
        for i in stepped:
            layer = self._layers[i]
            grad = layer.accum if layer.accum is not None else layer.grads
            block = 0
            for g, _, b, e in self._params[i]:
                h, blocks = self._hypers[g], slice(block, block + num_blocks(e - b))
                reference_adamw8bit_step(layer.params[b:e], grad[b:e], layer.exp_avg[b:e], layer.exp_avg_sq[b:e],
                                         layer.exp_avg_absmax[blocks], layer.exp_avg_sq_absmax[blocks], lr=h.lr,
                                         beta1=h.beta1, beta2=h.beta2, eps=h.eps, weight_decay=h.weight_decay,
                                         step=h.step, sr_seed=seed, sr_stream=i, sr_offset=b)
                block = blocks.stop

    def start_trace(self) -> None:
        self._timeline = Timeline()

    def stop_trace(self) -> list[tuple[str, str, int, int, int]]:
        timeline, self._timeline = self._timeline, None
        return timeline.events if timeline is not None else []

    def set_copy_delay(self, max_us: int) -> None:
        self._copy_delay_us = max(0, int(max_us))

    def set_step_delay(self, us: int) -> None:
        raise NotImplementedError("PythonBackend cannot delay its host steps: it steps every layer inside step(), "
                                  "after backward, so there is no step running alongside the device to slow down; "
                                  "use backend='native'")

    def fail_next_step(self) -> None:
        self._fail_next_step = True

    def fail_next_copy(self) -> None:
        self._fail_next_copy = True

    def pending_units(self) -> list[int]:
        return []  # every host step finishes inside finish_step or clipped_step

    def close(self) -> str | None:
        error = None
        if self._arena is not None:
            if self._pin:
                try:
                    torch.cuda.synchronize(self.device)  # no copy may still use the memory being unlocked
                except RuntimeError as e:  # a device fault: the context is gone, and its copies with it
                    error = str(e)
            self._arena.release()
        return error

    def release_memory(self) -> None:
        self._optimizer = None  # its state holds views of the moments
        self._params, self._fp32_grads = [], []
