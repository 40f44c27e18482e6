"""Draws one step of an Offloader timeline (Offloader.trace / offload-train --trace) as a PNG: a lane per
stream (python thread, H2D, D2H, host step, waits), so the overlap of the host steps with backward, or a
stall, shows at a glance.

    python benchmarks/plot_timeline.py timeline.json out.png --step 2
"""
from __future__ import annotations

import argparse
import gzip
import json

import _common


def load(path: str) -> tuple[list[str], list[dict]]:
    """(lane names in order, complete events each with its lane) of a trace file, gzipped (.gz) or not."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        trace = json.load(f)["traceEvents"]
    lanes = {e["tid"]: e["args"]["name"] for e in trace if e["ph"] == "M" and e["name"] == "thread_name"}
    events = [dict(e, lane=lanes[e["tid"]]) for e in trace if e["ph"] == "X"]
    return [lanes[t] for t in sorted(lanes)], events


def step_window(events: list[dict], step: int) -> tuple[float, float]:
    """From the start of the step-th optimizer step's first backward (0-based; with gradient accumulation a
    step holds several backward passes) to the start of the next step's first one (or the end)."""
    backwards = sorted(e["ts"] for e in events if e["lane"] == "python" and e["name"] == "backward")
    steps = sorted(e["ts"] for e in events if e["lane"] == "python" and e["name"] == "step")
    if not backwards:
        raise SystemExit("plot_timeline: the trace has no backward span (was it recorded by Offloader.trace?)")
    # a step's first backward: the first one, and each first one after a step() call
    starts = [b for k, b in enumerate(backwards) if k == 0 or any(backwards[k - 1] < t < b for t in steps)]
    if step >= len(starts):
        raise SystemExit(f"plot_timeline: --step {step}, but the trace holds {len(starts)} optimizer steps")
    end = starts[step + 1] if step + 1 < len(starts) else max(e["ts"] + e["dur"] for e in events)
    return starts[step], end


def plot(lanes: list[str], events: list[dict], window: tuple[float, float], out: str, title: str) -> None:
    plt = _common.pyplot("plot_timeline")
    from matplotlib.patches import Patch

    t0, t1 = window
    shown = [lane for lane in lanes if any(e["lane"] == lane for e in events)]
    fig, ax = plt.subplots(figsize=(14, 0.6 * len(shown) + 1.5))
    cmap = plt.get_cmap("tab20")
    units: set[int] = set()
    for row, lane in enumerate(reversed(shown)):
        for e in events:
            if e["lane"] != lane or e["ts"] + e["dur"] < t0 or e["ts"] > t1:
                continue
            unit = e["args"].get("unit", -1)
            units.add(unit)
            color = "0.6" if unit < 0 else cmap(unit % 20)
            start, width = (e["ts"] - t0) / 1e3, max(e["dur"] / 1e3, (t1 - t0) / 1e3 / 2000)
            ax.broken_barh([(start, width)], (row - 0.4, 0.8), facecolors=color, edgecolor="none")
    ax.set_yticks(range(len(shown)), list(reversed(shown)))
    ax.set_xlim(0, (t1 - t0) / 1e3)
    ax.set_xlabel("ms from the start of backward")
    ax.set_title(title)
    # One colour per unit (a layer's flat buffers; tab20's colours repeat every 20 units), grey for work of no
    # unit (launches, norms, the device optimizer). Lanes are the threads and streams that ran it.
    handles = [Patch(color=cmap(u % 20), label=f"unit {u}") for u in sorted(u for u in units if u >= 0)[:20]]
    if -1 in units:
        handles.append(Patch(color="0.6", label="no unit"))
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, title="colour",
                  title_fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("out")
    ap.add_argument("--step", type=int, default=0, help="which traced step (0-based backward pass)")
    ap.add_argument("--title", default=None)
    a = ap.parse_args()
    lanes, events = load(a.trace)
    plot(lanes, events, step_window(events, a.step), a.out, a.title or f"{a.trace}, step {a.step}")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
