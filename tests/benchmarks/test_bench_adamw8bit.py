"""benchmarks/bench_adamw8bit.py at its smallest: a row for the bf16 kernel and each 8-bit case, written into the
stem's directory alone."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_adamw8bit.py"


def test_bench_adamw8bit_writes_a_row_per_kernel_with_its_throughput(tmp_path) -> None:
    subprocess.run([sys.executable, str(BENCH), "--numel", "4099", "--tensors", "2", "--threads", "1", "--steps", "1",
                    "--warmup", "1", "--stem", str(tmp_path / "smoke")],  # an absolute stem: written there only
                   check=True, capture_output=True, cwd=tmp_path)
    result = json.loads((tmp_path / "smoke.json").read_text())
    names = [r["name"] for r in result["rows"]]
    assert names[0] == "native bf16 (bf16 moments)" and len(names) == 4
    assert all("8bit" in name for name in names[1:])
    assert all(r["elements_per_s"] > 0 for r in result["rows"])
    assert result["workload"]["total_elements"] == 2 * 2049
    assert "native bf16-8bit (fp32 grad)" in (tmp_path / "smoke.md").read_text()
