"""Compares offload-train loss curves (metrics.jsonl files): mean loss over windows of steps, and the first
step at which each curve leaves the first one by more than --tol; for curves of two windows of 100 steps or
more, each one's final loss (the mean of its last 100 steps) and its largest gap to the first over windows of 100;
with --png, the curves drawn too. Rounding differences (another cross-entropy kernel, another chunking, another
precision) grow over a run; this shows how far.

    python benchmarks/compare_curves.py --stem loss_curves_default $OUT/loss_curve_*.jsonl  # gpu_check's loss-curves
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import _common

WINDOW = 100  # steps a mean is taken over in the quality table: one batch's noise is larger than the gaps


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", help="metrics.jsonl files; the first is the reference")
    ap.add_argument("--windows", default="0:50,50:100,100:150,150:200", help="step ranges [a, b) to average")
    ap.add_argument("--tol", type=float, default=1e-3)
    ap.add_argument("--stem", default="loss_curves")
    ap.add_argument("--png", default=None, metavar="PATH",
                    help="also draw the curves (loss by step, smoothed over --smooth steps) into PATH (matplotlib)")
    ap.add_argument("--smooth", type=int, default=10)
    ap.add_argument("--title", default=None)
    return ap.parse_args()


def losses(path: str) -> list[float]:
    with open(path) as f:
        return [json.loads(line)["loss"] for line in f]


def window_means(losses: list[float], window: int = WINDOW) -> list[float]:
    return [statistics.fmean(losses[k:k + window]) for k in range(0, len(losses) - window + 1, window)]


def quality_table(curves: dict[str, list[float]], ref: str | None, label: str = "curve") -> str:
    """Each curve's final loss (the mean of its last WINDOW steps) and its largest gap to the curve `ref` over
    windows of WINDOW steps ('-' without `ref`)."""
    lines = [f"| {label} | final loss (mean of the last {WINDOW} steps) | largest gap to {ref or '-'} "
             f"(windows of {WINDOW}) |", "|---|---:|---:|"]
    means = window_means(curves[ref]) if ref is not None else None
    for name, losses in curves.items():
        gap = max(abs(a - b) for a, b in zip(window_means(losses), means)) if means is not None else None
        lines.append(f"| {name} | {statistics.fmean(losses[-WINDOW:]):.4f} | "
                     f"{'-' if gap is None else f'{gap:.4f}'} |")
    return "\n".join(lines)


def plot(curves: dict[str, list[float]], out: str, smooth: int, title: str) -> None:
    plt = _common.pyplot("compare_curves")
    fig, ax = plt.subplots(figsize=(9, 5))
    for name, c in curves.items():
        # Trailing mean over up to `smooth` steps: per-batch noise hides the trend otherwise.
        means = [statistics.mean(c[max(0, i + 1 - smooth):i + 1]) for i in range(len(c))]
        ax.plot(range(1, len(c) + 1), means, label=name, linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss (trailing mean of {smooth} steps)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    a = parse()
    windows = [tuple(int(x) for x in w.split(":")) for w in a.windows.split(",")]
    curves = {os.path.basename(p).removesuffix(".jsonl"): losses(p) for p in a.files}
    ref = next(iter(curves.values()))
    columns = [f"mean loss, steps {lo + 1}-{hi}" for lo, hi in windows] + ["final", "first step off the first curve"]
    head = "| curve | " + " | ".join(columns) + " |"
    lines = [head, "|---|" + "---:|" * (len(windows) + 2)]
    for name, c in curves.items():
        off = next((i + 1 for i, (x, y) in enumerate(zip(c, ref)) if abs(x - y) > a.tol), None)
        means = " | ".join(f"{statistics.mean(c[lo:hi]):.4f}" for lo, hi in windows)
        lines.append(f"| {name} | {means} | {c[-1]:.4f} | {off if off is not None else '-'} |")
    markdown = "\n".join(lines)
    if min(len(c) for c in curves.values()) >= 2 * WINDOW:
        markdown += "\n\n" + quality_table(curves, next(iter(curves)))
    print(markdown)
    if a.png:
        plot(curves, a.png, a.smooth, a.title or a.stem)
        print(f"wrote {a.png}")
    for path in _common.write_results(a.stem, {"files": a.files, "tol": a.tol, "windows": windows}, markdown):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
