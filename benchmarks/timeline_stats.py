"""One step of an Offloader timeline (Offloader.trace, bench_train --trace [--trace-gpu]) in numbers: each
lane's busy time, the GPU compute stream's busy share in each forward and backward pass (a trace with the
profiler's GPU lanes) and, with its CUDA API and torch-op lanes, which thread launched the pass's kernels, how
fast, and which ops took the launching threads' time; the Python thread's waits by reason and the host steps by
kind. What plot_timeline.py draws, as text that two runs can be compared by.

    python benchmarks/timeline_stats.py timeline.json --step 1
"""
from __future__ import annotations

import argparse
import re
from collections import defaultdict

from plot_timeline import load, step_window

_UNIT = re.compile(r"\bu\d+\b")


def busy_ms(events: list[dict], lo: float, hi: float) -> float:
    """Time inside [lo, hi] covered by at least one of `events` (overlaps counted once), in ms."""
    spans = sorted((max(lo, e["ts"]), min(hi, e["ts"] + e["dur"])) for e in events)
    total, end = 0.0, lo
    for a, b in spans:
        if b > max(a, end):
            total += b - max(a, end)
            end = b
    return total / 1e3


def passes(events: list[dict], lo: float, hi: float) -> list[tuple[str, float, float]]:
    """The step's passes in order: each backward span of the Python thread, and the forward before it
    (from the end of the previous pass, or the window's start)."""
    out, prev = [], lo
    for e in sorted((e for e in events if e["lane"] == "python" and e["name"] == "backward" and lo <= e["ts"] < hi),
                    key=lambda e: e["ts"]):
        out += [("forward", prev, e["ts"]), ("backward", e["ts"], e["ts"] + e["dur"])]
        prev = e["ts"] + e["dur"]
    return out


def _launches(events: list[dict], lo: float, hi: float) -> str:
    """How many events start inside [lo, hi] and the median idle gap between consecutive ones: a stream fed
    by a launch-bound thread shows many events with short, even gaps."""
    started = sorted((e for e in events if lo <= e["ts"] < hi), key=lambda e: e["ts"])
    gaps = sorted(max(0.0, b["ts"] - (a["ts"] + a["dur"])) for a, b in zip(started, started[1:]))
    median = f"{gaps[len(gaps) // 2]:.0f} us" if gaps else "-"
    return f"{len(started)} events, gap {median}"


def _feeding(api: dict[str, list[dict]], lo: float, hi: float) -> str:
    """How the pass's busiest launching thread fed the GPU: its kernel launches started inside [lo, hi], the
    median time one call took and the median interval between one launch's start and the next. Calls that
    grow longer point at the driver (a lock another thread holds); intervals that grow with calls as before
    point at the thread itself (its CPU, or the Python between launches)."""
    launches = {lane: sorted((e for e in events if "Launch" in e["name"] and lo <= e["ts"] < hi),
                             key=lambda e: e["ts"]) for lane, events in api.items()}
    lane, calls = max(launches.items(), key=lambda kv: len(kv[1]), default=(None, []))
    if len(calls) < 2:
        return "no launches"
    durations = sorted(e["dur"] for e in calls)
    intervals = sorted(b["ts"] - a["ts"] for a, b in zip(calls, calls[1:]))
    mean = (calls[-1]["ts"] - calls[0]["ts"]) / (len(calls) - 1)
    return (f"{lane}: {len(calls)} launches, call {durations[len(durations) // 2]:.1f} us, "
            f"interval {intervals[len(intervals) // 2]:.1f} us (mean {mean:.1f})")


def _costliest_ops(ops: list[dict], lo: float, hi: float, most: int = 6) -> str:
    """The torch ops started inside [lo, hi] whose CPU time adds up to most, by name (nested ops count in their
    own name and in their callers': compare a name between two traces, not names within one)."""
    total: dict[str, list[float]] = defaultdict(list)
    for e in ops:
        if lo <= e["ts"] < hi:
            total[e["name"]].append(e["dur"])
    ranked = sorted(total.items(), key=lambda kv: -sum(kv[1]))[:most]
    return ", ".join(f"{name} {sum(d) / 1e3:.1f} ms ({len(d)})" for name, d in ranked) or "none"


def report(lanes: list[str], events: list[dict], window: tuple[float, float]) -> list[str]:
    lo, hi = window
    inside = [e for e in events if e["ts"] < hi and e["ts"] + e["dur"] > lo]
    by_lane = defaultdict(list)
    for e in inside:
        by_lane[e["lane"]].append(e)
    lines = [f"step window {(hi - lo) / 1e3:.1f} ms", "lane: busy ms (events)"]
    lines += [f"  {lane}: {busy_ms(by_lane[lane], lo, hi):.1f} ({len(by_lane[lane])})"
              for lane in lanes if by_lane[lane]]
    gpu = [lane for lane in by_lane if lane.startswith("GPU")]
    if gpu:  # the compute stream: the GPU lane with the most kernels
        compute = max(gpu, key=lambda lane: len(by_lane[lane]))
        lines.append(f"{compute} busy share per pass (events started in it; the gaps between them, median):")
        api = {lane: by_lane[lane] for lane in by_lane if lane.startswith("CUDA API")}
        for name, a, b in passes(inside, lo, hi):
            if b > a:
                share = busy_ms(by_lane[compute], a, b) / ((b - a) / 1e3)
                lines.append(f"  {name} {(b - a) / 1e3:.1f} ms: {share:.0%}, {_launches(by_lane[compute], a, b)}")
                if api:
                    lines.append(f"    launched by {_feeding(api, a, b)}")
                if by_lane.get("torch ops"):
                    lines.append(f"    costliest torch ops: {_costliest_ops(by_lane['torch ops'], a, b)}")
    for lane, title in (("wait", "Python thread's waits by reason: ms (count, longest)"),
                        ("host step", "host steps by kind: ms (count, longest)")):
        groups = defaultdict(list)
        for e in by_lane.get(lane, []):
            groups[_UNIT.sub("uN", e["name"])].append(e["dur"] / 1e3)
        if groups:
            lines.append(title)
            ranked = sorted(groups.items(), key=lambda kv: -sum(kv[1]))
            lines += [f"  {k}: {sum(v):.1f} ({len(v)}, {max(v):.1f})" for k, v in ranked]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", help="a timeline JSON (or .json.gz)")
    ap.add_argument("--step", type=int, default=0, help="which traced optimizer step (0-based)")
    a = ap.parse_args()
    lanes, events = load(a.trace)
    print("\n".join(report(lanes, events, step_window(events, a.step))))


if __name__ == "__main__":
    main()
