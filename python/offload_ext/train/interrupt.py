"""Ctrl-C that is never lost: Python drops a KeyboardInterrupt raised inside a finalizer (`__del__`, with only an
"Exception ignored" line on stderr), so a key pressed while one runs would let the run go on to its end. The
handler also records the key, and the loop raises at its next step boundary when the interrupt was swallowed."""
from __future__ import annotations

import contextlib
import signal
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
    """Within: Ctrl-C raises KeyboardInterrupt as usual and is remembered for `raise_if_pressed`."""
    global _pressed
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _pressed = False
    previous = signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def raise_if_pressed() -> None:
    """KeyboardInterrupt if Ctrl-C came and its exception was swallowed on the way."""
    if _pressed:
        raise KeyboardInterrupt
