"""Runs you can watch: curves.png drawn at every checkpoint, TensorBoard logs with --report-to tensorboard, and
a missing package named with the pip line that installs it."""
from __future__ import annotations

import importlib.util
import json

import pytest

from offload_ext.train import cli as train

FAST = ["--device", "cpu-sim", "--model", "tiny", "--steps", "6", "--batch-size", "2", "--seq-len", "32"]


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="drawing needs matplotlib")
def test_the_curves_are_drawn_with_each_checkpoint(tmp_path) -> None:
    train.run(train.parse_args(["--out", str(tmp_path), *FAST, "--save-every", "3", "--max-grad-norm", "1.0"]))
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all("grad_norm" in r for r in rows)  # the panel it feeds


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="needs tensorboard")
def test_report_to_tensorboard_logs_every_metrics_row(tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train.run(train.parse_args(["--out", str(tmp_path), *FAST, "--report-to", "tensorboard"]))
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    losses = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [e.value for e in events.Scalars("train/loss")]
    assert logged == pytest.approx(losses, rel=1e-6)  # TensorBoard stores float32
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 7))


def test_report_to_tensorboard_without_it_is_the_pip_line(tmp_path, capsys, monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(SystemExit) as exited:
        train.main(["--out", str(tmp_path), *FAST, "--report-to", "tensorboard"])
    assert exited.value.code == 2 and not tmp_path.joinpath("metrics.jsonl").exists()
    assert capsys.readouterr().err.strip().endswith(
        "--report-to tensorboard needs the tensorboard package: pip install tensorboard")
