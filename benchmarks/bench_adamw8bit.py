"""The 8-bit-moment AdamW kernel ("bf16-8bit") beside the bf16 one, A1-style: elements stepped a second over the same
elements with the same threads, median of the timed steps after warm-up.

bf16 keeps exp_avg and exp_avg_sq in bf16 (4 bytes an element of state); bf16-8bit keeps a uint8 code index of each
and an fp32 absmax of each per block of 256 (2.03 bytes), with a bf16 or an fp32 gradient, to nearest or with
stochastic rounding of the param.

    python benchmarks/bench_adamw8bit.py                        # 2^26 elements in 8 tensors, every usable CPU
    python benchmarks/bench_adamw8bit.py --numel 4e6 --threads 2
"""
from __future__ import annotations

import argparse
import os
from typing import Callable

import torch

import _common
import offload_ext
from offload_ext.optim import eight_bit

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01
# Bytes each element moves through host memory a step (reads + writes), the per-block absmax aside.
BYTES = {"bf16": 14, "bf16-8bit": 10, "bf16-8bit fp32 grad": 12}


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=float, default=2**26, help="total elements (default 2^26)")
    ap.add_argument("--tensors", type=int, default=8, help="spans the elements are split into, each stepped by a call")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="kernel threads (default: all usable CPUs)")
    ap.add_argument("--steps", type=int, default=7, help="timed steps (median reported)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--stem", default=None, help="result file name stem (default adamw8bit_<threads>t)")
    return ap.parse_args()


def random_spans(n: int, tensors: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen).to(dtype) for _ in range(tensors)]


def bf16_step(n: int, tensors: int) -> Callable[[], None]:
    p, g = random_spans(n, tensors, torch.bfloat16, 0), random_spans(n, tensors, torch.bfloat16, 1)
    m = random_spans(n, tensors, torch.bfloat16, 2)
    v = [x.abs() * 1e-4 for x in random_spans(n, tensors, torch.bfloat16, 3)]
    state = {"step": 0}

    def run() -> None:
        state["step"] += 1
        for i in range(tensors):
            offload_ext.adamw_step(p[i], g[i], m[i], v[i], lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                                   weight_decay=WD, step=state["step"])
    return run


def eight_bit_step(n: int, tensors: int, grad_dtype: torch.dtype, sr: bool) -> Callable[[], None]:
    p, g = random_spans(n, tensors, torch.bfloat16, 0), random_spans(n, tensors, grad_dtype, 1)
    states = [eight_bit.zero_state(n) for _ in range(tensors)]
    state = {"step": 0}

    def run() -> None:
        state["step"] += 1
        for i in range(tensors):
            eight_bit.adamw8bit_step(p[i], g[i], *states[i], lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                                     weight_decay=WD, step=state["step"], sr_seed=0 if sr else None, sr_stream=i)
    return run


def main() -> None:
    a = parse()
    offload_ext.set_num_threads(a.threads)
    n = max(1, int(a.numel) // a.tensors)
    total = n * a.tensors
    simd = offload_ext.build_info()["simd"]
    print(f"{a.tensors} spans x {n:,} = {total / 1e6:.1f} M elements, {a.threads} threads, SIMD {simd}", flush=True)
    cases = [("native bf16 (bf16 moments)", "bf16", lambda: bf16_step(n, a.tensors)),
             ("native bf16-8bit (bf16 grad)", "bf16-8bit", lambda: eight_bit_step(n, a.tensors, torch.bfloat16, False)),
             ("native bf16-8bit (fp32 grad)", "bf16-8bit fp32 grad",
              lambda: eight_bit_step(n, a.tensors, torch.float32, False)),
             ("native bf16-8bit (bf16 grad, stochastic rounding)", "bf16-8bit",
              lambda: eight_bit_step(n, a.tensors, torch.bfloat16, True))]
    rows = []
    for name, kind, make in cases:
        sec = _common.median_seconds(make(), a.steps, a.warmup)
        row = {"name": name, "kind": kind, "seconds": sec, "elements_per_s": total / sec,
               "gb_per_s": total * BYTES[kind] / sec / 1e9}
        rows.append(row)
        print(f"  {name:52s} {sec:8.4f} s  {row['elements_per_s'] / 1e6:8.1f} M elements/s", flush=True)
    base = rows[0]["seconds"]
    lines = [f"{a.tensors} spans x {n:,} = {total / 1e6:.1f} M elements, {a.threads} threads, SIMD {simd}", "",
             "| implementation | s/step | M elements/s | GB/s | time / bf16's |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['name']} | {r['seconds']:.4f} | {r['elements_per_s'] / 1e6:.1f} | {r['gb_per_s']:.1f} | "
              f"{r['seconds'] / base:.2f}x |" for r in rows]
    payload = {"workload": {"tensors": a.tensors, "elements_per_tensor": n, "total_elements": total,
                            "threads": a.threads, "simd": simd}, "rows": rows}
    _common.publish(a.stem or f"adamw8bit_{a.threads}t", payload, lines)


if __name__ == "__main__":
    main()
