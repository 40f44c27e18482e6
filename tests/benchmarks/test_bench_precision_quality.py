"""bench_precision_quality: every precision trains the embedded default from the same weights on the same batches,
and its table is made from the curves it keeps."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_precision_quality.py"


def test_each_precision_starts_from_the_same_loss_and_the_table_reads_its_curves(tmp_path) -> None:
    subprocess.run([sys.executable, str(BENCH), "--steps", "100", "--modes", "mixed,bf16-8bit", "--stem",
                    str(tmp_path / "q")], check=True, capture_output=True, cwd=tmp_path)
    result = json.loads((tmp_path / "q.json").read_text())
    mixed, eight = result["curves"]["mixed"], result["curves"]["bf16-8bit"]
    assert len(mixed) == len(eight) == 100 and mixed[0] == eight[0]  # the first loss comes before any step
    assert mixed[1:] != eight[1:]
    gap = abs(sum(mixed) - sum(eight)) / 100
    assert f"| bf16-8bit | {sum(eight) / 100:.4f} | {gap:.4f} |" in (tmp_path / "q.md").read_text()
