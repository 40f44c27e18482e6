"""write_refusal tells a write the system refused from any other failure, as each writer of a checkpoint reports
it (the writes are real, in a child process under a file size limit), and from a Ctrl-C inside torch.save's
write, which torch reports with the same error."""
from __future__ import annotations

import json
import re
import subprocess
import sys

from helpers import file_size_limit
from offload_ext.train.errors import write_refusal

_CHILD = r"""
import json, pickle, sys
import torch
from safetensors.torch import save_file
from offload_ext.train.errors import write_refusal

out, big = sys.argv[1], torch.zeros(1 << 20)
def refusal(write):
    try:
        write()
    except Exception as exc:
        return write_refusal(exc), write_refusal(pickle.loads(pickle.dumps(exc)))  # as a rank's, sent to the others
    return None

def save_to_file_object():
    with open(out + "/b.pt", "wb") as f:
        torch.save(big, f)

print(json.dumps({"torch.save path": refusal(lambda: torch.save(big, out + "/a.pt")),
                  "torch.save file": refusal(save_to_file_object),
                  "safetensors": refusal(lambda: save_file({"w": big}, out + "/c.safetensors")),
                  "open": refusal(lambda: open(out + "/d.bin", "wb").write(bytes(1 << 22)))}))
"""


def test_each_writers_report_of_a_refused_write_is_a_refusal_and_other_failures_are_not(tmp_path) -> None:
    done = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path)], capture_output=True, text=True, timeout=120,
                          preexec_fn=file_size_limit(1 << 20))
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert re.fullmatch(r"a write was cut short, as on a full disk or past a file size limit \(torch.save: "
                        r"unexpected pos \d+ vs \d+\)", found["torch.save path"][0])  # its zip writer's alone
    assert found["torch.save file"][0] == "[Errno 27] File too large"  # from the OSError it was raised during
    assert found["torch.save file"][1].startswith("a write was cut short")  # pickled, the OSError is gone
    assert found["safetensors"] == ["File too large (os error 27)"] * 2
    assert found["open"] == ["[Errno 27] File too large"] * 2
    assert write_refusal(RuntimeError("shape mismatch")) is None
    assert write_refusal(ValueError("bad value")) is None


class _KeyDuringWrite:
    """A file whose third write is where Ctrl-C lands: torch.save calls it from its C++ writer."""

    def __init__(self) -> None:
        self.writes = 0

    def write(self, data) -> int:
        self.writes += 1
        if self.writes == 3:
            raise KeyboardInterrupt
        return len(data)

    def flush(self) -> None:
        pass


def test_ctrl_c_inside_torch_saves_write_is_not_taken_for_a_refused_write() -> None:
    # torch.save reports the KeyboardInterrupt raised in its write callback as its own RuntimeError, the same one a
    # refused write gives; the KeyboardInterrupt in the chain tells them apart (the run then ends with the
    # interrupt's line, not "could not be written")
    import torch

    try:
        torch.save(torch.zeros(1 << 16), _KeyDuringWrite())
    except KeyboardInterrupt:  # a torch that lets it through as itself: nothing to tell apart (and pytest goes on)
        return
    except RuntimeError as exc:
        assert isinstance(exc.__context__, KeyboardInterrupt)
        assert write_refusal(exc) is None
    else:
        raise AssertionError("torch.save went on past the interrupted write")
