"""The README's performance table, generated from result files (never typed by hand).

Each row is one mode of one results JSON (`benchmarks/results/<date>_<commit>/*.json`, written by
`_common.write_results`): the step time and its ratio to the strongest GPU-resident row of the same file and
recipe, with the file's date, commit and machine. `--write README.md` replaces the text between the table's
markers; tests/test_readme_table.py checks the README holds exactly what this prints.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BEGIN, END = "<!-- perf-table:begin (benchmarks/readme_table.py) -->", "<!-- perf-table:end -->"

B1_LEAN = "2026-12-04_b4177b1/train_b1_clip_paired.json"  # the newest B1 file with the lean resident baseline
B1 = "2026-12-05_f4b4aa0/train_b1_clip_paired.json"
B2 = "2026-12-04_7725c3f/train_b2.json"
# (what the row is, results file, mode, the resident mode of the same file it is compared with): default settings
# only (no hand-picked layout), so each row is what a user gets.
ROWS = [
    ("Llama-3.2-1B shape", B1_LEAN, "native-bf16", "resident-lean"),
    ("Llama-3.2-1B shape, resident with HF's torch checkpoint", B1, "native-bf16", "resident"),
    ("Llama-3.1-8B shape, max_grad_norm never reached", B2, "native-bf16-clip", "resident-clip"),
    ("Llama-3.1-8B shape, clipping every step", B2, "native-bf16-clipall", "resident-clip"),
]


def _recipe(args: dict) -> str:
    """The run's shape and recipe, from the arguments the results file keeps."""
    cap = f", offloaded GPU capped at {args['gpu_cap_gb']:g} GB" if args.get("gpu_cap_gb") else ""
    return (f"{args['layers']} layers x {args['hidden']}, {args['batch']} x {args['seq']} tokens, "
            f"{args['steps']} timed steps{cap}")


def _gb(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _row(what: str, path: str, mode: str, baseline: str) -> str:
    with open(os.path.join(HERE, "results", path)) as f:
        result = json.load(f)
    rows = {r["mode"]: r for r in result["rows"]}
    ours, ref = rows[mode], rows[baseline]
    machine = result["machine"]
    ratio = ours["step_s"] / ref["step_s"]
    return (f"| {what}: {_recipe(result['args'])} | "
            f"`{mode}` {ours['step_s']:.3f} s, {_gb(ours.get('gpu_peak_gb'))} GB | "
            f"`{baseline}` {ref['step_s']:.3f} s, {_gb(ref.get('gpu_peak_gb'))} GB | {ratio:.3f}x | "
            f"{result['date'][:10]}, {result['commit']}, {machine.get('gpu') or 'CPU'} "
            f"({machine.get('usable_cpus', '?')}-core host) | [{os.path.basename(path)}](benchmarks/results/{path}) |")


def table() -> str:
    head = ("| recipe | offloaded, defaults: step, GPU peak | GPU-resident: step, GPU peak | time vs resident | "
            "date, commit, machine | result |\n|---|---|---|---:|---|---|")
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
