"""One checkpoint directory and its manifest: the directory's files fsync'ed and hashed, manifest.json (the
step, and each file's size and sha256) written durably, and a directory verified against its manifest: the
same set of files, each of the recorded size and sha256, and one step named by the directory and the
manifest."""
from __future__ import annotations

import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from offload_ext.models.durable import atomic_write, fsync_path
from offload_ext.train.errors import CheckpointError

MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step-(\d+)$")


def step_name(step: int) -> str:
    """The name of checkpoint `step`'s directory (what STEP_DIR matches)."""
    return f"step-{step:06d}"


@dataclass
class Checkpoint:
    """A verified complete checkpoint."""
    path: str
    step: int
    manifest: dict[str, Any]


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
            fsync_path(path)
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


def sealed_files(directory: str) -> dict[str, dict[str, Any]]:
    """Every file under `directory` fsync'ed, and every directory holding one: each file's size and sha256,
    by its path relative to `directory` (the manifest's "files")."""
    rels = _files_under(directory)
    digests = _hash_all([os.path.join(directory, rel) for rel in rels], fsync=True)
    files = {rel: {"size": os.path.getsize(os.path.join(directory, rel)), "sha256": h} for rel, h in zip(rels, digests)}
    for dirpath, _, _ in os.walk(directory):
        fsync_path(dirpath, directory=True)
    return files


def write_manifest(directory: str, manifest: dict[str, Any]) -> None:
    """`directory`'s manifest.json, whole and fsync'ed, and its entry in the directory."""
    atomic_write(os.path.join(directory, MANIFEST), lambda f: f.write(json.dumps(manifest, indent=1).encode()))
    fsync_path(directory, directory=True)


def read_manifest(path: str) -> dict[str, Any]:
    """`path`'s manifest; CheckpointError naming it when missing or unreadable."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{os.path.join(path, MANIFEST)} is missing: the checkpoint is not complete")
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{os.path.join(path, MANIFEST)} is unreadable ({exc})")


def checkpoint_bytes(path: str) -> int | None:
    """A complete checkpoint's size from its manifest (None where it cannot be read)."""
    try:
        return sum(int(f["size"]) for f in read_manifest(path)["files"].values())
    except (CheckpointError, AttributeError, KeyError, TypeError, ValueError):
        return None


def readable_size(nbytes: int) -> str:
    """A size as a person reads it: GB from a gigabyte up, MB below (a small model's checkpoint is not 0.00 GB)."""
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


def verify(path: str, hashes: bool = True) -> Checkpoint:
    """Checkpoint `path` checked against its manifest: the same set of files, each of the recorded size (and
    sha256 with `hashes`), and the step of the directory's name and the manifest one; CheckpointError
    naming the first file that disagrees."""
    manifest = read_manifest(path)
    step = manifest.get("step")
    if not isinstance(step, int) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{os.path.join(path, MANIFEST)} names no step or no files")
    m = STEP_DIR.match(os.path.basename(os.path.normpath(path)))
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
