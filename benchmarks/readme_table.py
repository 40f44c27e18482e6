"""The README's performance table, generated from the suite's result files (never typed by hand).

Each row is one row of a `benchmarks/suite.py` results JSON (`benchmarks/results/<date>_<commit>/suite_*.json`),
the newest GPU run of it beside its peer, so a new suite run replaces the rows it measured without an edit here:
its median step, the ratio to the peer it was measured beside in each round, GPU cap, GPU peak and host RSS peak,
with the file's date, commit and machine. `--write README.md` replaces the text between the table's markers;
tests/docs/test_readme_table.py checks the README holds exactly what this prints.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BEGIN, END = "<!-- perf-table:begin (benchmarks/readme_table.py) -->", "<!-- perf-table:end -->"

SHAPES = {"b1": "B1 (Llama-3.2-1B shape, 4 x 2048 tokens)", "b2": "B2 (Llama-3.1-8B shape, 2 x 4096 tokens)",
          "b2-32k": "Llama-3.1-8B shape, 1 x 32768 tokens", "qwen-14b": "Qwen2.5-14B shape, 1 x 4096 tokens",
          "mistral-24b": "Mistral-Small-24B shape, 1 x 4096 tokens",
          "llama-70b": "Llama-3.1-70B shape, 1 x 4096 tokens"}
# (what the row is, shape, the suite's row key): each from the newest GPU result file where the row ran and so did
# the peer it was measured beside. The offloaded rows run the layout offload-train chooses by default (`auto`).
ROWS = [
    ("plain", "b1", "plain"),
    ("clip 1.0 on a real run", "b1", "clipreal"),
    ("compiled, beside compiled resident", "b1", "compiled"),
    ("2 micro-batches", "b1", "accum2"),
    ("4 micro-batches", "b1", "accum4"),
    ("clip 1.0 on a real run", "b2", "clipreal"),
    ("8-bit moments in a 64 GB host, clip 1.0", "b2", "8bit-clipreal"),
    ("DeepSpeed ZeRO-3 offload, tuned, clip 1.0", "b1", "deepspeed-tuned"),
    ("DeepSpeed ZeRO-2 optimizer offload, tuned, clip 1.0", "b1", "deepspeed2-tuned"),
    ("DeepSpeed ZenFlow (its own update rule, fp32 masters), clip 1.0, beside our mixed", "b1", "deepspeed-zenflow"),
    ("DeepSpeed SuperOffload (fp32 masters), clip 1.0, beside our mixed", "b1", "deepspeed-superoffload"),
    ("torchao's CPUOffloadOptimizer, clip 1.0", "b1", "torchao"),
    ("DeepSpeed ZeRO-3 offload, tuned, clip 1.0", "b2", "deepspeed-tuned"),
    ("LoRA r16, beside resident LoRA (bf16 adapters both)", "b2", "b2-lora16"),
    ("FSDP2 offload (one rank) with CPUAdamW, clip 1.0, beside it with torch's fused AdamW", "b2",
     "fsdp-cpuadamw-clip"),
    ("FSDP2 offload (one rank), no clipping, CPUAdamW stepping in backward (offload-train --fsdp's way), beside it "
     "with torch's fused AdamW", "b2", "fsdp-overlap"),
    ("every layer kept (no recompute), beside resident without checkpointing", "b1", "ckptnone"),
    ("layers kept where the cap has room, beside resident-lean", "b2", "b2-ckptauto"),
    ("activation offload, beside the same run uncapped", "b2-32k", "long-aoff"),
    ("full fine-tune, bf16", "qwen-14b", "14b"),
    ("full fine-tune, 8-bit moments", "mistral-24b", "24b-8bit"),
    ("LoRA r16 on an NF4 base, beside bitsandbytes' QLoRA", "llama-70b", "70b-lora16-basenf4"),
    ("LoRA r16 on an int8 base, beside it resident", "llama-70b", "70b-lora16-baseint8"),
]


# Rows that start from the same weights on the same batch give the same first loss (before any step), up to the
# order a forward's kernels round in: at most 0.07 % apart so far (the 70 B NF4 pair, two dequantization paths). A
# wider gap means the row trained other weights, and its time is not the same run's.
START_TOLERANCE = 2e-3


def other_start(row: dict, peer: dict) -> str | None:
    """Why `row` (a suite row with rounds) is not the run its `peer` is, from their first losses; None if it is."""
    ours, theirs = (r["rounds"][0].get("losses") or [None] for r in (row, peer))
    if ours[0] is None or theirs[0] is None or abs(ours[0] - theirs[0]) <= START_TOLERANCE * abs(theirs[0]):
        return None
    return f"first loss {ours[0]:.4f} against {theirs[0]:.4f}: other weights"


def _ran(row: dict | None) -> bool:
    return row is not None and row.get("step_s") is not None


def gpu_suites(results: str) -> list[tuple[str, str, dict]]:
    """Every GPU suite file under `results`: (its date, its path relative to `results`, its contents)."""
    found = []
    for path in glob.glob(os.path.join(results, "*", "suite_*.json")):
        with open(path) as f:
            result = json.load(f)
        if result["args"].get("device", "cuda") == "cuda":
            found.append((result["date"], os.path.relpath(path, results), result))
    return found


def newest(suites: list[tuple[str, str, dict]], shape: str, key: str) -> tuple[str, dict]:
    """Of `suites` (gpu_suites), the newest by its own date where row `key` of `shape` ran, and its peer too where
    it has one: (its path, its contents)."""
    found = []
    for date, path, result in suites:
        rows = {r["key"]: r for r in result["rows"]}
        row = rows.get(key)
        if row and row["shape"] == shape and _ran(row) and (not row["peer"] or _ran(rows.get(row["peer"]))):
            found.append((date, path, result))
    if not found:
        raise SystemExit(f"readme_table: no GPU suite file holds a run of {shape} row {key!r}")
    _, path, result = max(found, key=lambda f: f[0])
    return path, result


def _gb(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _row(what: str, shape: str, key: str, suites: list[tuple[str, str, dict]]) -> str:
    path, result = newest(suites, shape, key)
    rows = {r["key"]: r for r in result["rows"]}
    ours = rows[key]
    peer = rows[ours["peer"]] if ours["peer"] else None
    cap = (f"{ours['cap_gb']:g} GB" if ours["cap_gb"] else "none") + (
        f", host {ours['host_gb']:g} GB" if ours.get("host_gb") else "")
    if peer is None:  # a row nothing is measured beside
        beside, ratios, peaks = "-", "-", ("-", "-")
    else:
        beside = f"`{peer['mode']}`: {peer['step_s']:.3f} s"
        ratios = ", ".join(f"{x:.3f}x" for x in ours["round_ratio"])
        mismatch = other_start(ours, peer)
        ratios += f" ({mismatch})" if mismatch else ""
        peaks = (_gb(peer["gpu_peak_gb"]), _gb(peer["host_rss_peak_gb"]))
    machine = result["machine"]
    return (f"| {SHAPES[ours['shape']]}, {what} | `{ours['mode']}`: {ours['step_s']:.3f} s | {cap} | "
            f"{beside} | {ratios} | {_gb(ours['gpu_peak_gb'])} / {peaks[0]} | "
            f"{_gb(ours['host_rss_peak_gb'])} / {peaks[1]} | "
            f"{result['date'][:10]}, {result['commit']}, {machine.get('gpu') or 'CPU'} "
            f"({machine.get('usable_cpus', '?')}-core host) | [{os.path.basename(path)}](benchmarks/results/{path}) |")


def table(results: str = os.path.join(HERE, "results")) -> str:
    head = ("| recipe | row: median step | GPU cap | beside: median step | time vs beside, each round | "
            "GPU peak GB (row / beside) | host RSS peak GB (row / beside) | date, commit, machine | result |\n"
            "|---|---|---|---|---:|---|---|---|---|")
    suites = gpu_suites(results)
    return "\n".join([head, *(_row(*r, suites) for r in ROWS)])


def replaced(readme: str) -> str:
    """`readme` with the text between the markers replaced by the current table."""
    start, stop = readme.index(BEGIN) + len(BEGIN), readme.index(END)
    return readme[:start] + "\n" + table() + "\n" + readme[stop:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", metavar="README", help="replace the table between the markers in this file")
    args = ap.parse_args()
    if args.write is None:
        print(table())
        return
    with open(args.write) as f:
        text = f.read()
    if BEGIN not in text or END not in text:
        sys.exit(f"readme_table: {args.write} has no {BEGIN} ... {END} markers to replace")
    with open(args.write, "w") as f:
        f.write(replaced(text))


if __name__ == "__main__":
    main()
