"""Ctrl-C is never lost: one swallowed by a finalizer still ends the run at the next step boundary."""
import gc
import os
import signal
import subprocess
import sys

import pytest

from offload_ext.train import interrupt


class _PressesCtrlCWhenCollected:
    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGINT)  # the handler runs here, inside __del__, where Python drops its raise


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the swallowed raise, on purpose
def test_a_ctrl_c_swallowed_inside_a_finalizer_is_raised_at_the_next_check() -> None:
    with interrupt.recorded():
        _PressesCtrlCWhenCollected()  # collected at once: its __del__ sends the signal
        gc.collect()
        with pytest.raises(KeyboardInterrupt):
            interrupt.raise_if_pressed()


def test_without_ctrl_c_the_check_passes_and_the_previous_handler_comes_back() -> None:
    before = signal.getsignal(signal.SIGINT)
    with interrupt.recorded():
        interrupt.raise_if_pressed()
    assert signal.getsignal(signal.SIGINT) is before


def test_a_ctrl_c_swallowed_inside_a_finalizer_prints_no_traceback() -> None:
    # Python prints a KeyboardInterrupt dropped in __del__ as "Exception ignored ... Traceback": offload-train's
    # Ctrl-C must still end in its one line, whatever the key interrupted.
    code = """
import gc, os, signal
from offload_ext.train import interrupt
class C:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
with interrupt.recorded():
    C()
    gc.collect()
    try:
        interrupt.raise_if_pressed()
    except KeyboardInterrupt:
        print("stopped at the check")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "stopped at the check\n", done.stderr
    assert done.stderr == ""
