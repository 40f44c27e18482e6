"""CPUAdamW alone (no Offloader) against torch's fused AdamW, on bf16 parameters with fp32 masters.

Both sides run the same recipe per step: bf16 gradients in, fp32 master weights and moments updated,
bf16 parameters written back. torch needs the casts spelled out (grad -> fp32 before its step, master
-> bf16 after); CPUAdamW(master_weights=True) does them inside its one pass. "torch fused (fp32 grad)"
leaves the gradient cast out of torch's time, the most favourable case for torch. Default threads on
both sides: what a user gets without setting any.

    python benchmarks/bench_cpu_adamw.py                   # 32 M params in 8 tensors
    python benchmarks/bench_cpu_adamw.py --params 4e6 --steps 5
"""
from __future__ import annotations

import argparse

import torch

import _common
import offload_ext


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=32e6, help="total parameters")
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--stem", default="cpu_adamw")
    return ap.parse_args()


def make_params(a: argparse.Namespace) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    n = int(a.params) // a.tensors
    params = []
    for _ in range(a.tensors):
        p = torch.nn.Parameter(torch.randn(n, generator=gen).bfloat16())
        p.grad = torch.randn(n, generator=gen).bfloat16()
        params.append(p)
    return params


def time_ours(a: argparse.Namespace) -> float:
    params = make_params(a)
    opt = offload_ext.CPUAdamW(params, lr=1e-4, weight_decay=0.0, master_weights=True)
    return _common.median_seconds(opt.step, a.steps, a.warmup)


def time_torch(a: argparse.Namespace, grad_cast_timed: bool) -> float:
    params = make_params(a)
    masters = [p.detach().float().requires_grad_() for p in params]
    opt = torch.optim.AdamW(masters, lr=1e-4, weight_decay=0.0, fused=True)
    for m, p in zip(masters, params):
        m.grad = p.grad.float()

    def step() -> None:
        if grad_cast_timed:
            for m, p in zip(masters, params):
                m.grad.copy_(p.grad)
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)

    return _common.median_seconds(step, a.steps, a.warmup)


def main() -> None:
    a = parse()
    rows = [("CPUAdamW(master_weights=True)", time_ours(a)),
            ("torch fused AdamW, fp32 master + bf16 casts", time_torch(a, grad_cast_timed=True)),
            ("torch fused AdamW, fp32 master + bf16 param cast (fp32 grad)", time_torch(a, grad_cast_timed=False))]
    ours = rows[0][1]
    n = int(a.params) // a.tensors * a.tensors
    lines = [f"{n / 1e6:.1f} M params in {a.tensors} tensors, bf16 params and grads, fp32 masters and moments; "
             f"CPUAdamW threads {offload_ext.get_num_threads()}, torch threads {torch.get_num_threads()}", "",
             "| implementation | s/step | CPUAdamW speedup (their time / ours) |", "|---|---:|---:|"]
    lines += [f"| {name} | {t:.4f} | {t / ours:.2f}x |" for name, t in rows]
    markdown = "\n".join(lines)
    print(markdown)
    payload = {"args": vars(a), "params": n, "rows": [{"implementation": k, "s_per_step": t} for k, t in rows],
               "cpu_adamw_threads": offload_ext.get_num_threads(), "torch_threads": torch.get_num_threads()}
    for path in _common.write_results(a.stem, payload, markdown):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
