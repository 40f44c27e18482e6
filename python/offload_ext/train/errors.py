"""offload-train's errors for bad input: each printed as one line naming the input and the fix, without a
traceback. Every train/ module may raise them: this module imports nothing."""
from __future__ import annotations


class UsageError(Exception):
    """Bad input: printed without a traceback, with the fix."""


class CheckpointError(Exception):
    """A checkpoint that cannot be resumed from; the message is one line naming the file and the fix."""


class CheckpointWriteError(Exception):
    """A checkpoint that could not be written (a full disk, a file over the size limit): the run stops there, its
    partial files removed; the message is the system's reason, as write_refusal found it."""

    def __init__(self, step: int, reason: str) -> None:
        super().__init__(reason)
        self.step = step


def write_refusal(exc: BaseException) -> str | None:
    """The system's refusal of a write in `exc`, a failure of a checkpoint's save, as one line; None where `exc` is
    something else. Each writer says it its own way: Python's files raise OSError; torch.save on a file object
    raises RuntimeError from the OSError, on a path RuntimeError alone (its zip writer finds the file shorter than
    what it wrote); safetensors raises its SafetensorError naming the OS error; torch.distributed.checkpoint
    gathers every rank's failure into one exception (a refusal where each of them is one). A Ctrl-C that landed in a
    writer's own callback comes out as the same RuntimeError: with the KeyboardInterrupt in its chain it is not a
    refusal; pickled to another rank the chain is gone, so a caller asks interrupt.raise_if_pressed first."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        reasons = [write_refusal(failure) for failure, _ in failures.values()]
        return reasons[0] if reasons and all(reasons) else None
    chain: BaseException | None = exc
    seen: set[int] = set()
    while chain is not None and id(chain) not in seen:
        if isinstance(chain, KeyboardInterrupt):  # Ctrl-C inside a writer's callback, reported as its error
            return None
        if isinstance(chain, OSError):
            return str(chain)
        seen.add(id(chain))
        chain = chain.__cause__ or chain.__context__
    text = str(exc)
    if type(exc).__name__ == "SafetensorError" and "I/O error: " in text:
        return text.split("I/O error: ", 1)[1]
    if isinstance(exc, RuntimeError) and ("unexpected pos" in text or "PytorchStreamWriter failed writing" in text):
        detail = text.split("] . ", 1)[-1].strip()  # without the C++ source line torch puts first
        return f"a write was cut short, as on a full disk or past a file size limit (torch.save: {detail})"
    return None
