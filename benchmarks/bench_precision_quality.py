"""The host precisions' quality, side by side: offload-train's embedded default (its tiny Llama on the standard
library's sources) trained from the same initial weights on the same batches with the same schedule (offload-train's:
linear warm-up, then cosine), once per precision, in a plain loop on the CPU with CPUAdamW in the mode whose rule the
engine shares: mixed (master_weights: fp32 masters and moments), bf16, bf16-sr (stochastic_rounding) and bf16-8bit
(eight_bit: 8-bit moments), and bf16-8bit-sr (8-bit moments, the parameter stored stochastically). Every step's
loss is kept; the table gives the final loss (the mean of the last 100
steps) and the largest gap to mixed's mean over windows of 100 steps; --png draws the curves.

    python benchmarks/bench_precision_quality.py --steps 2000 --png docs/precision_quality.png
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

import _common
import offload_ext
from compare_curves import WINDOW, quality_table, window_means
from offload_ext import CPUAdamW
from offload_ext.train.flags import parse_args, train_config
from offload_ext.train.machine import apply_defaults
from offload_ext.train.model_configs import model_config
from offload_ext.train.tokens import build_stream

MODES = {"mixed": dict(master_weights=True), "bf16": {}, "bf16-sr": dict(stochastic_rounding=True),
         "bf16-8bit": dict(eight_bit=True), "bf16-8bit-sr": dict(eight_bit=True, stochastic_rounding=True)}


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--threads", type=int, default=None, help="torch's intra-op threads (default: torch's choice)")
    ap.add_argument("--png", default=None, metavar="PATH", help="draw the curves into PATH (matplotlib)")
    ap.add_argument("--stem", default="precision_quality")
    a = ap.parse_args()
    unknown = set(a.modes.split(",")) - set(MODES)
    if unknown or a.steps < WINDOW:
        raise SystemExit(f"bench_precision_quality: modes are {', '.join(MODES)} and --steps at least {WINDOW}")
    return a


def train(mode: str, steps: int, out: str) -> list[float]:
    """One run of the embedded default in `mode`: every step's loss."""
    args = parse_args(["--out", out, "--model", "tiny", "--steps", str(steps), "--seed", "0"])
    apply_defaults(args, on_gpu=False)
    stream, _, vocab = build_stream(args)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)  # the same initial weights in every mode
    model = AutoModelForCausalLM.from_config(model_config(args, vocab)).bfloat16()
    config = train_config(args, torch.device("cpu"))
    opt = CPUAdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay, **MODES[mode])
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, config.lr_factor)
    losses = []
    for _ in range(steps):
        loss = offload_ext.causal_lm_loss(model, stream.next_batch())
        loss.backward()
        opt.step()
        opt.zero_grad()
        schedule.step()
        losses.append(float(loss.detach()))
    return losses


def table(curves: dict[str, list[float]]) -> str:
    return quality_table(curves, "mixed" if "mixed" in curves else None, label="precision")


def draw(curves: dict[str, list[float]], path: str) -> None:
    plt = _common.pyplot("bench_precision_quality")
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for mode, losses in curves.items():
        means = window_means(losses)
        ax.plot([WINDOW * (k + 1) for k in range(len(means))], means, label=mode)
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss (mean of {WINDOW} steps)")
    ax.set_title("offload-train's embedded default on the CPU, by host precision")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    a = parse()
    if a.threads:
        torch.set_num_threads(a.threads)
    curves, seconds = {}, {}
    with tempfile.TemporaryDirectory() as out:
        for mode in a.modes.split(","):
            t0 = time.perf_counter()
            curves[mode] = train(mode, a.steps, out)
            seconds[mode] = time.perf_counter() - t0
            print(f"{mode}: loss {curves[mode][0]:.4f} -> {statistics.fmean(curves[mode][-WINDOW:]):.4f} "
                  f"in {seconds[mode]:.0f} s", flush=True)
    markdown = table(curves)
    print(markdown)
    for path in _common.write_results(a.stem, {"args": vars(a), "curves": curves, "seconds": seconds}, markdown):
        print(f"wrote {path}")
    if a.png:
        draw(curves, a.png)
        print(f"wrote {a.png}")


if __name__ == "__main__":
    main()
