"""benchmarks/bench_dequant.py at its smallest, on the CPU: a row for each way of each format, every way giving the
op's bits, written into the stem's directory alone."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_dequant.py"


def test_bench_dequant_times_each_way_of_each_format_and_checks_its_bits(tmp_path) -> None:
    subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--rows", "64", "--cols", "192", "--steps", "1",
                    "--warmup", "1", "--stem", str(tmp_path / "smoke")], check=True, capture_output=True, cwd=tmp_path)
    rows = json.loads((tmp_path / "smoke.json").read_text())["rows"]
    ways = {(r["format"], r["way"]) for r in rows}
    assert {(f, w) for f in ("int8", "fp8", "nf4") for w in ("offload_ext op", "torch ops (the rule)")} <= ways
    assert all(r["same_bits"] and r["gb_per_s"] > 0 for r in rows)
    assert "| nf4 | offload_ext op |" in (tmp_path / "smoke.md").read_text()
