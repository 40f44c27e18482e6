"""offload-train's checkpoints are whole or refused: a crash at any write boundary of a save resumes exactly
like the run without one, a torn checkpoint is refused naming its file, a run is never overwritten unasked,
Ctrl-C and a checkpoint the system refuses to write (on a real full disk too) say how to continue, a save that
will not fit is warned of a save interval ahead, and a resume with other flags names the one that differs."""
from __future__ import annotations

import errno
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest

from helpers import file_size_limit
from offload_ext.train import checkpoint_manifest, prior_run, run_dir
from offload_ext.train import cli as train

RUN = ["--device", "cpu-sim", "--backend", "native", "--steps", "4", "--batch-size", "2", "--seq-len", "16",
       "--save-every", "1"]
# The engine on the simulated device everywhere, and on a GPU where there is one (the tiny model, as on the CPU).
DEVICES = [pytest.param("cpu-sim", id="cpu-sim"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def _on(device: str) -> list[str]:
    return ["--device", device, "--model", "tiny", *RUN[2:]]


@pytest.fixture(autouse=True)
def _no_progress_bar(monkeypatch):
    monkeypatch.setenv("OFFLOAD_TRAIN_NO_BAR", "1")


def _losses(out) -> list[tuple[int, float]]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [(r["step"], r["loss"]) for r in map(json.loads, f)]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> list[tuple[int, float]]:
    """The losses of the run without a crash."""
    out = tmp_path_factory.mktemp("straight") / "run"
    os.environ["OFFLOAD_TRAIN_NO_BAR"] = "1"
    train.run(train.parse_args(["--out", str(out), *RUN]))
    return _losses(out)


class _Killed(BaseException):
    """Stands for the process's death at a boundary: nothing after it runs (no handler catches it)."""


def _crash_at(monkeypatch, name: str, step: int) -> None:
    def hook(at: str, at_step: int) -> None:
        if (at, at_step) == (name, step):
            raise _Killed(name)
    monkeypatch.setattr(run_dir, "crash_hook", hook)


def _snapshot(out) -> dict[str, float]:
    return {os.path.join(d, n): os.stat(os.path.join(d, n), follow_symlinks=False).st_mtime_ns
            for d, dirs, names in os.walk(out) for n in names + dirs}


def _exits_2(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        train.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err


# Every commit point of a save, step 3's (the first with an older checkpoint to delete): a crash there
# leaves either step 2's checkpoint or step 3's complete, and the resumed run trains what is left exactly.
@pytest.mark.parametrize("boundary", run_dir.BOUNDARIES + ("saved",))
def test_a_crash_at_every_write_boundary_resumes_exactly_like_the_uninterrupted_run(tmp_path, monkeypatch, straight,
                                                                                   boundary) -> None:
    out = str(tmp_path / "run")
    _crash_at(monkeypatch, boundary, 3)
    with pytest.raises(_Killed):
        train.run(train.parse_args(["--out", out, *RUN]))
    monkeypatch.setattr(run_dir, "crash_hook", None)
    resumed_from = prior_run.find(out, "latest").step
    assert resumed_from == (3 if boundary in ("renamed", "linked", "pruned", "saved") else 2)
    train.run(train.parse_args(["--out", out, *RUN, "--resume"]))
    assert _losses(out) == straight  # each step once: the rows after the checkpoint trimmed and trained again
    assert [s for s, _ in prior_run.complete_checkpoints(out)] == [3, 4]  # --keep-checkpoints 2
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["step-000003", "step-000004"]  # no leftovers


# A run resumed from an older checkpoint abandons the later ones; a crash just after its first save is sealed must
# not leave one of them the newest complete, which a plain --resume would take.
@pytest.mark.parametrize("boundary", ["superseded", "renamed", "linked"])
def test_a_crash_after_a_resumed_runs_first_save_resumes_from_that_save_not_the_abandoned_future(
        tmp_path, monkeypatch, straight, boundary) -> None:
    out = str(tmp_path / "run")
    keep3 = [*RUN, "--keep-checkpoints", "3"]
    train.run(train.parse_args(["--out", out, *keep3]))
    step2 = prior_run.complete_checkpoints(out)[0][1]
    _crash_at(monkeypatch, boundary, 3)
    with pytest.raises(_Killed):
        train.run(train.parse_args(["--out", out, *keep3, "--resume", step2]))
    monkeypatch.setattr(run_dir, "crash_hook", None)
    # before the rename only step 2 is complete; after it the new step 3 too, and no abandoned step 3 or 4
    expected = [2] if boundary == "superseded" else [2, 3]
    assert [s for s, _ in prior_run.complete_checkpoints(out)] == expected
    train.run(train.parse_args(["--out", out, *keep3, "--resume"]))
    assert _losses(out) == straight


def test_a_sigkill_in_the_middle_of_a_save_resumes_exactly(tmp_path, straight) -> None:
    out = str(tmp_path / "run")
    env = dict(os.environ, OFFLOAD_TRAIN_KILL_AT="engine:3")  # weights of step 3 written, its engine state not
    proc = subprocess.run([sys.executable, "-m", "offload_ext.train.cli", "--out", out, *RUN], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert os.path.isdir(os.path.join(out, "checkpoints", "step-000003.partial"))
    train.run(train.parse_args(["--out", out, *RUN, "--resume"]))
    assert _losses(out) == straight


def test_a_torn_checkpoint_is_refused_naming_the_file_and_the_previous_one_resumes(tmp_path, capsys,
                                                                                  straight) -> None:
    out = str(tmp_path / "run")
    train.run(train.parse_args(["--out", out, *RUN, "--stop-after", "3"]))
    step2, step3 = (p for _, p in prior_run.complete_checkpoints(out))
    torn = os.path.join(step3, "model.safetensors")
    size = os.path.getsize(torn)
    os.truncate(torn, size // 2)  # a write cut short
    capsys.readouterr()
    err = _exits_2(["--out", out, *RUN, "--resume"], capsys)
    assert (f"offload-train: error: --resume: torn checkpoint: {torn} has {size // 2} bytes, the manifest of step 3 "
            f"says {size}; resume from the previous one with --resume {step2}\n") == err
    train.run(train.parse_args(["--out", out, *RUN, "--resume", step2]))
    assert _losses(out) == straight


def test_a_part_of_another_step_is_refused_by_its_hash(tmp_path, capsys) -> None:
    out = str(tmp_path / "run")
    train.run(train.parse_args(["--out", out, *RUN, "--stop-after", "3"]))
    step2, step3 = (p for _, p in prior_run.complete_checkpoints(out))
    for name in ("trainer_state.pt", "engine_state.safetensors"):  # the same sizes in both steps
        mixed = os.path.join(step3, name)
        backup = os.path.join(out, name + ".bak")
        os.replace(mixed, backup)
        with open(os.path.join(step2, name), "rb") as src, open(mixed, "wb") as dst:
            dst.write(src.read())
        capsys.readouterr()
        err = _exits_2(["--out", out, *RUN, "--resume"], capsys)
        assert f"{mixed} does not match its sha256 in the manifest of step 3" in err
        os.replace(backup, mixed)
    extra = os.path.join(step3, "stray.bin")
    with open(extra, "wb") as f:
        f.write(b"x")
    err = _exits_2(["--out", out, *RUN, "--resume"], capsys)
    assert f"{extra} is not in the manifest" in err


def test_an_out_holding_a_run_is_refused_with_both_options_and_nothing_is_written(tmp_path, capsys) -> None:
    out = str(tmp_path / "run")
    train.run(train.parse_args(["--out", out, *RUN, "--stop-after", "2"]))
    before = _snapshot(out)
    capsys.readouterr()
    err = _exits_2(["--out", out, *RUN], capsys)
    assert err.startswith(f"offload-train: error: --out {out} already holds a run (step 2, checkpoint of 20")
    assert "continue it with --resume, or replace it with --overwrite" in err
    assert _snapshot(out) == before
    train.run(train.parse_args(["--out", out, *RUN, "--steps", "1", "--overwrite"]))
    assert [s for s, _ in _losses(out)] == [1]
    assert [s for s, _ in prior_run.complete_checkpoints(out)] == [1]


def test_an_out_with_metrics_but_no_checkpoint_is_refused_and_resume_says_there_is_none(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 7.0}) + "\n")
    err = _exits_2(["--out", str(out), *RUN], capsys)
    assert "already holds a run (metrics to step 1, no complete checkpoint, of 20" in err
    err = _exits_2(["--out", str(out), *RUN, "--resume"], capsys)
    assert f"--resume: {out} holds no complete checkpoint: start it again with --overwrite" in err


@pytest.mark.parametrize("flag, value, saved", [
    (["--resident-layers", "1"], "--resident-layers 1", "--resident-layers 0"),
    (["--offload-all"], "--offload-all", "no --offload-all"),
    (["--grad-accum", "2"], "--grad-accum 2", "--grad-accum 1"),
    (["--precision", "mixed"], "--precision mixed", "--precision bf16")])
def test_a_resume_with_another_layout_flag_names_the_flag(tmp_path, capsys, flag, value, saved) -> None:
    out = str(tmp_path / "run")
    train.run(train.parse_args(["--out", out, *RUN, "--stop-after", "1"]))
    capsys.readouterr()
    err = _exits_2(["--out", out, *RUN, "--resume", *flag], capsys)
    assert f"--resume: the checkpoint was made with {saved}, this run with {value}: resume with {saved}" in err


def test_a_resume_with_more_steps_is_refused_rather_than_stretching_the_schedule(tmp_path, capsys) -> None:
    out = str(tmp_path / "run")
    train.run(train.parse_args(["--out", out, *RUN, "--stop-after", "1"]))
    capsys.readouterr()
    err = _exits_2(["--out", out, *RUN, "--resume", "--steps", "16"], capsys)
    assert "--resume: the checkpoint's run has --steps 4, this one 16: the cosine schedule spans --steps" in err
    assert "resume with --steps 4" in err


def test_resume_trims_the_metrics_after_the_checkpoint_so_no_step_appears_twice(tmp_path, monkeypatch,
                                                                                 straight) -> None:
    out = str(tmp_path / "run")
    _crash_at(monkeypatch, "metrics", 4)  # rows 1-4 logged, checkpoints only to step 3 (--save-every 1)
    with pytest.raises(_Killed):
        train.run(train.parse_args(["--out", out, *RUN]))
    monkeypatch.setattr(run_dir, "crash_hook", None)
    assert [s for s, _ in _losses(out)] == [1, 2, 3, 4]
    train.run(train.parse_args(["--out", out, *RUN, "--resume"]))
    assert _losses(out) == straight


@pytest.mark.parametrize("device", DEVICES)
def test_ctrl_c_ends_with_one_line_naming_the_last_checkpoint_and_the_command(tmp_path, device) -> None:
    out = str(tmp_path / "run")
    argv = ["--out", out, *_on(device), "--steps", "2000"]  # a GPU's steps are ms: the key comes long before the end
    env = dict(os.environ, OFFLOAD_TRAIN_NO_BAR="1")
    proc = subprocess.Popen([sys.executable, "-m", "offload_ext.train.cli", *argv], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300  # a loaded 2-core machine has taken 40 s for the imports alone
    while not prior_run.complete_checkpoints(out) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert proc.poll() is None and prior_run.complete_checkpoints(out), "no checkpoint to interrupt after"
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    line = [x for x in err.splitlines() if "interrupted" in x]
    assert len(line) == 1, err
    step, path = prior_run.complete_checkpoints(out)[-1]
    assert line[0] == (f"offload-train: interrupted; last complete checkpoint: step {step} ({path}); continue "
                       f"with: offload-train {' '.join(argv)} --resume")


_KEY_IN_A_LIBRARY = r"""
import os, signal, sys, time
from offload_ext.train import cli, run_dir

def hook(name, step):
    if name == "saved" and step == 1:  # where the loop first imports matplotlib for the curves
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)
        except KeyboardInterrupt as exc:  # as a C extension's import cut short by the key reports it
            raise ImportError("initialization failed") from exc

run_dir.crash_hook = hook
cli.main(sys.argv[1:])
"""


def test_ctrl_c_that_a_library_turns_into_its_own_error_still_ends_with_the_interrupts_line(tmp_path) -> None:
    # the key landing in a C extension's import (matplotlib's, drawing the curves after the first save) came out as
    # ImportError from the KeyboardInterrupt: a traceback, then an abort as the interpreter finalized
    out = str(tmp_path / "run")
    argv = ["--out", out, *RUN]
    env = dict(os.environ, OFFLOAD_TRAIN_NO_BAR="1")
    done = subprocess.run([sys.executable, "-c", _KEY_IN_A_LIBRARY, *argv], env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, timeout=300)
    assert done.returncode == 130, done.stderr
    assert "Traceback" not in done.stderr
    (_, path), = prior_run.complete_checkpoints(out)
    assert done.stderr.strip().splitlines()[-1] == (
        f"offload-train: interrupted; last complete checkpoint: step 1 ({path}); continue with: offload-train "
        f"{' '.join(argv)} --resume")


def _run_limited(argv: list[str], limit: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, OFFLOAD_TRAIN_NO_BAR="1")
    return subprocess.run([sys.executable, "-m", "offload_ext.train.cli", *argv], env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, timeout=300, preexec_fn=file_size_limit(limit))


# Under the limit: the corpus's tokens (3.1 MB) are written before it, by the run that made --out; past it: the
# engine's host state of a checkpoint (1.1 MB), so every save of the limited run fails.
LIMIT = 800_000


def test_a_checkpoint_the_system_cannot_write_stops_the_run_with_one_line_and_its_continuation_trains_exactly(
        tmp_path, straight) -> None:
    out = str(tmp_path / "run")
    train.run(train.parse_args(["--out", out, *RUN, "--stop-after", "2"]))
    argv = ["--out", out, *RUN, "--resume"]
    done = _run_limited(argv, LIMIT)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    line = [x for x in done.stderr.splitlines() if x.startswith("offload-train: stopped")]
    assert len(line) == 1, done.stderr
    (_, path), = [c for c in prior_run.complete_checkpoints(out) if c[0] == 2]
    assert [s for s, _ in prior_run.complete_checkpoints(out)] == [1, 2]
    assert not os.path.exists(run_dir.partial_path(out, 3))  # the room it took is given back
    size = sum(f["size"] for f in json.load(open(os.path.join(path, "manifest.json")))["files"].values())
    assert 1e6 < size < 1e9  # so said in MB
    command = f"offload-train --out {out} {' '.join(RUN)}"
    assert re.fullmatch(
        r"offload-train: stopped at step 3: its checkpoint could not be written \(\[Errno 27\] File too large.*\); "
        r"its partial files were removed; last complete checkpoint: step 2 \(" + re.escape(path) + r"\); make room "
        r"at --out \(each checkpoint here takes " + re.escape(f"{size / 1e6:.1f}") + r" MB, --keep-checkpoints 2 of "
        r"them are kept\), then continue with: " + re.escape(f"{command} --resume"), line[0]), line[0]
    train.main(command.split()[1:] + ["--resume"])
    assert _losses(out) == straight


def test_a_first_checkpoint_the_system_cannot_write_says_there_is_nothing_to_resume(tmp_path) -> None:
    out = tmp_path / "run"
    train.run(train.parse_args(["--out", str(out), *RUN, "--stop-after", "1"]))  # the corpus's tokens written
    done = _run_limited(["--out", str(out), *RUN, "--overwrite"], LIMIT)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1].endswith(
        f"its partial files were removed; nothing to resume in {out} (no complete checkpoint): make room at --out "
        "(--keep-checkpoints 2 of them are kept), then start again with --overwrite")
    assert prior_run.complete_checkpoints(str(out)) == []


PLAIN = ["--device", "cpu", "--backend", "none", "--steps", "2", "--batch-size", "2", "--seq-len", "16",
         "--save-every", "1"]


@pytest.mark.parametrize("refused", ["model.safetensors", "trainer_state.pt"])
def test_a_refused_write_stops_the_run_with_its_line_whichever_library_writes_the_file(tmp_path, refused) -> None:
    # without the engine the checkpoint is transformers' safetensors file, then torch.save's trainer state: each
    # library reports the system's refusal its own way (SafetensorError; RuntimeError from the OSError), and both
    # are the refused write's line, not a traceback; the limit lies below the refused file and above every smaller one
    out = tmp_path / "run"
    train.run(train.parse_args(["--out", str(out), *PLAIN, "--stop-after", "1"]))
    (_, path), = prior_run.complete_checkpoints(str(out))
    sizes = {name: f["size"] for name, f in json.load(open(os.path.join(path, "manifest.json")))["files"].items()}
    limit = (max(size for size in sizes.values() if size < sizes[refused]) + sizes[refused]) // 2
    done = _run_limited(["--out", str(out), *PLAIN, "--resume"], limit)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert re.match(r"offload-train: stopped at step 2: its checkpoint could not be written \(.*File too large.*\); "
                    r"its partial files were removed; last complete checkpoint: step 1 ",
                    done.stderr.strip().splitlines()[-1]), done.stderr
    assert [s for s, _ in prior_run.complete_checkpoints(str(out))] == [1]
    assert not os.path.exists(run_dir.partial_path(str(out), 2))


def _free_space(monkeypatch, out, nbytes: int) -> None:
    """--out's file system reports `nbytes` free. A full disk cannot be made on a machine without the right to
    mount one, so the operating system's answer is replaced for paths under `out` (the writes still land)."""
    real = shutil.disk_usage

    def disk_usage(path):
        usage = real(path)
        return usage._replace(free=nbytes) if os.path.abspath(path).startswith(str(out)) else usage
    monkeypatch.setattr(shutil, "disk_usage", disk_usage)


def test_a_save_that_will_not_fit_is_warned_of_a_save_interval_ahead_and_the_run_goes_on(
        tmp_path, monkeypatch, capsys, straight) -> None:
    out = tmp_path / "run"
    train.run(train.parse_args(["--out", str(out), *RUN, "--stop-after", "2"]))
    assert "warning" not in capsys.readouterr().err  # room enough
    size = sum(f["size"] for f in json.load(open(out / "checkpoints" / "step-000002" / "manifest.json"))
               ["files"].values())
    _free_space(monkeypatch, out, 1000)
    train.run(train.parse_args(["--out", str(out), *RUN, "--resume"]))
    warned = [x for x in capsys.readouterr().err.splitlines() if "warning" in x]
    # at the start (the checkpoint resumed from tells the size) for step 3's save, after it for step 4's
    assert warned == [f"offload-train: warning: {out} has 0.0 MB free and a checkpoint of this run takes "
                      f"{size / 1e6:.1f} MB: the save at step {step} will fail unless {(size - 1000) / 1e6:.1f} MB "
                      "more is made free there (the run goes on until then)" for step in (3, 4)]
    assert _losses(str(out)) == straight


@pytest.mark.parametrize("flags", [RUN, PLAIN], ids=["engine", "no-engine"])
def test_a_fresh_runs_first_save_that_will_not_fit_is_warned_of_after_its_first_step(
        tmp_path, monkeypatch, capsys, flags) -> None:
    # before any checkpoint exists the size is estimated from what the save will write (the engine's buffers and
    # weights; without it the weights twice and the moments): within 10 % of what the save then wrote (4-6 % under
    # it here), the small files (tokenizer, config, trainer state's scalars) being the rest
    out = tmp_path / "run"
    _free_space(monkeypatch, out, 1000)
    train.run(train.parse_args(["--out", str(out), *flags, "--save-every", "2"]))
    warned = [x for x in capsys.readouterr().err.splitlines() if "warning" in x]
    found = re.fullmatch(rf"offload-train: warning: {re.escape(str(out))} has 0.0 MB free and a checkpoint of this "
                         r"run takes about (\d+\.\d) MB: the save at step 2 will fail unless \d+\.\d MB more is made "
                         r"free there \(the run goes on until then\)", warned[0])
    assert found, warned
    (_, path), *_ = prior_run.complete_checkpoints(str(out))
    size = sum(f["size"] for f in json.load(open(os.path.join(path, "manifest.json")))["files"].values())
    assert abs(float(found[1]) * 1e6 - size) < 0.1 * size, (found[1], size)


def test_a_failure_after_a_checkpoint_is_sealed_says_that_checkpoint_is_complete_and_continues_from_it(
        tmp_path, monkeypatch, capsys, straight) -> None:
    # pointing `latest` at step 3 fails (a full disk refusing the link): step 3 is complete and --resume takes it,
    # so the line must not say that its checkpoint could not be written
    out = str(tmp_path / "run")

    def hook(at: str, at_step: int) -> None:
        if (at, at_step) == ("renamed", 3):
            raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(run_dir, "crash_hook", hook)
    with pytest.raises(SystemExit) as exc:
        train.main(["--out", out, *RUN])
    assert exc.value.code == 1
    monkeypatch.setattr(run_dir, "crash_hook", None)
    path = run_dir.final_path(out, 3)
    size = checkpoint_manifest.checkpoint_bytes(path)
    command = f"offload-train --out {out} {' '.join(RUN)} --resume"
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "offload-train: stopped after step 3: its checkpoint is complete, but --out could not be tidied after it "
        f"([Errno 28] No space left on device); last complete checkpoint: step 3 ({path}); make room at --out (each "
        f"checkpoint here takes {checkpoint_manifest.readable_size(size)}, --keep-checkpoints 2 of them are kept), "
        f"then continue with: {command}")
    train.main(command.split()[1:])
    assert _losses(out) == straight


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of its own at tmp_path/disk, resized by calling the fixture's value with a size in bytes: a real full
    disk. Needs the right to mount one (root with CAP_SYS_ADMIN): skipped elsewhere."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")

    def resize(nbytes: int) -> str:
        subprocess.run(["mount", "-o", f"remount,size={nbytes}", str(disk)], check=True)
        return str(disk)
    yield resize
    subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.parametrize("device", DEVICES)
def test_on_a_real_full_disk_the_run_warns_ahead_stops_with_one_line_and_continues_once_there_is_room(
        tmp_path, small_disk, device) -> None:
    # the run on the ordinary disk gives the sizes (what --out holds besides checkpoints: the corpus's tokens, the
    # tokenizer, the metrics; a checkpoint) and the losses; the small disk then holds those, one checkpoint and half
    # of another
    flags = _on(device)
    straight = str(tmp_path / "straight")
    train.run(train.parse_args(["--out", straight, *flags]))
    checkpoint = checkpoint_manifest.checkpoint_bytes(run_dir.final_path(straight, 4))
    used = sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(straight) for n in names
               if "checkpoints" not in d)
    page = 4096
    out = os.path.join(small_disk((used + checkpoint * 3 // 2) // page * page + 64 * page), "run")
    done = subprocess.run([sys.executable, "-m", "offload_ext.train.cli", "--out", out, *flags],
                          env=dict(os.environ, OFFLOAD_TRAIN_NO_BAR="1"), stderr=subprocess.PIPE, text=True,
                          timeout=300, stdout=subprocess.DEVNULL)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert re.fullmatch(rf"offload-train: warning: {re.escape(out)} has \d+\.\d MB free and a checkpoint of this run "
                        r"takes \d+\.\d MB: the save at step 2 will fail unless \d+\.\d MB more is made free there "
                        r"\(the run goes on until then\)", lines[-2]), lines
    assert re.fullmatch(r"offload-train: stopped at step 2: its checkpoint could not be written \(.*No space left on "
                        r"device.*\); its partial files were removed; last complete checkpoint: step 1 .*; make room "
                        r"at --out .*, then continue with: offload-train .* --resume", lines[-1]), lines
    assert [s for s, _ in prior_run.complete_checkpoints(out)] == [1]
    assert not os.path.exists(run_dir.partial_path(out, 2))
    small_disk(64 << 20)
    train.main(shlex.split(lines[-1].split("continue with: ", 1)[1])[1:])
    assert _losses(out) == _losses(straight)
