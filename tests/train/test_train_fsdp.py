"""offload-train --fsdp under torchrun, two gloo ranks on the CPU: the embedded default trains, rank 0 alone logs,
the checkpoint holds the gathered weights as transformers reads them, and a run stopped half way and resumed
from its distributed checkpoint ends exactly where the run without a stop does."""
from __future__ import annotations

import json

from helpers import torchrun


def _train(out, *flags: str) -> None:
    torchrun(2, "-m", "offload_ext.train.cli", "--fsdp", "--device", "cpu", "--steps", "4", "--max-grad-norm", "1.0",
             "--out", str(out), *flags, env={"OFFLOAD_TRAIN_NO_BAR": "1"})


def _rows(out) -> list[dict]:
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_fsdp_training_stopped_and_resumed_ends_where_the_run_without_a_stop_does(tmp_path) -> None:
    whole, halves = tmp_path / "whole", tmp_path / "halves"
    _train(whole)
    _train(halves, "--stop-after", "2")
    _train(halves, "--resume")
    ours, theirs = _rows(halves), _rows(whole)
    assert [r["step"] for r in ours] == [r["step"] for r in theirs] == [1, 2, 3, 4]  # one row a step: rank 0's
    assert [r["loss"] for r in ours] == [r["loss"] for r in theirs]
    assert all(r["clip"] in ("unclipped", "clipped") for r in ours)  # CPUAdamW steps after backward

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(whole / "checkpoint")  # the gathered weights, whole
    resumed = AutoModelForCausalLM.from_pretrained(halves / "checkpoint")
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert a.equal(b), name
