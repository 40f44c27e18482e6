"""benchmarks/bench_host_passes.py at its smallest, with bf16 and with 8-bit moments: every pass of a step after
the norm timed as its params and moments parts (or whole with --one-pass), written into the stem's directory."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_host_passes.py"


@pytest.mark.parametrize("precision", ["bf16", "bf16-8bit"])
@pytest.mark.parametrize("one_pass", [False, True])
def test_bench_host_passes_times_each_pass_of_each_unit_in_either_precision(tmp_path, precision, one_pass) -> None:
    stem = tmp_path / "smoke"
    subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--numel", "5000", "--units", "2", "--skew", "0",
                    "--steps", "1", "--warmup", "1", "--threads", "1", "--precision", precision, "--passes",
                    "step,speculative,scale_step,redo", "--stem", str(stem)] + (["--one-pass"] if one_pass else []),
                   check=True, capture_output=True, cwd=tmp_path)
    result = json.loads(stem.with_suffix(".json").read_text())
    after_norm = ["scale_step", "redo"] if one_pass else ["scale_step params", "scale_step moments", "redo params",
                                                          "redo moments"]
    assert [r["pass"] for r in result["rows"]] == ["step", "speculative", *after_norm]
    assert result["precision"] == precision
    assert all(len(r["ms_per_unit"]) == 2 and r["median_even_ms"] > 0 for r in result["rows"])
