"""offload-train's run directory: checkpoints that are whole or refused, and a run never overwritten unasked.

Layout of `--out`:

    metrics.jsonl                 one row per logged step
    checkpoints/step-000012/      a complete checkpoint: its files and manifest.json (written last)
    checkpoints/step-000013.partial/   one being written (or torn by a crash: never read, removed later)
    latest -> checkpoints/step-000012  the newest complete checkpoint (from_pretrained reads it)

A checkpoint is written into `step-N.partial/`; every file is fsync'ed, then `manifest.json` (the step, and
each file's size and sha256) is written and fsync'ed, then the directory is renamed to `step-N/` and its
parent fsync'ed. A rename is atomic, so a directory named `step-N` always holds a manifest that was whole
before the name existed; a crash at any point leaves either the previous complete checkpoint or the new one,
never a mix. Older complete checkpoints are deleted only after the new one is renamed into place. Resume
verifies the manifest (the set of files, sizes, hashes) and that the directory, the manifest and
trainer_state.pt name one step."""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import shutil
import signal
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

MANIFEST = "manifest.json"
CHECKPOINTS = "checkpoints"
LATEST = "latest"
METRICS = "metrics.jsonl"
LEGACY = "checkpoint"  # offload-train's layout before step directories: one directory, no manifest
_STEP_DIR = re.compile(r"^step-(\d+)$")

# The flags a resumed run must share with its checkpoint: each changes the engine state's shape, the
# arithmetic of a step or the order of the data, so a resume with another value is not the same run.
RESUME_FLAGS = ("model", "pretrained", "backend", "precision", "batch_size", "seq_len", "grad_accum",
                "resident_layers", "device_layers", "offload_all", "accumulate_on", "lora_r", "lora_alpha",
                "lora_targets", "max_grad_norm", "weight_decay", "no_decay", "lr", "warmup_steps", "steps", "seed",
                "dataset", "text_field", "split", "tokenizer", "streaming")


class CheckpointError(Exception):
    """A checkpoint that cannot be resumed from; the message is one line naming the file and the fix."""


# Fault tests replace this to stop the process at each commit point of a save (`boundary` names the point,
# `step` the checkpoint's step); OFFLOAD_TRAIN_KILL_AT=boundary:step makes the process SIGKILL itself there.
crash_hook: Callable[[str, int], None] | None = None

BOUNDARIES = ("metrics", "weights", "engine", "tokenizer", "trainer_state", "fsynced", "manifest", "renamed",
              "linked", "pruned")


def boundary(name: str, step: int) -> None:
    """A commit point of a save (for fault tests; nothing in a normal run)."""
    if crash_hook is not None:
        crash_hook(name, step)
    if os.environ.get("OFFLOAD_TRAIN_KILL_AT") == f"{name}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def checkpoints_dir(out: str) -> str:
    return os.path.join(out, CHECKPOINTS)


def complete_checkpoints(out: str) -> list[tuple[int, str]]:
    """(step, path) of every directory named step-N under --out/checkpoints, oldest first."""
    root = checkpoints_dir(out)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        if m and os.path.isdir(os.path.join(root, name)):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(found)


# ---------------------------------------------------------------------------------------------- writing


def _fsync_path(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _hash_all(paths: list[str], fsync: bool = False) -> list[str]:
    """Each file's sha256 (fsync'ed first with `fsync`), the files read on threads: hashlib releases the GIL
    on large blocks, so a checkpoint of many GB hashes at the disk's or the cores' pace, not one core's."""
    def one(path: str) -> str:
        if fsync:
            _fsync_path(path)
        return _sha256(path)
    with ThreadPoolExecutor(min(8, max(1, len(paths)))) as pool:
        return list(pool.map(one, paths))


def _files_under(root: str) -> list[str]:
    """Every regular file under `root`, as paths relative to it, sorted."""
    found = []
    for dirpath, _, names in os.walk(root):
        for name in names:
            found.append(os.path.relpath(os.path.join(dirpath, name), root))
    return sorted(found)


def begin(out: str, step: int) -> str:
    """A fresh `step-N.partial/` to write checkpoint `step` into (a torn one from a crash is removed first)."""
    partial = os.path.join(checkpoints_dir(out), step_name(step) + ".partial")
    if os.path.exists(partial):
        shutil.rmtree(partial)
    os.makedirs(partial)
    return partial


def _write_json_durably(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def commit(out: str, partial: str, step: int, args: dict[str, Any], keep: int) -> str:
    """Seal `partial` as complete checkpoint `step`: fsync its files, write the manifest last, rename the
    directory into place, point `latest` at it, then delete all but the newest `keep` complete ones."""
    rels = _files_under(partial)
    digests = _hash_all([os.path.join(partial, rel) for rel in rels], fsync=True)
    files = {rel: {"size": os.path.getsize(os.path.join(partial, rel)), "sha256": h} for rel, h in zip(rels, digests)}
    for dirpath, _, _ in os.walk(partial):
        _fsync_path(dirpath, directory=True)
    boundary("fsynced", step)
    manifest = {"format": 1, "step": step, "written": _now(), "files": files,
                "args": {k: args.get(k) for k in RESUME_FLAGS}}
    _write_json_durably(os.path.join(partial, MANIFEST), manifest)
    _fsync_path(partial, directory=True)
    boundary("manifest", step)
    final = os.path.join(checkpoints_dir(out), step_name(step))
    if os.path.exists(final):  # of a run resumed from an older checkpoint (--resume PATH): superseded
        _set_aside(final)
    os.rename(partial, final)
    _fsync_path(checkpoints_dir(out), directory=True)
    boundary("renamed", step)
    _point_latest(out, final)
    boundary("linked", step)
    _prune(out, keep, step)
    return final


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
    """Delete complete checkpoints beyond the newest `keep`, oldest first, and stale partial ones. Those of
    later steps than `step` belong to the run's abandoned future (it was resumed from an older checkpoint):
    `--resume` must not pick them, so they go first."""
    complete = complete_checkpoints(out)
    later = [c for c in complete if c[0] > step]
    earlier = [c for c in complete if c[0] <= step]
    for _, path in later + earlier[:max(0, len(earlier) - keep)]:
        shutil.rmtree(_set_aside(path))
        boundary("pruned", step)
    root = checkpoints_dir(out)
    for name in os.listdir(root):
        if name.endswith((".deleting", ".partial")):  # a crash's leftovers: never read
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


# ---------------------------------------------------------------------------------------------- reading


@dataclass
class Checkpoint:
    """A verified complete checkpoint."""
    path: str
    step: int
    manifest: dict[str, Any]


def read_manifest(path: str) -> dict[str, Any]:
    """`path`'s manifest; CheckpointError naming it when missing or unreadable."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{os.path.join(path, MANIFEST)} is missing: the checkpoint is not complete")
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{os.path.join(path, MANIFEST)} is unreadable ({exc})")


def verify(path: str, hashes: bool = True) -> Checkpoint:
    """Checkpoint `path` checked against its manifest: the same set of files, each of the recorded size (and
    sha256 with `hashes`), and the step of the directory's name and the manifest one; CheckpointError
    naming the first file that disagrees."""
    manifest = read_manifest(path)
    step = manifest.get("step")
    if not isinstance(step, int) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{os.path.join(path, MANIFEST)} names no step or no files")
    m = _STEP_DIR.match(os.path.basename(os.path.normpath(path)))
    if m and int(m.group(1)) != step:
        raise CheckpointError(f"{os.path.join(path, MANIFEST)} is of step {step}, its directory of step "
                              f"{int(m.group(1))}")
    present = set(_files_under(path)) - {MANIFEST}
    listed = manifest.get("files", {})
    names = sorted(set(listed) | present)
    if hashes and present == set(listed) and all(os.path.getsize(os.path.join(path, r)) == listed[r]["size"]
                                                for r in names):
        digests = dict(zip(names, _hash_all([os.path.join(path, r) for r in names])))
    else:  # a file missing, extra or of another size: named below before any hashing
        digests = {}
    for rel in names:
        where = os.path.join(path, rel)
        if rel not in present:
            raise CheckpointError(f"{where} is missing (the manifest lists it)")
        if rel not in listed:
            raise CheckpointError(f"{where} is not in the manifest (a file of another save)")
        size = os.path.getsize(where)
        if size != listed[rel]["size"]:
            raise CheckpointError(f"{where} has {size} bytes, the manifest of step {step} says {listed[rel]['size']}")
        if rel in digests and digests[rel] != listed[rel]["sha256"]:
            raise CheckpointError(f"{where} does not match its sha256 in the manifest of step {step}")
    return Checkpoint(path, int(step), manifest)


def find(out: str, resume: str) -> Checkpoint:
    """The checkpoint `--resume` names, verified: `latest` (the newest complete one) or a step directory."""
    if resume != "latest":
        if not os.path.isdir(resume):
            raise CheckpointError(f"--resume {resume}: no such checkpoint directory")
        return _verified(resume, out)
    complete = complete_checkpoints(out)
    if not complete:
        hint = (f" ({os.path.join(out, LEGACY)} has no manifest: an older offload-train's, or --fsdp's)"
                if os.path.isdir(os.path.join(out, LEGACY)) else "")
        raise CheckpointError(f"--resume: {out} holds no complete checkpoint{hint}: start it again with --overwrite")
    return _verified(complete[-1][1], out)


def _verified(path: str, out: str) -> Checkpoint:
    try:
        return verify(path)
    except CheckpointError as exc:
        older = [p for s, p in complete_checkpoints(out) if os.path.normpath(p) != os.path.normpath(path)]
        fix = f"; resume from the previous one with --resume {older[-1]}" if older else ""
        raise CheckpointError(f"--resume: torn checkpoint: {exc}{fix}") from None


def check_flags(ckpt: Checkpoint, args: dict[str, Any]) -> None:
    """CheckpointError naming the first flag whose value differs from the checkpoint's run."""
    saved = ckpt.manifest.get("args", {})
    for key in RESUME_FLAGS:
        if key in saved and saved[key] != args.get(key):
            flag = "--" + key.replace("_", "-")
            if key == "steps":
                raise CheckpointError(
                    f"--resume: the checkpoint's run has --steps {saved[key]}, this one {args.get(key)}: the cosine "
                    f"schedule spans --steps, so it would change mid-run; resume with --steps {saved[key]}, or "
                    "start a longer run from its weights (--model DIR --pretrained)")
            raise CheckpointError(f"--resume: the checkpoint was made with {_as_flag(flag, saved[key])}, this run "
                                  f"with {_as_flag(flag, args.get(key))}: resume with {_as_flag(flag, saved[key])}")


def _as_flag(flag: str, value: Any) -> str:
    """How a value is given on the command line: a switch by its presence, anything else after the flag."""
    if isinstance(value, bool):
        return flag if value else f"no {flag}"
    return f"{flag} {value}"


# ---------------------------------------------------------------------------------------------- the run


def existing_run(out: str) -> str | None:
    """A description of the run `out` already holds ("step 12, checkpoint of 2026-12-05 01:20 UTC"), or None."""
    complete = complete_checkpoints(out)
    if complete:
        step, path = complete[-1]
        try:
            written = read_manifest(path).get("written", "?")
        except CheckpointError:
            written = _mtime(path)
        return f"step {step}, checkpoint of {written}"
    metrics = os.path.join(out, METRICS)
    legacy = os.path.join(out, LEGACY)
    if os.path.isdir(legacy):
        return f"{legacy}, a checkpoint without a manifest, of {_mtime(legacy)}"
    if os.path.exists(metrics) or os.path.isdir(checkpoints_dir(out)):
        rows = _metric_rows(metrics) if os.path.exists(metrics) else []
        last = f"metrics to step {rows[-1]['step']}" if rows else "no metrics"
        when = _mtime(metrics if os.path.exists(metrics) else checkpoints_dir(out))
        return f"{last}, no complete checkpoint, of {when}"
    return None


def _mtime(path: str) -> str:
    t = datetime.datetime.fromtimestamp(os.path.getmtime(path), datetime.timezone.utc)
    return t.strftime("%Y-%m-%d %H:%M UTC")


def remove_run(out: str) -> None:
    """--overwrite: the previous run's metrics and checkpoints deleted (the tokenizer cache stays)."""
    for name in (METRICS, LATEST):
        if os.path.lexists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    for name in (CHECKPOINTS, LEGACY):
        if os.path.isdir(os.path.join(out, name)):
            shutil.rmtree(os.path.join(out, name))


def _metric_rows(path: str) -> list[dict[str, Any]]:
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except ValueError:  # a row cut short by a kill mid-write
                break
    return rows


def trim_metrics(out: str, step: int) -> None:
    """metrics.jsonl without the rows after `step` (they are trained again), rewritten atomically."""
    path = os.path.join(out, METRICS)
    if not os.path.exists(path):
        return
    kept = [r for r in _metric_rows(path) if r.get("step", 0) <= step]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
