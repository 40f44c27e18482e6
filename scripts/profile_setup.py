"""Where offload-train's set-up time goes before the first step: each phase of `offload-train --model M`
(data, model on the meta device, engine) run under cProfile, the top entries of each printed.

    python scripts/profile_setup.py --model llama-8b --device cuda
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from offload_ext.train import cli as train
from offload_ext.train import machine, tokens
from offload_ext.train import setup as train_setup
from offload_ext.train.flags import train_config
from offload_ext.train.trainer import Trainer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--top", type=int, default=14)
    a = ap.parse_args()
    args = train.parse_args(["--model", a.model, "--device", a.device, "--steps", "1", "--batch-size", "1",
                             "--seq-len", "4096", "--out", "/tmp/profile_setup", "--overwrite"])
    device, simulated = machine.choose_device(args)
    machine.apply_defaults(args, device.type == "cuda")
    phases = {"data": lambda: tokens.build_stream(args)}
    stream, _, vocab = _profiled("data", phases["data"], a.top)
    model, weights = _profiled("model", lambda: train_setup.build_model(args, vocab, device), a.top)
    _profiled("engine", lambda: Trainer(train_config(args, device), model, device, simulated, weights), a.top)


def _profiled(name: str, fn, top: int):
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    out = fn()
    prof.disable()
    print(f"== {name}: {time.perf_counter() - t0:.2f} s")
    pstats.Stats(prof).sort_stats("cumulative").print_stats(top)
    return out


if __name__ == "__main__":
    main()
