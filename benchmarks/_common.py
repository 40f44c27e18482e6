"""Shared by the benchmark scripts: machine description, timing, and result files."""
from __future__ import annotations

import datetime as _dt
import itertools
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterator

import torch

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(BENCH_DIR)
# Raw runs: one directory per run, results/<YYYY-MM-DD>_<commit>/ (see results/README.md).
RESULTS_DIR = os.path.join(BENCH_DIR, "results")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def model_flops_per_token(config: Any, seq_len: int, trainable: int | None = None) -> float:
    """The training FLOPs one token costs the model itself, by PaLM's count (recompute not counted, so that runs
    that recompute differently compare): 4 per weight of every matmul for the forward and the activations'
    gradients (the head included; the input embedding is a lookup), 2 more per trained weight for its gradient,
    and 12 x layers x attention width x seq_len for attention's scores and values, forward and backward (the
    causal mask's half not taken off). `trainable`: the weights that get gradients, where not all matmul weights
    do (LoRA: the adapters')."""
    d, layers, heads = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or d // heads
    attention = d * head_dim * (2 * heads + 2 * config.num_key_value_heads)  # q and o; k and v
    matmul = layers * (attention + 3 * d * config.intermediate_size) + d * config.vocab_size
    return 4 * matmul + 2 * (matmul if trainable is None else trainable) + 12 * layers * heads * head_dim * seq_len


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
        info["mem_total_gb"] = round(_proc_kb("/proc/meminfo", "MemTotal") / 2**20, 1)
    except OSError:
        pass
    return info


def free_port() -> int:
    """A TCP port nothing listens on now, for a one-process rendezvous (DeepSpeed's, torchrun's)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def git_commit(repo: str | None = None) -> str:
    """`git rev-parse --short HEAD` of the checkout the benchmarks run from, with "-dirty" when tracked files
    have uncommitted changes; "unknown" when git is missing or this is not a git checkout.
    OFFLOAD_EXT_RESULTS_COMMIT overrides it: the GPU machine receives the working tree over a git checkout
    of an older commit, so its own git names the wrong one (pass the local `git rev-parse --short HEAD`)."""
    override = os.environ.get("OFFLOAD_EXT_RESULTS_COMMIT")
    if override:
        return override
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo or REPO_DIR, capture_output=True,
                              text=True, timeout=30, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo or REPO_DIR,
                               capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if not head:
        return "unknown"
    return f"{head}-dirty" if dirty else head


def host_copy_gb_s(elements: int = 1 << 29) -> float:
    """The host's memory bandwidth as torch copies an fp32 buffer of `elements` with its threads: bytes read and
    written per second, median of 7. Offloaded steps are bound by it; hosts of one machine kind differ."""
    a = torch.ones(elements)
    b = torch.empty_like(a)
    sec = median_seconds(lambda: b.copy_(a), steps=7, warmup=2)
    return 2 * a.numel() * a.element_size() / sec / 1e9


def run_dir(commit: str, date: _dt.datetime, root: str | None = None) -> str:
    """benchmarks/results/<YYYY-MM-DD>_<commit>: the directory of one run (UTC date)."""
    return os.path.join(root or RESULTS_DIR, f"{date.astimezone(_dt.timezone.utc):%Y-%m-%d}_{commit}")


def _numbered(name: str) -> Iterator[str]:
    """name, name-2, name-3, ...: the names a run takes in turn so as to overwrite nothing."""
    yield name
    yield from (f"{name}-{n}" for n in itertools.count(2))


def _free_stem(stem: str, dirs: list[str], exts: tuple[str, ...]) -> str:
    """The first of _numbered(stem) for which no <stem>.<ext> exists in any of dirs."""
    return next(c for c in _numbered(stem)
                if not any(os.path.exists(os.path.join(d, f"{c}.{ext}")) for d in dirs for ext in exts))


def fresh_dir(path: str) -> str:
    """The first of _numbered(path) that did not exist, now made. A run's files go where no earlier run's are,
    so that nothing it reads back can be another run's."""
    return next(c for c in _numbered(path) if _made(c))


def _made(path: str) -> bool:
    """Makes the directory `path`; False where it existed (the check and the making are one step)."""
    try:
        os.makedirs(path)
    except FileExistsError:
        return False
    return True


def write_results(stem: str, payload: dict[str, Any], markdown: str, out_dir: str | None = None) -> list[str]:
    """Write <stem>.json and <stem>.md into this run's directory, benchmarks/results/<date>_<commit>/ (or
    out_dir when given), and into $OUT when set; returns the paths.

    Both files carry the command, commit (`git rev-parse --short HEAD`, "-dirty" if tracked files changed),
    UTC date, torch version and machine. Nothing is overwritten: when <stem>.json or <stem>.md exists in
    any target directory, the files are written as <stem>-2, <stem>-3, ... instead. A stem with a directory
    (an absolute --stem, as the tests pass) names that directory in place of the run's.
    """
    if os.path.dirname(stem) and out_dir is None:
        # else the run's directory would be made (and left empty) while the files went to the stem's
        out_dir, stem = os.path.dirname(stem), os.path.basename(stem)
    now = _dt.datetime.now(_dt.timezone.utc)
    machine = machine_info()
    payload = {"command": command_line(), "commit": git_commit(), "date": now.isoformat(timespec="seconds"),
               "torch": machine["torch"], "machine": machine, **payload}
    header = (f"Command: `{payload['command']}`  \nCommit: {payload['commit']}  \nDate: {payload['date']}  \n"
              f"Torch: {payload['torch']}  \nMachine: {json.dumps(payload['machine'])}\n\n")
    dirs = [out_dir or run_dir(payload["commit"], now)] + ([os.environ["OUT"]] if os.environ.get("OUT") else [])
    dirs = list(dict.fromkeys(os.path.abspath(d) for d in dirs))  # $OUT may be the run directory itself
    files = (("json", json.dumps(payload, indent=2)), ("md", header + markdown))
    for d in dirs:
        os.makedirs(d, exist_ok=True)
    name = _free_stem(stem, dirs, tuple(ext for ext, _ in files))
    paths = []
    for d in dirs:
        for ext, text in files:
            path = os.path.join(d, f"{name}.{ext}")
            with open(path, "x") as f:  # "x": fail rather than overwrite, should the name be taken meanwhile
                f.write(text + "\n")
            paths.append(path)
    return paths


def publish(stem: str, payload: dict[str, Any], lines: list[str]) -> None:
    """A benchmark's table printed, then written with its payload (write_results), each file's path printed."""
    markdown = "\n".join(lines)
    print("\n" + markdown)
    for path in write_results(stem, payload, markdown):
        print(f"wrote {path}")


def _proc_kb(path: str, key: str) -> float:
    """A "Key: N kB" field of a /proc file (nan when absent)."""
    with open(path) as f:
        for line in f:
            if line.startswith(key + ":"):
                return float(line.split()[1])
    return float("nan")


def _meminfo_gb(key: str) -> float:
    return _proc_kb("/proc/meminfo", key) * 1024 / 1e9


def _rss_gb() -> float:
    return _proc_kb("/proc/self/status", "VmRSS") * 1024 / 1e9


class HostMemoryLog:
    """Samples this process's RSS and the machine's MemAvailable (GB) every `period` seconds into `path`,
    one flushed line each, so that the trail survives the process being killed for memory; `peak()`
    is the highest RSS since the last `label()`."""

    def __init__(self, path: str, period: float = 0.5) -> None:
        self._file = open(path, "a", buffering=1)
        self._period, self._label, self._peak = period, "start", 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def label(self, name: str) -> None:
        self._label, self._peak = name, _rss_gb()

    def peak(self) -> float:
        self._peak = max(self._peak, _rss_gb())
        return self._peak

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self._stop.wait(self._period):
            rss = _rss_gb()
            self._peak = max(self._peak, rss)
            self._file.write(f"{time.monotonic() - t0:8.1f} s  {self._label:24s} rss {rss:6.1f} GB  "
                             f"available {_meminfo_gb('MemAvailable'):6.1f} GB\n")

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._file.close()


def pyplot(script: str) -> Any:
    """matplotlib's pyplot on the file-only backend; without matplotlib, exit with the line that installs it."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(f"{script}: drawing needs matplotlib: pip install matplotlib "
                         "(or pip install \".[plot]\" in the repository)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
