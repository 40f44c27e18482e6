"""Runs you can watch: each metrics row to TensorBoard (--report-to tensorboard), and the curves of loss, learning
rate, gradient norm and tokens/s drawn into --out/curves.png at every checkpoint (when matplotlib is there)."""
from __future__ import annotations

import importlib.util
import json
import os
from typing import Any

from offload_ext.train.errors import UsageError
from offload_ext.train.prior_run import CURVES, TENSORBOARD

_PANELS = (("loss", "loss"), ("lr", "learning rate"), ("grad_norm", "gradient norm, before clipping"),
           ("tokens_per_s", "tokens/s"))


def check_report_to(report_to: str) -> None:
    """Before anything is allocated: the package a --report-to needs is installed."""
    if report_to == "tensorboard" and importlib.util.find_spec("tensorboard") is None:
        raise UsageError("--report-to tensorboard needs the tensorboard package: pip install tensorboard")


class Watch:
    """What a run shows besides metrics.jsonl and the progress bar."""

    def __init__(self, out: str, report_to: str, lead: bool) -> None:
        self.out = out
        self.writer = None
        self.drawing = lead and importlib.util.find_spec("matplotlib") is not None
        if lead and report_to == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=os.path.join(out, TENSORBOARD))
        if lead and not self.drawing:
            print("offload-train: curves.png is drawn when matplotlib is installed: pip install matplotlib",
                  flush=True)

    def log(self, row: dict[str, Any]) -> None:
        if self.writer is None:
            return
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)):
                self.writer.add_scalar(f"train/{key}", value, row["step"])
        self.writer.flush()

    def draw(self) -> None:
        """--out/curves.png from the whole metrics.jsonl (a resumed run's steps included)."""
        path = os.path.join(self.out, "metrics.jsonl")
        if not self.drawing or not os.path.exists(path):
            return
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        if rows:
            _draw(rows, os.path.join(self.out, CURVES))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _draw(rows: list[dict[str, Any]], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 6.5), sharex=True)
    for ax, (key, label) in zip(axes.flat, _PANELS):
        points = [(r["step"], r[key]) for r in rows if key in r]
        if points:
            ax.plot(*zip(*points), linewidth=1)
        ax.set_title(label if points else f"{label}: logged with --max-grad-norm", fontsize=10)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("step")
    fig.tight_layout()
    partial = png + ".partial.png"  # whole or absent under its name: a viewer never reads half a file
    fig.savefig(partial, dpi=100)
    plt.close(fig)
    os.replace(partial, png)
