"""Kill offload-train (SIGKILL) at random moments of a `--save-every 1` run, resume it, and count the outcomes.

Each trial starts a run on the simulated device (a fork of this process, whose imports are done once),
waits until its first step is logged, kills it after a random delay drawn over the rest of the run's
training time (measured on an uninterrupted reference run), then runs `--resume`. Outcomes: resumed-exact
(metrics.jsonl equals the reference's, each step once), refused (exit 2 with one line: a torn or missing
checkpoint), resumed-wrong (anything else: the failure this guards against), and finished (the run ended
before the kill came: not a kill, so the trial is drawn again; N trials are N kills).

    python scripts/kill_resume.py            # 100 trials, one at a time
    python scripts/kill_resume.py --jobs 2   # two at a time
    python scripts/kill_resume.py -n 10 --keep /tmp/kills   # keep each trial's --out
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

RUN = ["--device", "cpu-sim", "--backend", "native", "--steps", "4", "--batch-size", "2", "--seq-len", "16",
       "--save-every", "1"]


class Run:
    """One offload-train process on `out`: a fork of this interpreter, its imports done once here (the
    default), or a fresh interpreter (--spawn). Either is killed for real with SIGKILL."""

    spawn = False

    def __init__(self, out: str, *extra: str) -> None:
        self.out, self.log = out, out + ".log"
        argv = ["--out", out, *RUN, *extra]
        if Run.spawn:
            with open(self.log, "w") as log:
                self.proc = subprocess.Popen([sys.executable, "-m", "offload_ext.train.cli", *argv], stdout=log,
                                             stderr=log)
            self.pid = self.proc.pid
        else:
            self.pid = os.fork()
            if self.pid == 0:
                _child(argv, self.log)
        self.code: int | None = None

    def poll(self) -> int | None:
        if Run.spawn:
            return self.proc.poll()
        if self.code is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.code = os.waitstatus_to_exitcode(status)
        return self.code

    def wait(self) -> int:
        if Run.spawn:
            return self.proc.wait()
        if self.code is None:
            self.code = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.code

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)

    def stderr(self) -> str:
        with open(self.log) as f:
            return f.read()


def _child(argv: list[str], log: str) -> None:
    """The forked process: offload-train's main on `argv`, its output to `log`; never returns."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    code = 1
    try:
        from offload_ext.train import cli as train

        train.main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _losses(out: str) -> list[tuple[int, float]]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [(r["step"], r["loss"]) for r in map(json.loads, f)]


def _first_row_time(run: Run) -> float | None:
    """When the run's first step was logged (None if it ended first)."""
    metrics = os.path.join(run.out, "metrics.jsonl")
    while run.poll() is None:
        if os.path.exists(metrics) and os.path.getsize(metrics) > 0:
            return time.monotonic()
        time.sleep(0.01)
    return None


def reference(root: str, jobs: int) -> tuple[list[tuple[int, float]], float]:
    """The uninterrupted run's losses and its training time after the first logged step: `jobs` runs at once,
    as the trials will run, so that the kills are drawn over the span the trials' runs take."""
    runs = [Run(os.path.join(root, f"reference-{j}")) for j in range(jobs)]
    spans = []
    for run in runs:
        first = _first_row_time(run)
        if run.wait() != 0 or first is None:
            sys.exit(f"kill_resume: the reference run failed:\n{run.stderr()}")
        spans.append(time.monotonic() - first)
    losses = [_losses(run.out) for run in runs]
    if any(x != losses[0] for x in losses):
        sys.exit("kill_resume: the reference runs disagree: training is not deterministic here")
    return losses[0], max(spans)


def trial(out: str, delay: float, expected: list[tuple[int, float]]) -> tuple[str, str]:
    """One kill and resume: the outcome and a detail line."""
    run = Run(out)
    if _first_row_time(run) is None:
        return "finished", f"exit {run.wait()} before its first step was logged"
    time.sleep(delay)
    if run.poll() is not None:
        return "finished", f"ended before the kill at {delay:.2f} s"
    run.kill()
    run.wait()
    ckpts = os.path.join(out, "checkpoints")
    left = sorted(os.listdir(ckpts)) if os.path.isdir(ckpts) else []
    resumed = Run(out, "--resume")
    code = resumed.wait()
    if code == 2:
        lines = [x for x in resumed.stderr().splitlines() if x.startswith("offload-train: error:")]
        return ("refused" if len(lines) == 1 else "resumed-wrong"), f"{left}: {lines}"
    if code == 0 and _losses(out) == expected:
        return "resumed-exact", f"{left}"
    return "resumed-wrong", f"{left}: exit {code}: {resumed.stderr()[-500:]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--trials", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=1, help="trials run at once")
    ap.add_argument("--spawn", action="store_true",
                    help="start each process as a fresh interpreter (slower) instead of a fork of this one")
    ap.add_argument("--keep", default=None, help="keep each trial's --out under this directory")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    os.environ["OFFLOAD_TRAIN_NO_BAR"] = "1"
    Run.spawn = a.spawn
    if not a.spawn:  # imported once here, before any thread or torch computation: each fork starts warm
        import transformers.models.llama.modeling_llama  # noqa: F401

        import offload_ext.train.cli  # noqa: F401
    root = a.keep or tempfile.mkdtemp(prefix="kill_resume_")
    os.makedirs(root, exist_ok=True)
    expected, span = reference(root, a.jobs)
    print(f"kill_resume: reference {len(expected)} steps, {span:.2f} s of training after the first step", flush=True)
    counts = {"resumed-exact": 0, "refused": 0, "resumed-wrong": 0, "finished": 0}
    lock = threading.Lock()

    def one(k: int) -> None:
        # A run that ends before its kill (this machine faster now than for the reference) is no trial of a
        # save: it is counted as finished and the trial drawn again over a shorter span, so that N kills land.
        for attempt in range(20):
            out = os.path.join(root, f"trial-{k:03d}-{attempt}")
            with lock:
                delay = rng.uniform(0.0, span * 0.8 ** attempt)
            outcome, detail = trial(out, delay, expected)
            with lock:
                counts[outcome] += 1
            print(f"trial {k:3d} kill at +{delay:.2f} s: {outcome} {detail}", flush=True)
            if a.keep is None:
                shutil.rmtree(out, ignore_errors=True)
            if outcome != "finished":
                return

    with ThreadPoolExecutor(a.jobs) as pool:  # each trial waits on its processes: threads suffice
        list(pool.map(one, range(a.trials)))
    if a.keep is None:
        shutil.rmtree(root, ignore_errors=True)
    print("kill_resume: " + ", ".join(f"{k} {v}" for k, v in counts.items()), flush=True)
    sys.exit(1 if counts["resumed-wrong"] else 0)


if __name__ == "__main__":
    main()
