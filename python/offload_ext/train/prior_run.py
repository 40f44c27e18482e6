"""The run an --out already holds, and the rules for it: where its parts lie (metrics.jsonl, checkpoints/,
latest), its complete checkpoints, a description of it for the refusal to overwrite it unasked, its removal
(--overwrite), and its resumption: the checkpoint --resume names verified, the flags that must match it
checked, and the metrics logged after it trimmed."""
from __future__ import annotations

import datetime
import json
import os
import shutil
from typing import Any

from offload_ext.models.durable import atomic_write
from offload_ext.train.checkpoint_manifest import STEP_DIR, Checkpoint, read_manifest, verify
from offload_ext.train.errors import CheckpointError

CHECKPOINTS = "checkpoints"
LATEST = "latest"
METRICS = "metrics.jsonl"
CURVES = "curves.png"  # train/watch.py draws it
TENSORBOARD = "tensorboard"  # --report-to tensorboard logs there
LEGACY = "checkpoint"  # offload-train's layout before step directories: one directory, no manifest

# The flags a resumed run must share with its checkpoint: each changes the engine state's shape, the
# arithmetic of a step or the order of the data, so a resume with another value is not the same run.
RESUME_FLAGS = ("model", "pretrained", "backend", "precision", "batch_size", "seq_len", "grad_accum",
                "resident_layers", "device_layers", "offload_all", "accumulate_on", "lora_r", "lora_alpha",
                "lora_targets", "max_grad_norm", "weight_decay", "no_decay", "lr", "warmup_steps", "steps", "seed",
                "dataset", "text_field", "split", "tokenizer", "streaming", "task", "base_dtype")
# Flags whose "auto" a run resolves and records as numbers: a resume with "auto" takes the checkpoint's.
AUTO_FLAGS = ("resident_layers", "device_layers")


def checkpoints_dir(out: str) -> str:
    return os.path.join(out, CHECKPOINTS)


def complete_checkpoints(out: str) -> list[tuple[int, str]]:
    """(step, path) of every directory named step-N under --out/checkpoints, oldest first."""
    root = checkpoints_dir(out)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = STEP_DIR.match(name)
        if m and os.path.isdir(os.path.join(root, name)):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(found)


# ---------------------------------------------------------------------------------------------- resuming


def find(out: str, resume: str) -> Checkpoint:
    """The checkpoint `--resume` names, verified: `latest` (the newest complete one) or a step directory."""
    if resume != "latest":
        if not os.path.isdir(resume):
            raise CheckpointError(f"--resume {resume}: no such checkpoint directory")
        return _verified(resume, out)
    complete = complete_checkpoints(out)
    if not complete:
        hint = (f" ({os.path.join(out, LEGACY)} has no manifest: an older offload-train's)"
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
        if key in saved and saved[key] != args.get(key) and not (key in AUTO_FLAGS and args.get(key) == "auto"):
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


def trim_metrics(out: str, step: int) -> None:
    """metrics.jsonl without the rows after `step` (they are trained again), rewritten atomically."""
    path = os.path.join(out, METRICS)
    if not os.path.exists(path):
        return
    kept = [r for r in _metric_rows(path) if r.get("step", 0) <= step]
    atomic_write(path, lambda f: f.write("".join(json.dumps(r) + "\n" for r in kept).encode()))


# ---------------------------------------------------------------------------------------------- overwriting


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
    """--overwrite: the previous run's metrics, curves, TensorBoard logs and checkpoints deleted (the tokenizer
    cache stays)."""
    for name in (METRICS, LATEST, CURVES):
        if os.path.lexists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    for name in (CHECKPOINTS, LEGACY, TENSORBOARD):
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
