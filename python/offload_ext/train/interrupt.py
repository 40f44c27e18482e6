"""Ctrl-C that is never lost: Python drops a KeyboardInterrupt raised inside a finalizer (`__del__`), printing it as
"Exception ignored ... Traceback" on stderr, so a key pressed while one runs would let the run go on to its end.
The handler also records the key, the loop raises at its next step boundary when the interrupt was swallowed, and
the dropped KeyboardInterrupt is not printed (the run still ends with its one line)."""
from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType

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


def raise_if_pressed() -> None:
    """KeyboardInterrupt if Ctrl-C came and its exception was swallowed on the way."""
    if _pressed:
        raise KeyboardInterrupt
