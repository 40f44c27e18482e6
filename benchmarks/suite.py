"""The performance suite: every row of the performance tables measured by one command, each mode in its own
process, the modes in turns, and the tables written from what it measured.

    python benchmarks/suite.py --preset b1              # B1 (1.24 B, 4 x 2048): every recipe and every peer
    python benchmarks/suite.py --preset b2 --only plain,clipreal   # some rows of B2 (8 B, 2 x 4096, 24 GB cap)
    python benchmarks/suite.py --preset fsdp            # FSDP2's CPU offload, torch's AdamW against CPUAdamW
    python benchmarks/suite.py --preset reach           # 70 B LoRA on quantized bases, the 24 B full fine-tune
    python benchmarks/suite.py --preset kept            # layers kept without recompute, a 32768-token sequence
    python benchmarks/suite.py --preset all --rounds 2
    python benchmarks/suite.py --tables                 # rewrite the tables from the files their markers name

A round runs every row once, each in a fresh `bench_train.py` process (--warmup and --steps of its own, on the
embedded corpus, so that clipping at 1.0 follows a real run's first steps), a row next to the peer it is compared
with; the next round runs them in the reverse order, so that no row always runs first. Every row keeps each
round's step times, its GPU peak (torch's allocator) and its host RSS peak (the process's, from the kernel), and
the GPU cap it ran under; a ratio is taken within each round, between a row and its peer of the same round, and
the table shows each round's ratio: a headline holds when it holds in every round. A row's process is killed
with every process below it (torchrun's ranks) at --row-timeout; SIGTERM (a `timeout` around the suite) kills
the row running and writes the file with the rounds measured before it.

The results go to `suite_<preset>.json` (and .md) in the run's directory (benchmarks/results/<date>_<commit>/),
beside a `suite_<preset>/` folder of each process's own result file and log. The tables in docs/performance.md
sit between markers naming the file they were generated from; `--write` (after a run, or with --tables) points
the markers at the new files and regenerates the text between them, and the README's one table with them
(benchmarks/readme_table.py: each of its rows from the newest result file that measured it).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import _common
import readme_table

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH_TRAIN = os.path.join(HERE, "bench_train.py")
BENCH_FSDP = os.path.join(HERE, "bench_fsdp.py")
CAP_GB = 24.0  # the B2 rows' GPU cap for every offloading mode: a 24 GB card's


@dataclasses.dataclass(frozen=True)
class Row:
    """One row: a bench_train mode on a shape (or, `fsdp`, a bench_fsdp mode on its B2 shape, one rank under
    torchrun), the row it is compared with (`peer`), its GPU cap, and the host memory its process is told it has
    (`host_gb`: OFFLOAD_EXT_HOST_MEMORY, which the memory plan, and speculation's share, are sized to), and the
    CUDA allocator's settings it starts with (`alloc_conf`: PYTORCH_CUDA_ALLOC_CONF)."""

    key: str
    shape: str
    mode: str
    peer: str | None = None
    cap_gb: float | None = None
    host_gb: float | None = None
    alloc_conf: str | None = None
    compile: bool = False
    fsdp: bool = False


def _pairs(shape: str, recipes: list[str], cap: float | None, prefix: str = "", layout: str = "auto") -> list[Row]:
    """For each recipe suffix, resident-lean (uncapped) and the engine with its defaults (capped): the layout
    offload-train chooses by default on a GPU (`auto`; `layout=""`: the Offloader's fixed one)."""
    rows = []
    for recipe in recipes:
        tail = "".join(f"-{part}" for part in (layout, recipe) if part)
        name = recipe or "plain"
        rows.append(Row(f"{prefix}resident-{name}", shape, f"resident-lean{f'-{recipe}' if recipe else ''}"))
        rows.append(Row(f"{prefix}{name}", shape, f"native-bf16{tail}", f"{prefix}resident-{name}", cap))
    return rows


def _peers(shape: str, cap: float | None, zero2: bool) -> list[Row]:
    """The other offloading libraries on clip 1.0, each compared with the engine's clipreal row of its precision."""
    rows = [Row("deepspeed-stock", shape, "deepspeed-bf16-clipreal", "clipreal", cap),
            Row("deepspeed-tuned", shape, "deepspeed-bf16-tuned-clipreal", "clipreal", cap)]
    if zero2:  # ZeRO-2, SuperOffload and torchao keep the weights on the GPU: where they fit
        rows += [Row("deepspeed2-tuned", shape, "deepspeed2-bf16-tuned-clipreal", "clipreal", cap),
                 # neither newer engine takes bf16 master weights: fp32 masters, beside the engine's mixed
                 Row("deepspeed-zenflow", shape, "deepspeed2-mixed-tuned-zenflow-clipreal", "mixed-clipreal", cap),
                 Row("deepspeed-superoffload", shape, "deepspeed-mixed-tuned-superoffload-clipreal", "mixed-clipreal",
                     cap),
                 Row("torchao", shape, "torchao-bf16-clipreal", "clipreal", cap)]
    return rows


def _layouts(name: str, layout: str, shape: str, recipes: list[str], cap: float | None) -> list[Row]:
    """The engine laid out by bench_train's `layout` suffix for each recipe, against resident-lean of the recipe."""
    return [Row(f"{name}-{recipe or 'plain'}", shape, f"native-bf16-{layout}{f'-{recipe}' if recipe else ''}",
                f"resident-{recipe or 'plain'}", cap) for recipe in recipes]


B1_RECIPES = ["", "clipreal", "clipall", "accum2", "accum4"]
HANDPICKED_RECIPES = ["", "clipreal", "accum2", "accum4"]
# B1's best hand-picked layout of the earlier runs: 12 of 16 layers resident, a buffer for each streamed one (run
# 52); the default rows (the layout the engine chooses itself) must come within 3 % of it
HANDPICKED = "d16-r12"
PRESETS: dict[str, list[Row]] = {
    "b1": [*_pairs("b1", B1_RECIPES, None),
           Row("mixed", "b1", "native-mixed-auto", "resident-plain"),
           Row("mixed-clipreal", "b1", "native-mixed-auto-clipreal", "resident-clipreal"),
           Row("compiled-resident", "b1", "resident-lean", compile=True),
           Row("compiled", "b1", "native-bf16-auto", "compiled-resident", compile=True),
           *_layouts("handpicked", HANDPICKED, "b1", HANDPICKED_RECIPES, None),
           *_peers("b1", None, zero2=True)],
    "b2": [*_pairs("b2", B1_RECIPES, CAP_GB),
           Row("mixed", "b2", "native-mixed-auto", "resident-plain", CAP_GB),
           # issue 38's 8 B point: 8-bit moments (params rounded stochastically) against bf16's, clip 1.0, in the
           # 64 GB of host a workstation has (speculation gets what is left)
           Row("8bit-clipreal", "b2", "native-8bitsr-auto-clipreal", "clipreal", CAP_GB, host_gb=64.0),
           # hand-picked against the default on B2: the chosen layout with half of each stack's clipped redo on the
           # device instead of a third (B2 clips every step on the embedded corpus: the host redo delays the next
           # forward), and with none
           *_layouts("handpicked", "auto-dr16", "b2", ["clipreal"], CAP_GB),
           *_layouts("handpicked-dr0", "auto-dr0", "b2", ["clipreal"], CAP_GB),
           # resident layers around the plan's choice under the cap (5 with 3 % of the GPU kept free): 3 was the
           # choice while a checkpoint's copy of the device state was planned on the GPU, 4 while the plan kept a
           # tenth free, 6 with 1 % (the allocator then reserved 23.1 of the 24 GB)
           *(row for r in (3, 4, 6) for row in _layouts(f"handpicked-r{r}", f"auto-r{r}", "b2", ["clipreal"], CAP_GB)),
           # 6 with the allocator growing segments instead of caching blocks: whether its reserve then stays
           # within the plan's margin, so that the headroom could shrink to let the plan choose 6 (it did not: 5.3 %
           # over its allocations, history.md run 103)
           *(dataclasses.replace(row, alloc_conf="expandable_segments:True")
             for row in _layouts("handpicked-r6-xseg", "auto-r6", "b2", ["clipreal"], CAP_GB)),
           *_peers("b2", CAP_GB, zero2=False)],
    "lora": _pairs("b2", ["lora16"], CAP_GB, prefix="b2-"),
    # layers kept without recompute (opt-in: activation_checkpointing "none" or "auto"): B1 keeping every layer
    # against resident without checkpointing; "auto" under the cap against resident-lean uncapped, on B1 and B2;
    # one 32768-token sequence of the 8 B shape under the cap with activation offload, against the same run uncapped
    # without it (resident with checkpointing does not fit 24 GB there)
    "kept": [Row("resident-ckptnone", "b1", "resident-ckptnone"),
             Row("ckptnone", "b1", "native-bf16-auto-ckptnone", "resident-ckptnone"),
             Row("resident-plain", "b1", "resident-lean"),
             Row("ckptauto", "b1", "native-bf16-auto-ckptauto", "resident-plain", CAP_GB),
             Row("b2-resident-plain", "b2", "resident-lean"),
             Row("b2-ckptauto", "b2", "native-bf16-auto-ckptauto", "b2-resident-plain", CAP_GB),
             Row("long-uncapped", "b2-32k", "native-bf16-auto"),
             Row("long-aoff", "b2-32k", "native-bf16-auto-aoff", "long-uncapped", CAP_GB)],
    # FSDP2's CPU offload on one GPU, clip 1.0: torch's AdamW as FSDP2 runs it and fused, CPUAdamW after backward
    # and overlapped with it; each offloaded row against the strongest torch one of its recipe
    "fsdp": [Row("fsdp-resident", "b2", "resident", fsdp=True),
             Row("fsdp-torchfused-clip", "b2", "offload-torchfused-clip", "fsdp-resident", fsdp=True),
             *(Row(f"fsdp-{m}", "b2", f"offload-{m}", "fsdp-torchfused-clip", fsdp=True)
               for m in ("torch-clip", "cpuadamw-clip", "overlap-clip")),
             # and without clipping: the overlap on and off where a host cannot hold the state a clipped overlap
             # keeps for its redos (the 8 B shape's 80 GB of host buffers do not fit the GPU machine's 125 GB)
             Row("fsdp-torchfused", "b2", "offload-torchfused", "fsdp-resident", fsdp=True),
             *(Row(f"fsdp-{m}", "b2", f"offload-{m}", "fsdp-torchfused", fsdp=True) for m in ("cpuadamw", "overlap"))],
    # issue 38's reach: LoRA r16 on the 70 B shape, its base quantized, offloaded under the cap against the same
    # base resident (int8: the engine's storage; NF4: bitsandbytes' QLoRA); the 24 B shape's full fine-tune alone
    # (nothing resident holds it), in 8-bit moments without clipping: the precision and recipe its plan fits in
    # the GPU machine's host (101 GB of RSS planned; bf16 needs 140 GB, clipping 178 GB or more). A quantized base is
    # dequantized inside each streamed layer: these rows keep the Offloader's fixed layout
    "reach": [*_pairs("llama-70b", ["lora16-baseint8", "lora16-basenf4"], CAP_GB, prefix="70b-", layout=""),
              Row("24b-8bit", "mistral-24b", "native-8bitsr", None, CAP_GB),
              # the Qwen2.5-14B shape's full fine-tune in bf16 under the cap, with the default layout (~85 GB of RSS)
              Row("14b", "qwen-14b", "native-bf16-auto", None, CAP_GB)],
}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=[*PRESETS, "all"], help="the rows to measure")
    ap.add_argument("--only", default=None, metavar="KEY,...",
                    help="only these rows (their peers are added): e.g. plain,clipreal")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of every row (each ratio is shown per round)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10, help="timed steps of each row in each round")
    ap.add_argument("--row-timeout", type=float, default=600.0, metavar="S",
                    help="kill a row's process after S seconds (its row then says so)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: the simulated device with --shape tiny, for a run of the suite itself")
    ap.add_argument("--shape-args", default="", metavar="ARGS",
                    help="bench_train shape flags for every row (e.g. '--layers 2 --hidden 64'): the smoke run's")
    ap.add_argument("--out", default=None, help="the results directory (default: this run's under results/)")
    ap.add_argument("--tables", action="store_true", help="regenerate the tables from the files they name")
    ap.add_argument("--write", action="append", default=[], metavar="FILE",
                    help="markdown files whose suite tables to rewrite (default: README.md and docs/performance.md)")
    a = ap.parse_args(argv)
    if (a.preset is None) == (not a.tables):
        ap.error("give --preset to measure, or --tables to regenerate the tables")
    if a.rounds < 1 or a.steps < 1 or a.warmup < 0:
        ap.error("--rounds and --steps take 1 or more, --warmup 0 or more")
    return a


def selected(preset: str, only: str | None) -> list[Row]:
    """The preset's rows, or those named by `only` with the peers they are compared with, in the preset's order."""
    rows = PRESETS[preset]
    if only is None:
        return rows
    keys = set(only.split(","))
    unknown = keys - {r.key for r in rows}
    if unknown:
        raise SystemExit(f"suite: {preset} has no row {sorted(unknown)[0]!r}; its rows: "
                         f"{', '.join(r.key for r in rows)}")
    by_key = {r.key: r for r in rows}
    while True:
        more = {by_key[k].peer for k in keys if by_key[k].peer} - keys
        if not more:
            return [r for r in rows if r.key in keys]
        keys |= more


def _command(row: Row, a: argparse.Namespace, stem: str) -> list[str]:
    if row.fsdp:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                BENCH_FSDP, "--modes", row.mode, "--warmup", str(a.warmup), "--steps",
                str(a.steps), "--stem", stem, "--device", a.device, *a.shape_args.split()]
    cmd = [sys.executable, BENCH_TRAIN, "--preset", row.shape, "--modes", row.mode, "--warmup", str(a.warmup),
           "--steps", str(a.steps), "--batches", str(a.warmup + a.steps), "--data", "embedded", "--stem", stem,
           "--device", a.device, *a.shape_args.split()]
    if row.cap_gb:
        cmd += ["--gpu-cap-gb", f"{row.cap_gb:g}"]
    if row.compile:
        cmd.append("--compile")
    return cmd


class Stop:
    """SIGTERM (what `timeout` sends) while the suite measures: the row running is killed, no row starts after it,
    and the suite writes what it measured; a `timeout` around the suite then leaves its file, not only its rows'."""

    def __init__(self) -> None:
        self.requested = False
        self.running: subprocess.Popen | None = None

    def __call__(self, signum: int, frame: Any) -> None:
        self.requested = True
        if self.running is not None:
            kill_tree(self.running)


STOP = Stop()


def _tree(pid: int) -> list[int]:
    """`pid` and every live process below it, parents first (each process's parent read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])  # after the name, which may hold spaces
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo += children.get(found[-1], [])
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    """Kill a row's process and every process below it: torchrun's ranks outlive a killed torchrun (each in a
    session of its own), holding the GPU and the host's memory while the next rows run."""
    for pid in _tree(proc.pid):  # listed before any is killed: an orphan's parent is no longer its row's
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_row(row: Row, a: argparse.Namespace, jobs: str, round_: int) -> dict[str, Any]:
    """One process of one row (killed with the processes below it), its bench_train row, with the host RSS peak the
    kernel recorded for it."""
    stem = os.path.join(jobs, f"{row.key}-r{round_}")
    env = {k: v for k, v in os.environ.items() if k != "OUT"}  # the process's files stay in the jobs folder
    if row.host_gb:
        env["OFFLOAD_EXT_HOST_MEMORY"] = f"{row.host_gb:g}GB"
    if row.alloc_conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = row.alloc_conf
    with open(stem + ".log", "w") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(_command(row, a, stem), stdout=log, stderr=subprocess.STDOUT, env=env)
        STOP.running = proc
        if STOP.requested:  # the signal came before the row was known to it
            kill_tree(proc)
        # a row that hangs costs its own time, not the suite's
        timer = threading.Timer(a.row_timeout, kill_tree, (proc,))
        timer.start()
        _, status, usage = os.wait4(proc.pid, 0)
        timer.cancel()
        STOP.running = None
        proc.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - t0
    if seconds >= a.row_timeout:
        return {"error": f"killed after --row-timeout {a.row_timeout:g} s", "process_s": seconds}
    if proc.returncode != 0 or not os.path.exists(stem + ".json"):
        with open(stem + ".log") as f:
            tail = " ".join(f.read().split()[-40:])
        return {"error": f"bench_train exited {proc.returncode}: ... {tail}", "process_s": seconds}
    with open(stem + ".json") as f:
        result = json.load(f)
    got = result["rows"][0][0] if row.fsdp else result["rows"][0]  # bench_fsdp's: per mode, per rank
    if row.fsdp:
        got["tokens_per_s"], got["clipped_fraction"] = got["tokens_per_s_per_gpu"], None
    got["host_rss_peak_gb"] = usage.ru_maxrss * 1024 / 1e9  # Linux gives kilobytes
    got["process_s"] = seconds
    got["args"] = result["args"]
    return got


def measure(rows: list[Row], a: argparse.Namespace, jobs: str) -> dict[str, list[dict[str, Any]]]:
    """Every row, round after round, the order reversed every other round; each row's rounds in order. `jobs`
    is a folder of this run's own (fresh_dir): each row's result is read back from it."""
    got: dict[str, list[dict[str, Any]]] = {r.key: [] for r in rows}
    for k in range(a.rounds):
        for row in rows if k % 2 == 0 else rows[::-1]:
            result = run_row(row, a, jobs, k + 1) if not STOP.requested else None
            if STOP.requested:  # no round of the row it stopped
                print(f"suite: stopped (SIGTERM) in round {k + 1} at {row.key}; writing what was measured", flush=True)
                return got
            got[row.key].append(result)
            shown = f"{result['step_s']:.4f} s" if "error" not in result else result["error"][:200]
            print(f"suite: round {k + 1} {row.key:20s} {row.mode:32s} {shown}", flush=True)
    return got


def summarise(rows: list[Row], got: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each row's figures: the median over all its timed steps, each round's median, the ratio to its peer in
    each round, and the peaks (the highest of its rounds)."""
    out = []
    for row in rows:
        rounds = got[row.key]
        entry: dict[str, Any] = {**dataclasses.asdict(row), "rounds": rounds}
        if not rounds:
            entry["error"] = "not run: the suite was stopped (SIGTERM) before this row"
            out.append(entry)
            continue
        errors = [r["error"] for r in rounds if "error" in r]
        if errors:
            entry["error"] = errors[0]
            out.append(entry)
            continue
        steps = [t for r in rounds for t in r["step_times_s"]]
        entry.update(step_s=statistics.median(steps), round_step_s=[r["step_s"] for r in rounds],
                     tokens_per_s=statistics.median(r["tokens_per_s"] for r in rounds),
                     model_tflops=_median([r.get("model_tflops") for r in rounds]),
                     gpu_peak_gb=max((r["gpu_peak_gb"] or 0.0) for r in rounds) or None,
                     host_rss_peak_gb=max(r["host_rss_peak_gb"] for r in rounds),
                     clipped_fraction=_mean([r["clipped_fraction"] for r in rounds]))
        peer = next((p for p in out if p["key"] == row.peer), None)
        if peer is not None and "error" not in peer:
            entry["round_ratio"] = [r["step_s"] / p for r, p in zip(rounds, peer["round_step_s"])]
        out.append(entry)
    return out


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


# ---------------------------------------------------------------------------------------------- the tables

_MARK = re.compile(r"<!-- suite-table:begin (\S+) -->\n.*?<!-- suite-table:end -->", re.DOTALL)


def _gb(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def rows_table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table."""
    lines = ["| row | mode | GPU cap | s/step (rounds), range of the steps | tok/s | model TFLOP/s | "
             "time vs peer, each round | GPU peak GB | host RSS peak GB | clipped |",
             "|---|---|---:|---|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        cap = (f"{r['cap_gb']:g} GB" if r["cap_gb"] else "none") + (f", host {r['host_gb']:g} GB" if r.get("host_gb")
                                                                    else "")
        mode = f"`{r['mode']}`" + (" compiled" if r["compile"] else "")
        if "error" in r:
            reason = " ".join(r["error"].split())[:160].replace("|", "\\|")
            lines.append(f"| {r['key']} | {mode} | {cap} | not run: {reason} | | | | | | |")
            continue
        rounds = ", ".join(f"{t:.4f}" for t in r["round_step_s"])
        steps = [t for one in r["rounds"] for t in one["step_times_s"]]
        spread = f"{(max(steps) - min(steps)) / r['step_s']:.1%}"
        vs = (", ".join(f"{x:.3f}x" for x in r["round_ratio"]) + f" ({r['peer']})") if r.get("round_ratio") else "-"
        peer = next((p for p in rows if p["key"] == r["peer"]), None)
        mismatch = r.get("round_ratio") and peer is not None and readme_table.other_start(r, peer)
        vs += f"; {mismatch}" if mismatch else ""
        clipped = "-" if r["clipped_fraction"] is None else f"{r['clipped_fraction']:.0%}"
        tflops = "-" if r.get("model_tflops") is None else f"{r['model_tflops']:.0f}"
        lines.append(f"| {r['key']} | {mode} | {cap} | {r['step_s']:.4f} ({rounds}), {spread} | "
                     f"{r['tokens_per_s']:,.0f} | {tflops} | {vs} | {_gb(r['gpu_peak_gb'])} | "
                     f"{_gb(r['host_rss_peak_gb'])} | {clipped} |")
    return "\n".join(lines)


def _host_copy(result: dict[str, Any]) -> str:
    """The host's copy bandwidth where the file has it (earlier files do not)."""
    return f", host copy {result['host_copy_gb_s']:.0f} GB/s" if "host_copy_gb_s" in result else ""


def table(path: str, base: str) -> str:
    """The table of one suite file (`path` relative to the repository), with what it ran on and a link to it
    relative to the directory `base` of the file it goes into."""
    with open(os.path.join(_common.REPO_DIR, path)) as f:
        result = json.load(f)
    machine, args = result["machine"], result["args"]
    link = os.path.relpath(os.path.join(_common.REPO_DIR, path), os.path.join(_common.REPO_DIR, base))
    head = (f"{result['preset']}: {args['warmup']} warm-up and {args['steps']} timed steps per row and round, "
            f"{args['rounds']} round{'s' if args['rounds'] != 1 else ''}; {result['date'][:10]}, "
            f"commit {result['commit']}, "
            f"{machine.get('gpu') or 'CPU'} ({machine.get('usable_cpus', '?')}-core host, "
            f"{machine.get('mem_total_gb', '?')} GB RAM{_host_copy(result)}); [{os.path.basename(path)}]({link})")
    return head + "\n\n" + rows_table(result["rows"])


def rewrite(text: str, base: str, new: dict[str, str] | None = None) -> str:
    """`text` (a file in the directory `base`) with each suite table regenerated from the file its marker names
    (`new`: preset -> file, for the markers of those presets to name first)."""
    def one(match: re.Match) -> str:
        path = match[1]
        with open(os.path.join(_common.REPO_DIR, path)) as f:
            preset = json.load(f)["preset"]
        path = (new or {}).get(preset, path)
        return f"<!-- suite-table:begin {path} -->\n{table(path, base)}\n<!-- suite-table:end -->"
    text = _MARK.sub(one, text)
    # the README's one table: each row from the newest result file of it (readme_table.py)
    return readme_table.replaced(text) if readme_table.BEGIN in text else text


def write_tables(files: list[str], new: dict[str, str] | None = None) -> None:
    for name in files:
        path = os.path.join(_common.REPO_DIR, name)
        with open(path) as f:
            text = f.read()
        changed = rewrite(text, os.path.dirname(name), new)
        if changed != text:
            with open(path, "w") as f:
                f.write(changed)
            print(f"suite: rewrote the suite tables in {name}")


def main() -> None:
    a = parse()
    targets = a.write or ["README.md", "docs/performance.md"]
    if a.tables:
        write_tables(targets)
        return
    presets = list(PRESETS) if a.preset == "all" else [a.preset]
    written: dict[str, str] = {}
    signal.signal(signal.SIGTERM, STOP)
    # the offloaded rows' host steps are bound by it, and machines of one kind differ: each file says its host's
    host_copy = _common.host_copy_gb_s(1 << 28)
    for preset in presets:
        if STOP.requested:
            break
        rows = selected(preset, a.only if a.preset != "all" else None)
        out = a.out or _common.run_dir(_common.git_commit(), datetime.datetime.now(datetime.timezone.utc))
        jobs = _common.fresh_dir(os.path.join(out, f"suite_{preset}"))
        got = measure(rows, a, jobs)
        summary = summarise(rows, got)
        payload = {"preset": preset, "args": {k: v for k, v in vars(a).items() if k != "write"},
                   "jobs": os.path.relpath(jobs, out), "host_copy_gb_s": host_copy, "rows": summary}
        markdown = rows_table(summary)
        paths = _common.write_results(f"suite_{preset}", payload, markdown, out_dir=out)
        written[preset] = os.path.relpath(paths[0], _common.REPO_DIR)
        print(markdown, flush=True)
    if a.device == "cuda" and not a.out and not STOP.requested:
        write_tables(targets, written)
    if STOP.requested:
        sys.exit(128 + signal.SIGTERM)


if __name__ == "__main__":
    main()
