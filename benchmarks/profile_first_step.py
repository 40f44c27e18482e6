"""Where offload-train's first step goes: the whole run (set-up and N steps) under torch.profiler.

Prints the ops by CPU time and by device time, writes the Chrome trace. offload-train checkpoints at its
end (48 GB at 8 B): stop it before with SIGINT (`timeout -s INT 90 python ...`); the tables cover what
ran. Issue 12's "first step within 15 s" is the target: the first step took ~3 s where later ones take ~1
(run 55); this says which ops.

    python benchmarks/profile_first_step.py --out /tmp/prof -- --model llama-8b --device cuda --steps 2 \
        --batch-size 1 --seq-len 4096
"""
from __future__ import annotations

import argparse
import gzip
import os
import shutil
import time

import torch

from offload_ext.train import cli as train


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for profile.json.gz and the tables")
    ap.add_argument("--rows", type=int, default=40, help="rows of each table")
    ap.add_argument("--run-dir", default="/tmp/profile_first_step_run",
                    help="offload-train's --out (removed after: its checkpoint can be tens of GB)")
    ap.add_argument("train_args", nargs=argparse.REMAINDER, help="offload-train's arguments, after --")
    a = ap.parse_args()
    argv = [x for x in a.train_args if x != "--"]
    os.makedirs(a.out, exist_ok=True)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        try:
            train.main(argv + ["--out", a.run_dir])
        except KeyboardInterrupt:
            print("profile_first_step: stopped by SIGINT; the tables cover what ran before it")
    shutil.rmtree(a.run_dir, ignore_errors=True)
    print(f"profile_first_step: run {time.perf_counter() - t0:.1f} s under the profiler")
    events = prof.key_averages()
    tables = [events.table(sort_by="self_cpu_time_total", row_limit=a.rows)]
    if torch.cuda.is_available():
        tables.append(events.table(sort_by="self_device_time_total", row_limit=a.rows))
    text = "\n\n".join(tables)
    print(text)
    with open(os.path.join(a.out, "profile_tables.txt"), "w") as f:
        f.write(text)
    trace = os.path.join(a.out, "profile.json")
    prof.export_chrome_trace(trace)
    with open(trace, "rb") as src, gzip.open(trace + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(trace)


if __name__ == "__main__":
    main()
