"""offload-train's errors for bad input: each printed as one line naming the input and the fix, without a
traceback. Every train/ module may raise them: this module imports nothing."""
from __future__ import annotations


class UsageError(Exception):
    """Bad input: printed without a traceback, with the fix."""


class CheckpointError(Exception):
    """A checkpoint that cannot be resumed from; the message is one line naming the file and the fix."""


class CheckpointWriteError(Exception):
    """A checkpoint that could not be written (a full disk, a file over the size limit): the run stops there, its
    partial files removed; the message is the operating system's reason (a rank's, under --fsdp)."""

    def __init__(self, step: int, reason: OSError | str) -> None:
        super().__init__(str(reason))
        self.step = step
