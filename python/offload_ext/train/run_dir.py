"""offload-train's checkpoints committed into the run directory, each as one unit: whole, or absent and never
read; with the commit points fault tests stop a save at. (What seals one checkpoint and verifies it:
checkpoint_manifest; the run an --out already holds, and the rules to resume or overwrite it: prior_run.)

Layout of `--out`:

    metrics.jsonl                 one row per logged step
    checkpoints/step-000012/      a complete checkpoint: its files and manifest.json (written last)
    checkpoints/step-000013.partial/   one being written (or torn by a crash: never read, removed later)
    latest -> checkpoints/step-000012  the newest complete checkpoint (from_pretrained reads it)

A checkpoint is written into `step-N.partial/`; every file is fsync'ed, then `manifest.json` (the step, and
each file's size and sha256) is written and fsync'ed, then the directory is renamed to `step-N/` and its
parent fsync'ed. A rename is atomic, so a directory named `step-N` always holds a manifest that was whole
before the name existed; a crash at any point leaves either the previous complete checkpoint or the new one,
never a mix. Older complete checkpoints are deleted only after the new one is renamed into place; those of a
resumed run's abandoned future (at and after the new step) are set aside just before it. Resume
verifies the manifest (the set of files, sizes, hashes) and that the directory, the manifest and
trainer_state.pt name one step."""
from __future__ import annotations

import datetime
import os
import shutil
import signal
from collections.abc import Callable
from typing import Any

from offload_ext.models.durable import fsync_path
from offload_ext.train.checkpoint_manifest import (
    readable_size,
    sealed_files,
    step_name,
    write_manifest,
)
from offload_ext.train.prior_run import LATEST, RESUME_FLAGS, checkpoints_dir, complete_checkpoints

# Fault tests replace this to stop the process at each commit point of a save (`boundary` names the point,
# `step` the checkpoint's step); OFFLOAD_TRAIN_KILL_AT=boundary:step makes the process SIGKILL itself there.
crash_hook: Callable[[str, int], None] | None = None

BOUNDARIES = ("metrics", "weights", "engine", "tokenizer", "trainer_state", "fsynced", "manifest", "superseded",
              "renamed", "linked", "pruned")


def boundary(name: str, step: int) -> None:
    """A commit point of a save (for fault tests; nothing in a normal run)."""
    if crash_hook is not None:
        crash_hook(name, step)
    if os.environ.get("OFFLOAD_TRAIN_KILL_AT") == f"{name}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def partial_path(out: str, step: int) -> str:
    """Where checkpoint `step` is written before it is sealed."""
    return os.path.join(checkpoints_dir(out), step_name(step) + ".partial")


def final_path(out: str, step: int) -> str:
    """Where complete checkpoint `step` lies once sealed."""
    return os.path.join(checkpoints_dir(out), step_name(step))


def begin(out: str, step: int) -> str:
    """A fresh `step-N.partial/` to write checkpoint `step` into (a torn one from a crash is removed first)."""
    partial = partial_path(out, step)
    if os.path.exists(partial):
        shutil.rmtree(partial)
    os.makedirs(partial)
    return partial


def abandon(out: str, step: int) -> None:
    """Remove what a failed save of checkpoint `step` left in `step-N.partial/` (a full disk gets its room back)."""
    shutil.rmtree(partial_path(out, step), ignore_errors=True)


def commit(out: str, partial: str, step: int, args: dict[str, Any], keep: int) -> str:
    """Seal `partial` as complete checkpoint `step`: fsync its files, write the manifest last, rename the
    directory into place, point `latest` at it, then delete all but the newest `keep` complete ones."""
    files = sealed_files(partial)
    boundary("fsynced", step)
    write_manifest(partial, {"format": 1, "step": step, "written": _now(), "files": files,
                             "args": {k: args.get(k) for k in RESUME_FLAGS}})
    boundary("manifest", step)
    # A run resumed from an older checkpoint (--resume PATH) supersedes the checkpoints of its abandoned future,
    # from this step on. They go before the new one takes its name: were they left until the prune below, a crash
    # in between would leave one of them the newest complete, and a plain --resume would take it.
    for later, path in complete_checkpoints(out):
        if later >= step:
            _set_aside(path)
    boundary("superseded", step)
    final = final_path(out, step)
    os.rename(partial, final)
    fsync_path(checkpoints_dir(out), directory=True)
    boundary("renamed", step)
    _point_latest(out, final)
    boundary("linked", step)
    _prune(out, keep, step)
    return final


def room_warning(out: str, size: int, step: int, about: bool = False) -> str | None:
    """A warning where --out has less free space than a checkpoint of this run takes (`size` bytes, measured from
    one written, or `about` that: estimated before the first): the save of checkpoint `step` will be refused then
    (older ones are deleted only after it is sealed); None where there is room."""
    free = shutil.disk_usage(out).free  # checkpoints/ is made at the first save
    if free >= size:
        return None
    return (f"offload-train: warning: {out} has {readable_size(free)} free and a checkpoint of this run takes "
            f"{'about ' if about else ''}{readable_size(size)}: the save at step {step} will fail unless "
            f"{readable_size(size - free)} more is made free there (the run goes on until then)")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def _point_latest(out: str, final: str) -> None:
    link = os.path.join(out, LATEST)
    tmp = link + ".tmp"
    if os.path.lexists(tmp):
        os.remove(tmp)
    os.symlink(os.path.relpath(final, out), tmp)
    os.replace(tmp, link)  # atomic: `latest` is always the old target or the new one


def _set_aside(path: str) -> str:
    """`path` renamed to `path.deleting` (what a crash mid-delete leaves is then never taken for a complete
    checkpoint, as a step-N with half its files would be); the new name."""
    doomed = path + ".deleting"
    if os.path.exists(doomed):  # an earlier crash's
        shutil.rmtree(doomed)
    os.rename(path, doomed)
    return doomed


def _prune(out: str, keep: int, step: int) -> None:
    """Delete complete checkpoints beyond the newest `keep`, oldest first, then what was set aside and stale
    partial ones."""
    complete = complete_checkpoints(out)
    for _, path in complete[:max(0, len(complete) - keep)]:
        shutil.rmtree(_set_aside(path))
        boundary("pruned", step)
    root = checkpoints_dir(out)
    for name in os.listdir(root):
        if name.endswith((".deleting", ".partial")):  # superseded, or a crash's leftovers: never read
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
