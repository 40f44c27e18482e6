"""Shared by the benchmark scripts: machine description, timing, and result files."""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import socket
import statistics
import sys
import time
from typing import Any, Callable

import torch

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict[str, Any]:
    info = {
        "host": socket.gethostname(),
        "cpu": _cpu_model(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_gb"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    return info


def command_line() -> str:
    return " ".join(shlex.quote(a) for a in ["python", *sys.argv])


def median_seconds(fn: Callable[[], None], steps: int, warmup: int, sync: Callable[[], None] = lambda: None) -> float:
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def write_results(stem: str, payload: dict[str, Any], markdown: str, out_dir: str | None = None) -> list[str]:
    """Write <stem>.json and <stem>.md (results dir, and $OUT when set); returns the paths."""
    payload = {"command": command_line(), "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
               "machine": machine_info(), **payload}
    header = (f"Command: `{payload['command']}`  \nDate: {payload['date']}  \n"
              f"Machine: {json.dumps(payload['machine'])}\n\n")
    dirs = [out_dir or RESULTS_DIR] + ([os.environ["OUT"]] if os.environ.get("OUT") else [])
    paths = []
    for d in dirs:
        os.makedirs(d, exist_ok=True)
        for ext, text in (("json", json.dumps(payload, indent=2)), ("md", header + markdown)):
            path = os.path.join(d, f"{stem}.{ext}")
            with open(path, "w") as f:
                f.write(text + "\n")
            paths.append(path)
    return paths
