"""compare_curves: the windows' means, the first step off the reference, and for long curves each one's final
loss and largest gap to the reference over windows of 100 steps, all read from the metrics files given."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "compare_curves.py"


def _metrics(path: Path, losses: list[float]) -> str:
    path.write_text("".join(json.dumps({"step": i + 1, "loss": x}) + "\n" for i, x in enumerate(losses)))
    return str(path)


def test_long_curves_get_their_final_loss_and_largest_window_gap_to_the_first(tmp_path) -> None:
    ref = [3.0 - i / 1000 for i in range(300)]
    # off by 0.01 over steps 101-200 only, then back: the largest gap is that window's, not the last one's
    other = [x + (0.01 if 100 <= i < 200 else 0.0) for i, x in enumerate(ref)]
    files = [_metrics(tmp_path / "a.jsonl", ref), _metrics(tmp_path / "b.jsonl", other)]
    subprocess.run([sys.executable, str(SCRIPT), "--stem", str(tmp_path / "c"), "--windows", "0:100,200:300",
                    *files], check=True, capture_output=True, cwd=tmp_path)
    text = (tmp_path / "c.md").read_text()
    final = sum(ref[200:]) / 100
    assert f"| a | {final:.4f} | 0.0000 |" in text
    assert f"| b | {final:.4f} | 0.0100 |" in text
    assert "| b | 2.9505 | 2.7505 | 2.7010 | 101 |" in text  # the windows' means, the last loss, the step off


def test_short_curves_get_no_quality_table(tmp_path) -> None:
    files = [_metrics(tmp_path / "a.jsonl", [2.0] * 150), _metrics(tmp_path / "b.jsonl", [2.5] * 150)]
    subprocess.run([sys.executable, str(SCRIPT), "--stem", str(tmp_path / "c"), "--windows", "0:150", *files],
                   check=True, capture_output=True, cwd=tmp_path)
    text = (tmp_path / "c.md").read_text()
    assert "largest gap" not in text and "| b | 2.5000 | 2.5000 | 1 |" in text
