"""Timeline: what the engine and the Offloader did, when, as a Chrome / Perfetto trace.

Lanes: "python" (the training thread: backward, step, each layer bound for compute), "H2D" and "D2H"
(each copy from its issue to its landing), "host step" (each slice of a host job: step, accumulate,
norm), "device redo" (clipped redos on the device, per piece: copies in, then step and copies back),
"wait" (the training thread blocked on the host, with the reason). Times are
time.monotonic_ns(), the clock the native engine records on. A torch.profiler run around the same code
adds its GPU streams (kernels, copies) as more lanes on that clock (Timeline.add_profile). Open the JSON
in ui.perfetto.dev or chrome://tracing; benchmarks/plot_timeline.py draws one step of it as a PNG.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

LANES = ("python", "H2D", "D2H", "host step", "device redo", "wait")
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")  # torch.profiler's device-side events
RUNTIME_CATEGORIES = ("cuda_runtime", "cuda_driver")      # its CUDA API calls, on the thread that made them


@dataclass
class Timeline:
    events: list[tuple[str, str, int, int, int]] = field(default_factory=list)  # lane, name, begin, end, unit

    def mark(self, lane: str, name: str, begin_ns: int, end_ns: int | None = None, unit: int = -1) -> None:
        self.events.append((lane, name, begin_ns, begin_ns if end_ns is None else end_ns, unit))

    def span(self, lane: str, name: str, unit: int = -1) -> "_Span":
        return _Span(self, lane, name, unit)

    def extend(self, events: list[tuple[str, str, int, int, int]]) -> None:
        self.events.extend(events)

    def add_profile(self, profile: Any, categories: tuple[str, ...] = GPU_CATEGORIES) -> int:
        """Merge a finished torch.profiler run (a `torch.profiler.profile`, or the path of its exported
        Chrome trace): each event of `categories` that overlaps this timeline's span goes on a lane per
        profiler stream ("GPU stream 7"; "torch ops" for "cpu_op"; "CUDA API 1234" for RUNTIME_CATEGORIES,
        a lane per calling thread, whose launches show how fast that thread feeds the GPU). Returns how many
        were added.

        The profiler stamps events on the wall clock (microseconds from its baseTimeNanoseconds); they are
        moved onto time.monotonic_ns() with the two clocks' offset read now, so a wall-clock step (NTP)
        between the run and this call shifts them by that much."""
        trace = _profiler_trace(profile)
        base = int(trace.get("baseTimeNanoseconds", 0))
        offset = time.time_ns() - time.monotonic_ns()
        lo = min((e[2] for e in self.events), default=None)
        hi = max((e[3] for e in self.events), default=None)
        added = 0
        for e in trace.get("traceEvents", []):
            if e.get("ph") != "X" or e.get("cat") not in categories:
                continue
            begin = base + round(float(e["ts"]) * 1e3) - offset
            end = begin + round(float(e.get("dur", 0)) * 1e3)
            if lo is not None and (end < lo or begin > hi):
                continue
            lane = ("torch ops" if e["cat"] == "cpu_op" else f"CUDA API {e.get('tid')}"
                    if e["cat"] in RUNTIME_CATEGORIES else f"GPU stream {e.get('tid')}")
            self.mark(lane, str(e.get("name", "?")), begin, end)
            added += 1
        return added

    def chrome_trace(self) -> dict:
        """The Trace Event Format: one thread per lane, complete ("X") events in microseconds."""
        origin = min((e[2] for e in self.events), default=0)
        lanes = list(LANES) + sorted({e[0] for e in self.events} - set(LANES))
        meta = [{"ph": "M", "pid": 1, "tid": k, "name": "thread_name", "args": {"name": lane}}
                for k, lane in enumerate(lanes)]
        meta += [{"ph": "M", "pid": 1, "tid": k, "name": "thread_sort_index", "args": {"sort_index": k}}
                 for k in range(len(lanes))]
        tid = {lane: k for k, lane in enumerate(lanes)}
        body = [{"ph": "X", "pid": 1, "tid": tid[lane], "name": name, "ts": (begin - origin) / 1e3,
                 "dur": max(end - begin, 0) / 1e3, "args": {"unit": unit}}
                for lane, name, begin, end, unit in sorted(self.events, key=lambda e: e[2])]
        return {"traceEvents": meta + body, "displayTimeUnit": "ms",
                "otherData": {"producer": "offload_ext", "clock": "time.monotonic_ns", "origin_ns": origin}}

    def write(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)


def _profiler_trace(profile: Any) -> dict:
    if isinstance(profile, (str, os.PathLike)):
        with open(profile) as f:
            return json.load(f)
    with tempfile.TemporaryDirectory() as tmp:  # the profiler exports to a file only
        path = os.path.join(tmp, "profile.json")
        profile.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)


def span(timeline: Timeline | None, lane: str, name: str, unit: int = -1) -> contextlib.AbstractContextManager:
    """A span on `timeline` while one is recording, else nothing."""
    return timeline.span(lane, name, unit) if timeline is not None else contextlib.nullcontext()


class _Span:
    def __init__(self, timeline: Timeline, lane: str, name: str, unit: int) -> None:
        self.timeline, self.lane, self.name, self.unit = timeline, lane, name, unit

    def __enter__(self) -> None:
        self.begin = time.monotonic_ns()

    def __exit__(self, *exc: object) -> None:
        self.timeline.mark(self.lane, self.name, self.begin, time.monotonic_ns(), self.unit)
