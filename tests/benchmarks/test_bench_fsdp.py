"""benchmarks/bench_fsdp.py on two gloo ranks of the CPU (a smoke run: the timings mean nothing): every mode
builds its model on meta, trains, and gets a row with each rank's memory, the loss curves near each other."""
from __future__ import annotations

import json
from pathlib import Path

from helpers import torchrun

SHAPE = ["--layers", "2", "--hidden", "64", "--intermediate", "128", "--heads", "4", "--kv-heads", "2",
         "--vocab", "256", "--batch", "2", "--seq", "32", "--steps", "2", "--warmup", "1"]


def test_bench_fsdp_runs_each_mode_on_two_cpu_ranks_and_writes_a_row_per_rank(tmp_path) -> None:
    bench = Path(__file__).resolve().parents[2] / "benchmarks"
    modes = "offload-torch,offload-overlap,offload-overlap-clip,resident,offload-torchfused,offload-cpuadamw-clip"
    torchrun(2, str(bench / "bench_fsdp.py"), "--device", "cpu", *SHAPE, "--modes", modes,
             "--stem", str(tmp_path / "smoke"), cwd=bench)  # an absolute stem: written there only
    rows = json.loads((tmp_path / "smoke.json").read_text())["rows"]
    assert [per_rank[0]["mode"] for per_rank in rows] == modes.split(",")
    assert all(len(per_rank) == 2 and all("error" not in r for r in per_rank) for per_rank in rows)
    torch_losses, overlap_losses = rows[0][0]["losses"], rows[1][0]["losses"]
    # bf16 parameters: the two AdamWs round differently, and three steps move the losses apart a little
    assert all(abs(a - b) <= 0.02 * abs(b) for a, b in zip(overlap_losses, torch_losses))
    assert "offload-overlap" in (tmp_path / "smoke.md").read_text()
    # the time after backward, for the offloaded modes only, within the step's
    assert all((r["after_backward_s"] is None) == (r["mode"] == "resident") for per_rank in rows for r in per_rank)
    assert all(0 < r["after_backward_s"] < r["step_s"] for per_rank in rows for r in per_rank if r["after_backward_s"])
