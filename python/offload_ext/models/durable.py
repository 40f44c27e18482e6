"""Durable file writes: a file replaced whole or not at all (written under a temporary name, fsync'ed, renamed
over its real name), and the fsync of a path that makes what was written there, or a rename, survive a crash."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import BinaryIO


def fsync_path(path: str, directory: bool = False) -> None:
    """fsync the file or, with `directory`, the directory at `path` (what makes an entry renamed into it last)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, write: Callable[[BinaryIO], None]) -> None:
    """`path` as `write` writes it into an open binary file, there whole or not at all: written under
    `path.<pid>.partial` (the pid: processes of one run, or two runs, may write one path at once), fsync'ed,
    then renamed over `path`. A failure removes the partial file and leaves `path` as it was."""
    partial = f"{path}.{os.getpid()}.partial"
    try:
        with open(partial, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(partial)
        raise
