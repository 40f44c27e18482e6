"""Device redo: when clipping triggers, the top layers' exact redo runs on the device while the host redoes
the layers below, from the lowest up. The next forward follows the host's redos up the stack and finds the
top layers done, instead of chasing the host through every layer (B1: 16 host redos at ~8.2 ms
each, 130 ms the next forward chased). The device takes its layers lowest first too, the order the forward
reaches them.

A unit's redo reads the state before its speculative step (params, both moments) and its kept gradient,
copies them in on a side stream, steps them with adamw_step's CUDA kernel (the host kernel's bits: see
adamw_cuda.cu) and copies the result back into the buffers its speculative step had made live ("mixed":
the fp32 master and moments, and the bf16 params the next forward copies). The next
forward's copy of that layer, and the unit's next gradient copy, wait for that (wait()). On the simulated
device the same path runs with the CPU kernel and plain copies."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

import torch

from offload_ext import ops
from offload_ext.planning.gpu import REDO_SETS, redo_piece


# Sets of device buffers: the copies in of one piece of a unit fill one set while the piece before is stepped
# and copied back from the other. A piece is at most REDO_PIECE elements (256 MB of device memory in all).
class DeviceRedo:
    def __init__(self, device: torch.device, largest: int, state: torch.dtype = torch.bfloat16) -> None:
        piece = redo_piece(largest)
        mixed = state == torch.float32

        def one_set() -> tuple[torch.Tensor | None, ...]:
            p, m, v = (torch.empty(piece, dtype=state, device=device) for _ in range(3))
            g = torch.empty(piece, dtype=torch.bfloat16, device=device)
            return p, g, m, v, torch.empty(piece, dtype=torch.bfloat16, device=device) if mixed else None

        self._sets = [one_set() for _ in range(REDO_SETS)]
        cuda = device.type == "cuda"
        # The lowest priority (torch's default; the engine's copy streams have the highest): the next forward's
        # weight copies go first where both have work queued.
        self._copy_in = torch.cuda.Stream(device) if cuda else None
        self._work = torch.cuda.Stream(device) if cuda else None
        self._free: list[Any] = [None] * REDO_SETS  # per set: the event after its last copy back
        self._pending: dict[int, Any] = {}          # unit -> the event after its copy back
        self._next = 0
        self.count = 0  # redos run on the device so far
        # While traced: per piece (unit, start, landed, done), CUDA events with timing or monotonic_ns times;
        # on CUDA a reference event and the monotonic_ns it was seen done at put the events on that clock.
        self._trace: list[tuple[int, Any, Any, Any]] | None = None
        self._ref: tuple[Any, int] | None = None

    def _stream(self, stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def _record(self, stream: torch.cuda.Stream | None) -> Any:
        if stream is None:
            return None
        event = torch.cuda.Event(enable_timing=self._trace is not None)
        event.record(stream)
        return event

    def _now(self, stream: torch.cuda.Stream | None) -> Any:
        """A point of the trace: an event on `stream` (CUDA) or the clock now (the simulated device)."""
        return self._record(stream) if stream is not None else time.monotonic_ns()

    def start_trace(self) -> None:
        self._trace = []
        if self._copy_in is not None:
            ref = torch.cuda.Event(enable_timing=True)
            ref.record(self._copy_in)
            ref.synchronize()
            self._ref = (ref, time.monotonic_ns())

    def stop_trace(self) -> list[tuple[str, str, int, int, int]]:
        """The traced pieces on the "device redo" lane: each one's copies in, then its step and copies back."""
        if self._trace is None:
            return []
        self.wait_all()
        points, self._trace = self._trace, None

        def ns(point: Any) -> int:
            if self._ref is None:
                return point
            point.synchronize()
            ref, at = self._ref
            return at + round(ref.elapsed_time(point) * 1e6)

        events = []
        for unit, start, landed, done in points:
            events.append(("device redo", f"copy in u{unit}", ns(start), ns(landed), unit))
            events.append(("device redo", f"step, copy back u{unit}", ns(landed), ns(done), unit))
        return events

    def redo(self, unit: int, live: Sequence[torch.Tensor], before: Sequence[torch.Tensor], grad: torch.Tensor,
             ranges: Sequence[tuple[Any, int, int]], scale: float, out: torch.Tensor | None = None) -> None:
        """Step unit `unit` from `before` (params or fp32 master, exp_avg, exp_avg_sq: its state before the
        speculative step) with bf16(grad * scale) into `live` (the same three), each group range [begin, end)
        with its Hyper; `out` ("mixed"): where the stepped master goes rounded to bf16."""
        n, piece = grad.numel(), self._sets[0][0].numel()
        for start in range(0, n, piece):
            end = min(n, start + piece)
            pieces = [(h, max(a, start) - start, min(b, end) - start) for h, a, b in ranges if a < end and b > start]
            targets = [t[start:end] for t in live] + ([out[start:end]] if out is not None else [])
            done = self._piece(unit, targets, [t[start:end] for t in before], grad[start:end], pieces, scale)
        if done is not None:
            self._pending[unit] = done
        self.count += 1

    def _piece(self, unit: int, live: Sequence[torch.Tensor], before: Sequence[torch.Tensor], grad: torch.Tensor,
               ranges: Sequence[tuple[Any, int, int]], scale: float) -> Any:
        """One piece through the next set of buffers; the event after its copy back (None on the CPU)."""
        n = grad.numel()
        p, g, m, v, o = (buf[:n] if buf is not None else None for buf in self._sets[self._next])
        free = self._free[self._next]
        with self._stream(self._copy_in):
            if free is not None:
                self._copy_in.wait_event(free)
            start = self._now(self._copy_in) if self._trace is not None else None
            for dst, src in zip((p, m, v, g), (*before, grad)):
                dst.copy_(src, non_blocking=True)
            landed = self._record(self._copy_in)
            landed_at = landed if landed is not None else time.monotonic_ns()
        with self._stream(self._work):
            if landed is not None:
                self._work.wait_event(landed)
            for h, a, b in ranges:
                ops.adamw_step(p[a:b], g[a:b], m[a:b], v[a:b], lr=h.lr, beta1=h.beta1, beta2=h.beta2, eps=h.eps,
                               weight_decay=h.weight_decay, step=h.step, grad_scale=scale,
                               param_out=o[a:b] if o is not None else None)
            for dst, src in zip(live, (p, m, v, o)):
                dst.copy_(src, non_blocking=True)
            done = self._record(self._work)
        if self._trace is not None:
            self._trace.append((unit, start, landed_at, done if done is not None else time.monotonic_ns()))
        self._free[self._next] = done
        self._next = (self._next + 1) % REDO_SETS
        return done

    def wait(self, unit: int) -> None:
        """Block until unit `unit`'s last device redo has landed in its host buffers (the GIL released)."""
        done = self._pending.pop(unit, None)
        if done is not None:
            done.synchronize()

    def wait_all(self) -> None:
        for unit in list(self._pending):
            self.wait(unit)
