"""The native backend: the C++ engine's pinned pool, copy streams and overlapped AdamW scheduler.

A layer's gradient copy carries a host callback that queues the layer's fused AdamW step on the
engine's worker threads at once, so the CPU steps layer i while the GPU runs backward below it;
the step writes bf16 params straight into the pinned buffer the next forward copies from.
With async_step (the default) step() does not wait for the layers still queued when backward ends:
the engine steps the lowest layer first, and each layer's next copy waits for its own step, so the
CPU work left over from backward overlaps the next forward. The engine steps a unit in slices and
chooses again after each, so the lowest layer goes first even when a higher one has started.
In bf16, gradients land in a small ring of pinned staging slots rather than one buffer per layer: a
slot is reused only once the step that reads it is done, which halves the memory to page-lock. Clipping's
engine side is native_clipping's; planning and reserving host memory, native_host's.
"""
from __future__ import annotations

import os
import time
from typing import Any

import torch

from offload_ext._ext import native
from offload_ext.config import eight_bit, moment_dtype, stochastic
from offload_ext.engine.backends.base import Backend, Hyper, LayerBuffers, absmaxes, moments
from offload_ext.engine.backends.native_clipping import EngineClipping
from offload_ext.engine.backends.native_host import fit, reserve
from offload_ext.engine.device_redo import DeviceRedo
from offload_ext.engine.redo_tuning import RedoTuning
from offload_ext.optim.clipping import sum_squares
from offload_ext.optim.eight_bit import eight_bit_codes
from offload_ext.planning import host_sizes
from offload_ext.planning.host_sizes import NativeHostPlan


def default_engine_threads() -> int:
    # All usable CPUs but one for the Python thread that launches GPU work, and one for the
    # CUDA driver's callback/copy threads.
    return max(1, len(os.sched_getaffinity(0)) - 2)


class NativeBackend(Backend):
    def __init__(self, device: torch.device, precision: str, *, num_threads: int | None = None,
                 pin_threads: bool = True, slab_bytes: int = 256 << 20, grad_slots: int | None = None,
                 accumulate: bool = False, async_step: bool = True, slice_elements: int | None = None,
                 speculative_units: frozenset[int] = frozenset(),
                 grad_accum: int = 1, sr_seed: int = 0, kept_layers: bool = False,
                 device_redo_units: frozenset[int] = frozenset(), host_nice: int = 0,
                 redo_candidates: tuple[tuple[int, frozenset[int]], ...] = (),
                 params_first: bool = True) -> None:
        super().__init__(device, precision, accumulate)
        # "bf16-sr", "bf16-8bit-sr": unit i steps with stochastic rounding from stream i of this seed.
        self._sr_seed = sr_seed if stochastic(precision) else None
        self._codes = eight_bit_codes() if eight_bit(precision) else None  # the 8-bit moments' maps, for add_unit
        ext = native()
        self._direction, self._jobs = ext.Direction, ext.Job
        # Clipping: which units speculate (plan() drops the lowest of them when host memory cannot hold their
        # second buffers) and whose redos run on the device (plan() keeps those that speculate).
        self._clip = EngineClipping(ext.Job, speculative_units, device_redo_units, grad_accum, redo_candidates)
        self._device_redo: DeviceRedo | None = None  # prepare()
        self._groups: list[tuple[tuple[int, int, int], ...]] = []  # per unit: (group, begin, end)
        self._hypers: list[Hyper] = []  # this step's, per group
        self._grad_accum = grad_accum
        self._kept_layers = kept_layers  # some layers run without recompute: one gradient slot per layer
        self.asynchronous = async_step
        if device.type == "cuda" and not ext.native_info()["cuda"]:
            raise RuntimeError("Offloader: this offload_ext build has no CUDA support (built CPU-only: see "
                               "offload_ext.build_info()); reinstall with a CUDA toolkit, or use backend='python'")
        index = -1 if device.type == "cpu" else torch.cuda.current_device() if device.index is None else device.index
        self._engine = ext.Engine(index, num_threads or default_engine_threads(), pin_threads, slab_bytes, host_nice)
        # After the norm, a step stores the params first and the moments in a pass of their own, later: the next
        # forward's copy waits for the params alone (StepScheduler::set_params_first).
        self._engine.set_params_first(params_first)
        self._slice_elements = slice_elements  # None: chosen in prepare()
        if slice_elements is not None:
            self._engine.set_slice_elements(slice_elements)
        self._count = 0  # units added so far; the engine numbers them 0, 1, ... as new_layer() is called
        self._grad_slots = grad_slots  # None: chosen in prepare()
        self._ring: list[torch.Tensor] = []
        self._slot_owner: list[int | None] = []  # per slot: the unit whose step reads it
        self._own_grads: set[int] = set()  # units with a grad buffer of their own, outside the ring
        self._flushed: set[int] = set()    # units whose gradients came this step
        self._layers: list[LayerBuffers] = []  # per unit
        self._host_plan: NativeHostPlan | None = None  # plan(): the host buffers to reserve
        self._before: int | None = None         # plan(): the host memory available then

    def plan(self, sizes: list[tuple[int, int]], own_grads: list[tuple[int, int]] = ()) -> None:
        """Choose the gradient slots and the slicing, then check host memory for the plan, speculating as
        high up as it fits; nothing is allocated."""
        planned = NativeHostPlan.choose(self.precision, tuple(sizes), tuple(own_grads), grad_slots=self._grad_slots,
                                        accumulate=self.accumulate, speculative_units=self._clip.units,
                                        grad_accum=self._grad_accum, kept_layers=self._kept_layers,
                                        device_redo_units=self._clip.device_redo_units)
        self._grad_slots = planned.grad_slots
        self._slot_owner = [None] * self._grad_slots
        if self._slice_elements is None and (0 < self._grad_slots < len(sizes) or self._clip.speculative):
            # The engine steps units in slices so that a lower layer can overtake one already started.
            # An overtaken unit keeps its staging slot meanwhile, and with a ring shared by several
            # layers the layer that reuses the slot would wait in backward: step whole units instead,
            # unless the caller chose the slice (slice_elements). Speculative steps too: a redo must let a
            # started one finish first, while one not started becomes the clipped step itself, and with
            # slices every lower layer landing starts one more (B1 clipping every step: all 16 had started
            # when backward ended).
            self._engine.set_slice_elements(1 << 62)
        before = host_sizes.available_host_bytes()
        self._adopt(fit(planned, before))
        host_sizes.check_host_memory(self._host_plan.need(), before, self._host_plan.alternatives())
        self._before = before

    def _adopt(self, plan: NativeHostPlan) -> None:
        self._host_plan = plan
        self._clip.adopt(plan)

    def prepare(self, sizes: list[tuple[int, int]], own_grads: list[tuple[int, int]] = ()) -> None:
        """Page-lock all pinned memory at once (slabs in parallel): layer params and the grad ring."""
        if self._host_plan is None:
            self.plan(sizes, own_grads)
        try:
            self._adopt(reserve(self._engine, self._host_plan, self._before))
        except MemoryError:
            self._engine = None  # its pools (nothing but the pinned slabs yet) go with it
            raise
        largest = max(t for _, t in sizes)
        self._ring = [self._engine.pinned_empty(max(1, largest), torch.bfloat16) for _ in range(self._grad_slots)]
        redo_units = self._clip.device_redo_units
        if redo_units:
            self._device_redo = DeviceRedo(self.device, max(sizes[i][1] for i in redo_units),
                                           moment_dtype(self.precision), self._codes, self._sr_seed)

    def new_layer(self, numel: int, trainable: int, own_grads: bool = False,
                  groups: tuple[tuple[int, int, int], ...] | None = None) -> LayerBuffers:
        e = self._engine
        params = e.pinned_empty(numel, torch.bfloat16)
        if own_grads or self._clip.keep_grads:
            self._own_grads.add(self._count)
            grads = e.pinned_empty(max(1, trainable), torch.bfloat16)[:trainable]
        else:
            grads = self._ring[self._count % self._grad_slots][:trainable]
        # A unit redone on the device has its state page-locked: the device copies it in and out.
        redo = self._count in self._clip.device_redo_units
        zeros, empty = (self._pinned_zeros, e.pinned_empty) if redo else (e.host_zeros, e.host_empty)
        exp_avg, exp_avg_sq = moments(zeros, self.precision, trainable)
        absmax = absmaxes(zeros, self.precision, trainable, groups)
        master_buf = empty(trainable, torch.float32) if self.precision == "mixed" else None
        accum = grads if self._clip.keep_grads else e.host_empty(trainable, torch.bfloat16) if self.accumulate else None
        stepped = master_buf if self.precision == "mixed" else params[:trainable]
        # Speculative clipping: a step writes into the second buffers and leaves the state before it intact.
        alt: tuple[torch.Tensor, ...] = ()
        if self._count in self._clip.units:
            # mixed: the master; bf16: whole params, page-locked (the next forward copies from them once swapped)
            first = zeros(trainable, torch.float32) if master_buf is not None else e.pinned_empty(numel, torch.bfloat16)
            alt = (first, *moments(zeros, self.precision, trainable),
                   *absmaxes(zeros, self.precision, trainable, groups))
        layer = LayerBuffers(params, grads, exp_avg, exp_avg_sq, master_buf, trainable, accum, alt,
                             exp_avg_absmax=absmax[0] if absmax else None,
                             exp_avg_sq_absmax=absmax[1] if absmax else None)
        out = layer.trainable_params if self.precision == "mixed" else None
        unit = e.add_unit(stepped, grads, exp_avg, exp_avg_sq, out, accum=accum, groups=list(groups or ()),
                          alt=[alt[0][:trainable], *alt[1:]] if alt else [], sr_seed=self._sr_seed,
                          sr_stream=self._count, eight_bit=[*absmax, self._codes] if absmax else [])
        if unit != self._count:
            raise RuntimeError(f"Offloader: the engine numbered unit {self._count} as {unit}")
        self._count += 1
        self._layers.append(layer)
        self._groups.append(tuple(groups) if groups else ((0, 0, trainable),))
        return layer

    @property
    def device_redo_units(self) -> frozenset[int]:
        return self._clip.tuning.units & self._clip.device_redo_units

    @property
    def redo_tuning(self) -> RedoTuning | None:
        return self._clip.tuning

    def _pinned_zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self._engine.pinned_empty(numel, dtype).zero_()

    def load(self, index: int, layer: LayerBuffers, dst: torch.Tensor, after: Any = None) -> Any:
        # Its step writes the params we copy (the waits release the GIL).
        self._wait_device_redo(index)
        self._engine.wait_unit(index, reason=f"u{index}'s host step, before its copy to the device", params_only=True)
        self._follow_swap(index, layer)  # "bf16": a speculative step left the params in the other buffer
        return self._engine.copy(self._direction.H2D, dst, layer.params, trace_unit=index,
                                 after_event=after.cuda_event if after is not None else 0)

    def ready(self, index: int) -> bool:
        return self._engine.ready(index, params_only=True)

    def compute_wait(self, event: Any) -> None:
        self._engine.compute_wait(event)

    def _job(self, index: int) -> Any:
        """The engine Job a landed gradient copy of unit `index` triggers (with speculation and a host
        norm, a SPECULATIVE_STEP follows it)."""
        jobs, clipping = self._jobs, self._clip.job(index, self._last_micro)
        if clipping is not None:
            return clipping
        if not self.accumulate:
            return jobs.STEP
        if self._first_micro:
            return jobs.ACCUMULATE_FIRST
        return jobs.ACCUMULATE_STEP if self._last_micro else jobs.ACCUMULATE

    def begin_micro(self, first: bool, last: bool) -> None:
        super().begin_micro(first, last)
        if first:
            self._flushed.clear()
            self._clip.begin()

    def hold_speculation(self) -> None:
        # Each held step then steps once in place, clipped or not, or is dropped for a redo on the device.
        self._clip.hold(self._engine)

    def device_sq_norm(self, grads: list[torch.Tensor]) -> torch.Tensor | float:
        # one read of each bf16 gradient (torch's float64 path: 2.5 ms at the end of each B1 step with clipping,
        # against ~0.2 ms)
        return torch.stack([sum_squares(g) for g in grads]).sum() if grads else 0.0

    def grad_sq_norm(self) -> float:
        return self._clip.sq_norm(self._engine, self._flushed)

    def clipped_step(self, scale: float) -> None:
        self._clip.step(self._engine, self._flushed, scale, self._redo_on_device)
        if not self.asynchronous:
            self._engine.wait_all()

    def _redo_on_device(self, index: int, scale: float) -> None:
        """Unit `index`'s clipped redo on the device: the engine drops its speculative step if not started (or
        waits for it), the layer's fields then name the buffers to fill and `alt` the state before."""
        self._engine.take_over(index)
        layer = self._layers[index]
        self._follow_swap(index, layer)
        t, mixed = layer.trainable, layer.master is not None
        live = (layer.master if mixed else layer.trainable_params, layer.exp_avg, layer.exp_avg_sq)
        before = (layer.alt[0][:t], *layer.alt[1:])
        ranges = [(self._hypers[g], a, b) for g, a, b in self._groups[index]]
        if self._codes is not None:
            live += (layer.exp_avg_absmax, layer.exp_avg_sq_absmax)
            return self._device_redo.redo_8bit(index, live, before, layer.grads[:t], ranges, scale)
        # mixed: the stepped master rounded to bf16 also goes to the params the next forward copies
        self._device_redo.redo(index, live, before, layer.grads[:t], ranges, scale,
                               out=layer.trainable_params if mixed else None)

    def _wait_device_redo(self, index: int) -> None:
        if self._device_redo is not None:
            self._device_redo.wait(index)

    def flush_grads(self, index: int, layer: LayerBuffers, src: torch.Tensor) -> Any:
        self._wait_device_redo(index)  # its redo may still read the kept gradient this copy overwrites
        if self._clip.keep_grads:  # so may its last step's moments pass, which the forward did not wait for
            self._engine.wait_unit(index, reason=f"u{index}'s moments pass, before its gradients land where it reads")
        slot = None if index in self._own_grads else index % self._grad_slots
        owner = self._slot_owner[slot] if slot is not None else index
        if owner is not None and owner != index:
            # Its step still reads this slot (the wait releases the GIL).
            reason = f"u{owner}'s host step, before u{index}'s gradients reuse its slot"
            self._engine.wait_unit(owner, reason=reason)
        elif not self._clip.keep_grads:
            # The unit's own last job may still read the slot: an accumulate job of the micro-batch before, when
            # the layer stayed on the device (no load() in between waited for it). Its params are what the job
            # reads last; a trailing moments pass reads the accumulator, not the slot.
            self._engine.wait_unit(index, reason=f"u{index}'s last host job, before its next gradients land where "
                                   "it reads", params_only=True)
        job = self._job(index)
        device_norm = self._clip.device_norm(index, self._last_micro)
        if device_norm:
            self._clip.take_device_norm(index, src)
        event = self._engine.copy(self._direction.D2H, layer.grads, src, notify_unit=index, job=job,
                                  then_step=self._clip.then_step(index, self._last_micro, device_norm))
        # Only a copy that was enqueued counts: one that raised leaves the bookkeeping as it was.
        if slot is not None:
            self._slot_owner[slot] = index
        self._flushed.add(index)
        return event

    def begin_step(self, hypers: list[Hyper]) -> None:
        self._engine.check()  # a failed step from before surfaces here at the latest
        self._hypers = list(hypers)
        for group, h in enumerate(hypers):
            self._engine.set_hyper(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.step, group=group)

    def finish_step(self) -> float:
        if self.asynchronous:
            self._engine.check()
            return 0.0
        t0 = time.perf_counter()
        self._engine.wait_all()
        return time.perf_counter() - t0

    def settle(self) -> None:
        self._engine.wait_all()
        if self._device_redo is not None:
            self._device_redo.wait_all()
        self._follow_swaps()

    def _follow_swaps(self) -> None:
        """Point each layer's state fields at the buffers its speculative steps left live."""
        for i, layer in enumerate(self._layers):
            self._follow_swap(i, layer)

    def _follow_swap(self, index: int, layer: LayerBuffers) -> None:
        if layer.alt and self._engine.swapped(index) != layer.swapped:
            layer.swap_state()

    def wait_seconds(self) -> float:
        return self._engine.stats()["wait_seconds"]

    def stats(self) -> dict[str, Any]:
        redos = self._device_redo.count if self._device_redo is not None else 0
        tuning = self._clip.tuning
        return {**self._engine.stats(), **self._engine.memory_stats(), "device_redos": redos,
                "device_redo_layers": tuning.layers, "device_redo_chosen": tuning.chosen is not None,
                # what the choice was made from: a result file explains it without the run's console
                "device_redo_times_s": {layers: min(t) for layers, t in tuning.times.items()}}

    def set_copy_delay(self, max_us: int) -> None:
        self._engine.set_debug_delay_us(int(max_us))

    def set_step_delay(self, us: int) -> None:
        self._engine.set_debug_step_delay_us(int(us))

    def fail_next_step(self) -> None:
        self._engine.inject_failure()

    def fail_next_copy(self) -> None:
        self._engine.fail_next_copy()

    def fault_next_copy(self) -> None:
        if self.device.type != "cpu":
            raise NotImplementedError("fault_next_copy simulates a device fault on the simulated device "
                                      "(device='cpu') only; on CUDA cause a real one (a device-side assert)")
        self._engine.fault_next_copy()

    def pending_units(self) -> list[int]:
        return [i for i in range(self._count) if not self._engine.ready(i)]

    def start_trace(self) -> None:
        self._engine.start_trace()
        if self._device_redo is not None:
            self._device_redo.start_trace()

    def stop_trace(self) -> list[tuple[str, str, int, int, int]]:
        redos = self._device_redo.stop_trace() if self._device_redo is not None else []
        return [tuple(e) for e in self._engine.stop_trace()] + redos

    def close(self) -> str | None:
        # The copy streams are checked and synchronized before the host steps are waited for: after a device
        # fault no copy lands, and a wait for their steps would never end.
        error = self._engine.close() or None
        if self._device_redo is not None:
            try:
                self._device_redo.wait_all()
            except RuntimeError as e:
                error = error or str(e)
        self._follow_swaps()
        return error

    def fail(self, why: str) -> None:
        self._engine.fail(why)

    def release_memory(self) -> None:
        self._ring = []
        self._engine.release_free_memory()
