"""Ctrl-C is never lost: one swallowed by a finalizer still ends the run at the next step boundary, and the
process exits with status 130 wherever the key landed."""
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


def test_a_ctrl_c_that_ends_a_string_exec_still_exits_130_under_python_m(tmp_path) -> None:
    # Under `python -m`, CPython marks a KeyboardInterrupt that ended an exec or eval of a string as unhandled even
    # when caught, and then kills the process with SIGINT (status -2) whatever sys.exit said: the key landed so
    # inside namedtuple's eval, in an import the run's first curves drawing began.
    (tmp_path / "press_in_exec.py").write_text(f"""
from offload_ext.train import cli
cli.check_inputs = lambda args: exec("import os, signal, time; os.kill(os.getpid(), signal.SIGINT); time.sleep(60)")
cli.main(["--out", {str(tmp_path / "run")!r}, "--device", "cpu"])
""")
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(interrupt.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), package_root]))
    done = subprocess.run([sys.executable, "-m", "press_in_exec"], capture_output=True, text=True, timeout=120,
                          env=env)
    assert done.returncode == 130, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"offload-train: interrupted; nothing to resume in {tmp_path / 'run'} (no complete checkpoint): start again "
        "with --overwrite"]
