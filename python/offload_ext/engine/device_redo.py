"""Device redo: when clipping triggers, the top layers' exact redo runs on the device while the host redoes
the layers below, from the lowest up. The next forward follows the host's redos up the stack and finds the
top layers done, instead of chasing the host through every layer (B1: 16 host redos at ~8.2 ms
each, 130 ms the next forward chased). The device takes its layers lowest first too, the order the forward
reaches them.

A unit's redo reads the state before its speculative step (params, both moments) and its kept gradient,
copies them in on a side stream, steps them with adamw_step's CUDA kernel (the host kernel's bits: see
adamw_cuda.cu; in the 8-bit precisions adamw8bit_step's, with the moments' absmaxes) and copies the result back
into the buffers its speculative step had made live ("mixed": the fp32 master and moments, and the bf16 params the
next forward copies). The next forward's copy of that layer, and the unit's next gradient copy, wait for that
(wait()). On the simulated
device the same path runs with the CPU kernel and plain copies."""
from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from offload_ext import ops
from offload_ext.optim.eight_bit import BLOCK, CODES, num_blocks
from offload_ext.planning.gpu import REDO_SETS, redo_piece


# Sets of device buffers: the copies in of one piece of a unit fill one set while the piece before is stepped
# and copied back from the other. A piece is at most REDO_PIECE elements (256 MB of device memory in all).
class DeviceRedo:
    """`state`: the host moments' dtype (bf16; fp32 in "mixed", whose params are fp32 masters; uint8 codes in the
    8-bit precisions, which also bring their two maps, `codes`, and `sr_seed` when the params round
    stochastically)."""

    def __init__(self, device: torch.device, largest: int, state: torch.dtype = torch.bfloat16,
                 codes: torch.Tensor | None = None, sr_seed: int | None = None) -> None:
        piece = redo_piece(largest)
        mixed, eight = state == torch.float32, state == torch.uint8

        def one_set() -> dict[str, torch.Tensor]:
            def empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
                return torch.empty(numel, dtype=dtype, device=device)
            bufs = dict(p=empty(piece, torch.float32 if mixed else torch.bfloat16), g=empty(piece, torch.bfloat16),
                        m=empty(piece, state), v=empty(piece, state))
            if mixed:  # the stepped master rounded to bf16
                bufs["o"] = empty(piece, torch.bfloat16)
            if eight:  # one absmax of each moment a block
                bufs["am"], bufs["av"] = (empty(num_blocks(piece), torch.float32) for _ in range(2))
            return bufs

        self._sets = [one_set() for _ in range(REDO_SETS)]
        self._codes = codes.cpu().split(CODES) if eight else None  # the CUDA kernel takes CPU maps by value
        self._sr_seed = sr_seed
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
        n, piece, names, done = grad.numel(), self._sets[0]["p"].numel(), ("p", "m", "v"), None
        for start in range(0, n, piece):
            end = min(n, start + piece)
            pieces = [(h, max(a, start) - start, min(b, end) - start) for h, a, b in ranges if a < end and b > start]
            back = [(t[start:end], k) for t, k in zip(live, names)]
            back += [(out[start:end], "o")] if out is not None else []
            done = self._piece(unit, [(k, t[start:end]) for k, t in zip(names, before)] + [("g", grad[start:end])],
                               functools.partial(self._step, pieces, scale), back)
        self._finish(unit, done)

    def redo_8bit(self, unit: int, live: Sequence[torch.Tensor], before: Sequence[torch.Tensor], grad: torch.Tensor,
                  ranges: Sequence[tuple[Any, int, int]], scale: float) -> None:
        """redo() in the 8-bit precisions: `live` and `before` hold params, exp_avg, exp_avg_sq and their two
        absmaxes, one a block of each group range counted from its start (backends.base.absmaxes); each range
        is stepped as the host steps it, a span of its own (offload_ext.optim.eight_bit's rule, the params'
        stochastic rounding drawing stream `unit` from the range's start)."""
        # a piece is whole blocks of its range (a range shorter than a block is one piece: the largest is no longer)
        piece = max(BLOCK, self._sets[0]["p"].numel() // BLOCK * BLOCK)
        first, names, done = 0, ("p", "m", "v", "am", "av"), None
        for h, a, b in ranges:
            for start in range(a, b, piece):
                elems = slice(start, min(b, start + piece))
                blocks = slice(first + (start - a) // BLOCK, first + num_blocks(elems.stop - a))
                cuts = (elems, elems, elems, blocks, blocks)
                step = functools.partial(self._step_8bit, h, unit, elems, blocks.stop - blocks.start, scale)
                done = self._piece(unit, [(k, t[c]) for k, t, c in zip(names, before, cuts)] + [("g", grad[elems])],
                                   step, [(t[c], k) for t, k, c in zip(live, names, cuts)])
            first += num_blocks(b - a)
        self._finish(unit, done)

    @staticmethod
    def _step(pieces: Sequence[tuple[Any, int, int]], scale: float, bufs: dict[str, torch.Tensor]) -> None:
        p, g, m, v, o = (bufs.get(k) for k in ("p", "g", "m", "v", "o"))
        for h, a, b in pieces:
            ops.adamw_step(p[a:b], g[a:b], m[a:b], v[a:b], lr=h.lr, beta1=h.beta1, beta2=h.beta2, eps=h.eps,
                           weight_decay=h.weight_decay, step=h.step, grad_scale=scale,
                           param_out=o[a:b] if o is not None else None)

    def _step_8bit(self, h: Any, unit: int, elems: slice, blocks: int, scale: float,
                   bufs: dict[str, torch.Tensor]) -> None:
        n = elems.stop - elems.start
        g = bufs["g"][:n]
        if scale != 1.0:
            g.mul_(scale)  # bf16(grad * scale), one rounding: the host kernel's clipped gradient
        ops.adamw8bit_step(bufs["p"][:n], g, bufs["m"][:n], bufs["v"][:n], bufs["am"][:blocks], bufs["av"][:blocks],
                           *self._codes, lr=h.lr, beta1=h.beta1, beta2=h.beta2, eps=h.eps,
                           weight_decay=h.weight_decay, step=h.step, sr_seed=self._sr_seed, sr_stream=unit,
                           sr_offset=elems.start)

    def _finish(self, unit: int, done: Any) -> None:
        if done is not None:
            self._pending[unit] = done
        self.count += 1

    def _piece(self, unit: int, copies_in: Sequence[tuple[str, torch.Tensor]],
               step: Callable[[dict[str, torch.Tensor]], None], copies_back: Sequence[tuple[torch.Tensor, str]]) -> Any:
        """One piece through the next set of buffers: `copies_in` (buffer, source) on the copy stream, then `step`
        over the set and `copies_back` (destination, buffer) on the work stream, each copy at the buffer's start;
        the event after the copies back (None on the CPU)."""
        bufs, free = self._sets[self._next], self._free[self._next]
        with self._stream(self._copy_in):
            if free is not None:
                self._copy_in.wait_event(free)
            start = self._now(self._copy_in) if self._trace is not None else None
            for name, src in copies_in:
                bufs[name][:src.numel()].copy_(src, non_blocking=True)
            landed = self._record(self._copy_in)
            landed_at = landed if landed is not None else time.monotonic_ns()
        with self._stream(self._work):
            if landed is not None:
                self._work.wait_event(landed)
            step(bufs)
            for dst, name in copies_back:
                dst.copy_(bufs[name][:dst.numel()], non_blocking=True)
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
