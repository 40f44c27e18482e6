"""The README's performance table, generated from the suite's result files (never typed by hand).

Each row is one row of a `benchmarks/suite.py` results JSON (`benchmarks/results/<date>_<commit>/suite_*.json`):
its median step, the ratio to the peer it was measured beside in each round, GPU cap, GPU peak and host RSS peak,
with the file's date, commit and machine. `--write README.md` replaces the text between the table's markers;
tests/docs/test_readme_table.py checks the README holds exactly what this prints.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BEGIN, END = "<!-- perf-table:begin (benchmarks/readme_table.py) -->", "<!-- perf-table:end -->"

RUN = "2026-12-06_2c6ce94"
B1, B1_PEERS = f"{RUN}/suite_b1.json", f"{RUN}/suite_b1-ds1.json"
# accumulation from the call before (run 95, on an H100); B2's DeepSpeed row from the last call that ran it (8666325)
B1_ACCUM = "2026-12-06_d53604a/suite_b1-2.json"
B2_PEERS = "2026-12-05_8666325/suite_b2-2.json"
# B2's default and 8-bit rows from the call that ran them side by side (run 93, on an H200)
B2 = "2026-12-05_a1df555/suite_b2-2.json"
SHAPES = {"b1": "B1 (Llama-3.2-1B shape, 4 x 2048 tokens)", "b2": "B2 (Llama-3.1-8B shape, 2 x 4096 tokens)",
          "mistral-24b": "Mistral-Small-24B shape, 1 x 4096 tokens",
          "llama-70b": "Llama-3.1-70B shape, 1 x 4096 tokens"}
# the 24 B full fine-tune: nothing on one GPU holds it to be set beside (run 94, on an H100)
REACH = "2026-12-06_7deb45f/suite_reach.json"
# the 70 B LoRA pairs (run 96, on H100s): NF4 beside bitsandbytes' QLoRA, int8 beside its own storage resident
REACH_NF4, REACH_INT8 = "2026-12-06_3ac0d00/suite_reach-nf4.json", f"{RUN}/suite_reach-int8.json"
# (what the row is, results file, row key): the offloaded rows run the layout offload-train chooses by default
# (`auto`), the peers beside the Offloader in that call
ROWS = [
    ("plain", B1, "plain"),
    ("clip 1.0 on a real run", B1, "clipreal"),
    ("compiled, beside compiled resident", B1, "compiled"),
    ("2 micro-batches", B1_ACCUM, "accum2"),
    ("4 micro-batches", B1_ACCUM, "accum4"),
    ("clip 1.0 on a real run", B2, "clipreal"),
    ("8-bit moments in a 64 GB host, clip 1.0", B2, "8bit-clipreal"),
    ("DeepSpeed ZeRO-3 offload, tuned, clip 1.0", B1_PEERS, "deepspeed-tuned"),
    ("DeepSpeed ZeRO-2 optimizer offload, tuned, clip 1.0", B1_PEERS, "deepspeed2-tuned"),
    ("DeepSpeed ZeRO-3 offload, tuned, clip 1.0", B2_PEERS, "deepspeed-tuned"),
    ("full fine-tune, 8-bit moments", REACH, "24b-8bit"),
    ("LoRA r16 on an NF4 base, beside bitsandbytes' QLoRA", REACH_NF4, "70b-lora16-basenf4"),
    ("LoRA r16 on an int8 base, beside it resident", REACH_INT8, "70b-lora16-baseint8"),
]


def _gb(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _row(what: str, path: str, key: str) -> str:
    with open(os.path.join(HERE, "results", path)) as f:
        result = json.load(f)
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
        peaks = (_gb(peer["gpu_peak_gb"]), _gb(peer["host_rss_peak_gb"]))
    machine = result["machine"]
    return (f"| {SHAPES[ours['shape']]}, {what} | `{ours['mode']}`: {ours['step_s']:.3f} s | {cap} | "
            f"{beside} | {ratios} | {_gb(ours['gpu_peak_gb'])} / {peaks[0]} | "
            f"{_gb(ours['host_rss_peak_gb'])} / {peaks[1]} | "
            f"{result['date'][:10]}, {result['commit']}, {machine.get('gpu') or 'CPU'} "
            f"({machine.get('usable_cpus', '?')}-core host) | [{os.path.basename(path)}](benchmarks/results/{path}) |")


def table() -> str:
    head = ("| recipe | row: median step | GPU cap | beside: median step | time vs beside, each round | "
            "GPU peak GB (row / beside) | host RSS peak GB (row / beside) | date, commit, machine | result |\n"
            "|---|---|---|---|---:|---|---|---|---|")
    return "\n".join([head, *(_row(*r) for r in ROWS)])


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
