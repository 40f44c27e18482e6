"""Device ring: one part's layer buffers on the device, which layer each holds, and binding to them.

Layer i of a stack uses buffer i % len(buffers). A layer is bound (its parameters' .data made views of
its buffer) only after the compute stream waits for the copy that filled the buffer, so no kernel can
read a layer before it has landed, in forward and in checkpoint recompute alike. A layer's parameters are
pointed at its buffer once: the buffer of a position never changes, only what it holds (and re-pointing
nine parameters a layer, twice a micro-batch, was a Python cost the launching thread paid on every bind).

A prefetch that finds the layer's host step still running leaves the copy to the layer's bind, but marks
the compute stream's point: the copy issued at the bind waits for that point, as the prefetch's copy would
have, not for the layer before it as well (which made copy and compute take turns in every such layer: B1
without recompute, one slot per layer, forward 88 ms against 53). Anything else bound to the
buffer in between drops the mark, since its kernels come after it.

A layer whose frozen base is held quantized (base_dtype) is copied up in that form and dequantized at each bind
into one bf16 buffer per ring, which its base parameters are views of: layers run one after another on the
compute stream, and with every layer recomputed nothing keeps a layer's dequantized weights past its backward.

With a buffer per position (`eager`: and steps no clipping can redo), a layer's new weights go up as soon as
its host step is done, still inside the backward that produced its gradients (its buffer is free once they
are out), instead of when the next forward binds it. After the short last backward of an accumulation the
host is still stepping the lowest layers when the forward starts, and the forward was copy-bound behind
them (half a batch computes a layer in less time than its copy takes).
"""
from __future__ import annotations

import time
from typing import Any

from offload_ext.engine.backends import Backend, LayerBuffers
from offload_ext.engine.timeline import Timeline
from offload_ext.models.quantized_base import dequantize
from offload_ext.planning.layout import Part, Span, Unit


def _dequantized_places(unit: Unit) -> list[tuple[Span, int]]:
    """The unit's quantized spans, each with its start in the ring's dequantized buffer (one after another)."""
    places, start = [], 0
    for s in unit.spans:
        if s.quant is not None:
            places.append((s, start))
            start += s.numel
    return places


class DeviceRing:
    def __init__(self, part: Part, host: list[LayerBuffers], backend: Backend, buffers: int,
                 eager: bool = False) -> None:
        self.units = part.units
        self.host = host            # per position: the unit's host buffers
        self.backend = backend
        largest = max(u.numel for u in self.units)
        self.buffers = [backend.device_buffer(largest) for _ in range(buffers)]
        # per position: (span, where its values go in the dequantized buffer) of each weight held quantized
        self.quantized = [_dequantized_places(u) for u in self.units]
        widest = max((start + s.numel for places in self.quantized for s, start in places), default=0)
        self.dequantized = backend.device_buffer(widest) if widest else None
        self.holds: list[int | None] = [None] * buffers  # per buffer: the position whose weights it holds
        self.filled: list[Any] = [None] * buffers        # per buffer: the copy that filled it
        self.wanted: list[tuple[int, Any] | None] = [None] * buffers  # per buffer: (position, compute mark)
        self.copies = 0                                   # host-to-device layer copies so far
        self.early = 0                                    # of them, copied up right after their step (eager)
        self.pointed = [False] * len(self.units)          # per position: parameters are views of its buffer
        self.timeline: Timeline | None = None             # set while the Offloader traces
        self.eager = eager and buffers >= len(self.units)
        self.stepping: list[int] = []  # eager: positions whose final step is queued, not yet copied up
        self.fresh: set[int] = set()   # eager: positions copied up after that step, before the next restart
        self.final = True              # the backward running is its step's last micro-batch

    def __len__(self) -> int:
        return len(self.units)

    def _buffer_of(self, i: int) -> int:
        return i % len(self.buffers)

    def holds_layer(self, i: int) -> bool:
        return self.holds[self._buffer_of(i)] == i

    def load(self, i: int) -> None:
        """Start copying position i's weights into its buffer (after the compute enqueued so far)."""
        b = self._buffer_of(i)
        dst = self.buffers[b][: self.host[i].params.numel()]
        wanted, self.wanted[b] = self.wanted[b], None
        after = wanted[1] if wanted is not None and wanted[0] == i else None
        self.filled[b] = self.backend.load(self.units[i].index, self.host[i], dst, after)
        self.holds[b] = i
        self.copies += 1

    def bind(self, i: int) -> None:
        """Make position i resident and point its parameters at its buffer."""
        b = self._buffer_of(i)
        if self.wanted[b] is not None and self.wanted[b][0] != i:
            self.wanted[b] = None  # what runs on the buffer now comes after the mark
        if self.holds[b] != i:
            self.load(i)
        self.backend.compute_wait(self.filled[b])
        if self.timeline is not None:
            self.timeline.mark("python", f"bind u{self.units[i].index}", time.monotonic_ns(), unit=self.units[i].index)
        buf = self.buffers[b]
        if not self.pointed[i]:
            places = dict((id(s), start) for s, start in self.quantized[i])
            for s in self.units[i].spans:
                at, src = (places[id(s)], self.dequantized) if s.quant else (s.offset, buf)
                s.param.data = src[at:at + s.numel].view(s.shape)
            self.pointed[i] = True
        for s, start in self.quantized[i]:  # after the copy is waited for, on the stream the layer runs on
            dequantize(s.quant, s.shape, buf[s.offset:s.offset + s.stored], self.dequantized[start:start + s.numel]
                       .view(s.shape))

    def prefetch(self, i: int) -> None:
        """Load position i ahead of its use, unless it is resident or its host step is still running (then
        its own bind loads it, from the compute point marked here: waiting here would hold the kernels before it
        back)."""
        if not 0 <= i < len(self) or self.holds_layer(i):
            return
        if self.backend.ready(self.units[i].index):
            self.load(i)
        else:
            self.wanted[self._buffer_of(i)] = (i, self.backend.mark_compute())

    def before_layer(self, i: int, recompute: bool) -> None:
        """Position i is about to run (in its checkpoint recompute, inside backward: going down): bind it
        and prefetch the next one in this direction."""
        self.bind(i)
        self.prefetch(i - 1 if recompute else i + 1)

    def begin_backward(self, last: bool) -> None:
        """The coming backward is its step's last micro-batch or not (before it, a flush is summed on the
        host, and the weights stay as they are)."""
        self.final = last

    def flushed(self, i: int) -> None:
        """Position i's gradients went to the host. Once every parameter of a layer has its gradient, every
        kernel that reads its weights has been enqueued (each computes that weight's gradient too), unless
        some are frozen (LoRA's base: its input gradient may still be to come): those layers go up as before."""
        unit = self.units[i]
        if self.eager and self.final and unit.trainable == len(unit.spans):
            self.stepping.append(i)

    def upload_stepped(self) -> None:
        """Copy up the new weights of every position whose step is done (after the compute enqueued so far,
        which is the last to read the old ones)."""
        for i in [i for i in self.stepping if self.backend.ready(self.units[i].index)]:
            self.stepping.remove(i)
            self.load(i)
            self.fresh.add(i)
            self.early += 1

    def restart(self, stepped: bool = True) -> None:
        """The host weights changed (a step, or a load when `stepped` is False): every device copy is stale
        but those copied up after their step; prefetch position 0."""
        if stepped:
            self.upload_stepped()
        self.holds = [h if stepped and h in self.fresh else None for h in self.holds]
        self.stepping.clear()
        self.fresh.clear()
        self.wanted = [None] * len(self.buffers)
        self.prefetch(0)
