"""offload-train --fsdp under torchrun, two gloo ranks on the CPU: the embedded default trains, rank 0 alone logs,
the checkpoint holds the gathered weights as transformers reads them, a run stopped half way and resumed from its
distributed checkpoint ends exactly where the run without a stop does, a kill during a save leaves the last
complete checkpoint to resume from, a checkpoint one rank cannot write stops every rank with rank 0's line and
its continuation, and without clipping the shards step in backward, bit for bit as after it."""
from __future__ import annotations

import glob
import json
import os
import re
import shlex

import pytest

from helpers import file_size_limit, torchrun
from offload_ext.train import run_dir
from offload_ext.train.prior_run import complete_checkpoints

FLAGS = ("--fsdp", "--device", "cpu", "--steps", "4")


def _train(out, *flags: str, env: dict[str, str] | None = None, check: bool = True, clip: str | None = "1.0",
           **kwargs):
    clipping = ("--max-grad-norm", clip) if clip is not None else ()
    return torchrun(2, "-m", "offload_ext.train.cli", *FLAGS, *clipping, "--out", str(out), *flags,
                    env={"OFFLOAD_TRAIN_NO_BAR": "1", **(env or {})}, check=check, **kwargs)


def _rows(out) -> list[dict]:
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def _assert_same_weights(ours, theirs) -> None:
    """The gathered weights two runs' latest checkpoints hold, as transformers reads them, equal bit for bit."""
    from transformers import AutoModelForCausalLM

    a, b = (AutoModelForCausalLM.from_pretrained(out / "latest").state_dict() for out in (ours, theirs))
    assert a.keys() == b.keys()
    for name, tensor in a.items():
        assert tensor.equal(b[name]), name


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The run without a stop."""
    out = tmp_path_factory.mktemp("fsdp") / "whole"
    _train(out)
    return out


def test_fsdp_training_stopped_and_resumed_ends_where_the_run_without_a_stop_does(whole, tmp_path) -> None:
    halves = tmp_path / "halves"
    _train(halves, "--stop-after", "2")
    _train(halves, "--resume")
    ours, theirs = _rows(halves), _rows(whole)
    assert [r["step"] for r in ours] == [r["step"] for r in theirs] == [1, 2, 3, 4]  # one row a step: rank 0's
    assert [r["loss"] for r in ours] == [r["loss"] for r in theirs]
    assert all(r["clip"] in ("unclipped", "clipped") for r in ours)  # CPUAdamW steps after backward
    assert [s for s, _ in complete_checkpoints(halves)] == [2, 4]  # sealed step directories, one a save
    _assert_same_weights(halves, whole)


def test_fsdp_training_killed_while_saving_resumes_from_the_last_complete_checkpoint(whole, tmp_path) -> None:
    # rank 0 dies once step 4's files are written, before the checkpoint is sealed: step 2's stays the last whole
    # one, --resume takes it (never the torn step 4), and the run ends where the run without a kill does
    killed = tmp_path / "killed"
    done = _train(killed, "--save-every", "2", env={"OFFLOAD_TRAIN_KILL_AT": "trainer_state:4"}, check=False)
    assert done.returncode != 0
    assert [s for s, _ in complete_checkpoints(killed)] == [2]
    _train(killed, "--resume")
    assert [(r["step"], r["loss"]) for r in _rows(killed)] == [(r["step"], r["loss"]) for r in _rows(whole)]


def test_fsdp_training_without_clipping_steps_in_backward_exactly_as_after_it(tmp_path) -> None:
    # a norm no gradient reaches keeps the steps after backward and leaves every step unscaled: the same kernel on
    # the same gradients, so the losses and weights match bit for bit; two micro-batches a step, the first without
    # FSDP2's reduce-scatter (no gradient final yet: nothing may step on it)
    inside, after = tmp_path / "inside", tmp_path / "after"
    ran = _train(inside, "--grad-accum", "2", clip=None)
    assert "CPUAdamW stepping the shards in backward" in ran.stdout
    ran = _train(after, "--grad-accum", "2", clip="1e9")
    assert "CPUAdamW stepping the shards after backward" in ran.stdout
    assert [r["clip"] for r in _rows(after)] == ["unclipped"] * 4
    assert [(r["step"], r["loss"]) for r in _rows(inside)] == [(r["step"], r["loss"]) for r in _rows(after)]
    _assert_same_weights(inside, after)


def test_fsdp_a_checkpoint_one_rank_cannot_write_stops_every_rank_and_rank_0_says_how_to_continue(whole, tmp_path):
    # under a file size limit between the two ranks' shard files, rank 1's write of step 4's shards is refused and
    # rank 0's is not: every rank stops (none left waiting in a collective), the partial directory is removed,
    # rank 0 alone prints the one line, and the torchrun command it prints continues to the unstopped run's losses
    out = tmp_path / "refused"
    _train(out, "--stop-after", "2")
    shards = sorted(os.path.getsize(p) for p in glob.glob(str(out / "checkpoints" / "*" / "distributed" / "*.distcp")))
    assert len(shards) == 2 and shards[1] - shards[0] > 20_000, shards  # room for the limit between them
    done = _train(out, "--resume", check=False, preexec_fn=file_size_limit((shards[0] + shards[1]) // 2))
    assert done.returncode != 0
    lines = [x for x in done.stderr.splitlines() if x.startswith("offload-train: stopped")]
    assert len(lines) == 1, done.stderr[-6000:]
    assert [s for s, _ in complete_checkpoints(out)] == [2]
    assert not os.path.exists(run_dir.partial_path(str(out), 4))
    found = re.fullmatch(r"offload-train: stopped at step 4: its checkpoint could not be written \(\[Errno 27\] File "
                         r"too large\); its partial files were removed; last complete checkpoint: step 2 \(.*\); "
                         r"make room at --out \(each checkpoint here takes \d+\.\d MB, --keep-checkpoints 2 of them "
                         r"are kept\), then continue with: (.*)", lines[0])
    assert found, lines[0]
    command = shlex.split(found[1])
    assert command == ["torchrun", "--nproc-per-node", "2", "-m", "offload_ext.train.cli", *FLAGS,
                       "--max-grad-norm", "1.0", "--out", str(out), "--resume"]
    torchrun(2, *command[3:], env={"OFFLOAD_TRAIN_NO_BAR": "1"})
    assert [(r["step"], r["loss"]) for r in _rows(out)] == [(r["step"], r["loss"]) for r in _rows(whole)]
