"""bench_integrations runs each integration's loop in its own process and writes one row per mode with its ratio to
the Offloader's own loop (a two-layer model on the simulated device: the code path, not the figures)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_integrations.py"


def test_every_mode_runs_and_is_compared_with_the_offloaders_loop(tmp_path) -> None:
    subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--tiny", "--steps", "3", "--warmup", "1",
                    "--batch", "2", "--seq", "16", "--stem", str(tmp_path / "r")], check=True, capture_output=True)
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert [r["mode"] for r in rows] == ["offloader", "trainer", "offloader-noclip", "per-layer", "offloader-auto",
                                         "trainer-auto"]
    assert all(len(r["step_times_s"]) == 3 and r["tokens_per_s"] > 0 for r in rows)
    # random tokens at clip 1.0: every step clips, and the timed steps come once the device-redo count is decided
    # (two layers: one on the device or none; the drop-in and the loop without clipping measure nothing)
    waited = {r["mode"]: r["tuning_warmup_steps"] for r in rows}
    assert waited["offloader-noclip"] == waited["per-layer"] == 0
    assert waited["offloader"] == waited["trainer"] > 0
    table = (tmp_path / "r.md").read_text()
    # each integration beside the Offloader's loop on its own recipe: the drop-in has no clipping
    assert "1.000x (offloader) |" in table and "x (offloader-noclip) |" in table.split("| per-layer |")[1]
