"""Ctrl-C that is never lost: Python drops a KeyboardInterrupt raised inside a finalizer (`__del__`), printing it as
"Exception ignored ... Traceback" on stderr, so a key pressed while one runs would let the run go on to its end.
The handler also records the key, the loop raises at its next step boundary when the interrupt was swallowed, and
the dropped KeyboardInterrupt is not printed (the run still ends with its one line), and the process then exits
with status 130 wherever the key landed."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import NoReturn

_pressed = False


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    global _pressed
    _pressed = True
    signal.default_int_handler(signum, frame)


@contextlib.contextmanager
def recorded() -> Iterator[None]:
    """Within: Ctrl-C raises KeyboardInterrupt as usual and is remembered for `raise_if_pressed`; one that a
    finalizer swallowed is not printed."""
    global _pressed
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _pressed = False
    previous, previous_hook = signal.signal(signal.SIGINT, _on_sigint), sys.unraisablehook

    def hook(unraisable: "sys.UnraisableHookArgs") -> None:
        if unraisable.exc_type is None or not issubclass(unraisable.exc_type, KeyboardInterrupt):
            previous_hook(unraisable)
    sys.unraisablehook = hook
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        sys.unraisablehook = previous_hook


def pressed() -> bool:
    """Whether Ctrl-C came (within `recorded`): an error raised since may be the key's, turned into a library's own
    (a C extension whose import the key cut short raises ImportError from it)."""
    return _pressed


def raise_if_pressed() -> None:
    """KeyboardInterrupt if Ctrl-C came and its exception was swallowed on the way."""
    if _pressed:
        raise KeyboardInterrupt


def exit_interrupted() -> NoReturn:
    """End the process with status 130 (128 + SIGINT), the standard streams flushed."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            with contextlib.suppress(OSError, ValueError):  # a closed pipe or stream holds nothing to keep
                stream.flush()
    # Why not sys.exit(130): under `python -m`, CPython (since 3.8) records a KeyboardInterrupt that ended any exec
    # or eval of a string (namedtuple's eval, say, in an import the key cut short) as unhandled even when caught
    # later, and once the interpreter is finalized kills the process with SIGINT (status -2) whatever sys.exit said.
    # Nothing is lost by skipping that finalization: metrics.jsonl was closed as the KeyboardInterrupt unwound (each
    # row flushed as written), TensorBoard's writer and log handlers flush every record, a checkpoint the key cut
    # stays .partial, and worker threads hold no result to keep.
    os._exit(130)
