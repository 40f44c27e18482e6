"""What a process pays the first time it uses the GPU, step by step, beside building the model on the meta device.

offload-train's first 8 B process on a freshly booted machine took 24.5 s to its first step where the next took
14.2 (run 66): 7.7 s more in the model phase, 1.9 s more in the first step. This times each one-time cost on its
own, in order: the driver (torch.cuda.init), the context (the first allocation), cuBLAS (a bf16 matmul of the 8 B
shape's MLP), attention (SDPA forward and backward at 4096 tokens), and transformers' import with the 8 B model
built on the meta device. With --overlap the GPU steps run on a thread while the main thread builds the model,
which says whether the two can hide each other (the GPU steps release the GIL inside torch's calls).

    python benchmarks/bench_cuda_start.py            # each step in turn
    python benchmarks/bench_cuda_start.py --overlap  # the GPU steps beside the model build
"""
from __future__ import annotations

import argparse
import threading
import time
from typing import Callable

import torch


def _gpu_steps() -> list[tuple[str, Callable[[], object]]]:
    def matmul() -> object:
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(4096, 14336, device="cuda", dtype=torch.bfloat16)
        return (a @ b).sum().item()

    def attention() -> object:
        q, k, v = (torch.randn(1, 32, 4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()
        return q.grad.sum().item()

    return [("driver", torch.cuda.init), ("context", lambda: torch.empty(1, device="cuda")),
            ("cublas", matmul), ("attention", attention)]


def _model_step() -> None:
    from offload_ext.models.weights import from_config_empty
    from offload_ext.train import cli as train
    from offload_ext.train.model_configs import model_config

    args = train.parse_args(["--model", "llama-8b", "--device", "cuda", "--seq-len", "4096"])
    from_config_empty(model_config(args, 128256))


def _timed(steps: list[tuple[str, Callable[[], object]]], out: dict[str, float]) -> None:
    for name, fn in steps:
        t0 = time.perf_counter()
        fn()
        out[name] = time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--overlap", action="store_true", help="run the GPU steps on a thread beside the model build")
    a = ap.parse_args()
    gpu: dict[str, float] = {}
    model: dict[str, float] = {}
    t0 = time.perf_counter()
    if a.overlap:
        thread = threading.Thread(target=_timed, args=(_gpu_steps(), gpu))
        thread.start()
        _timed([("model", _model_step)], model)
        thread.join()
    else:
        _timed(_gpu_steps(), gpu)
        _timed([("model", _model_step)], model)
    wall = time.perf_counter() - t0
    parts = ", ".join(f"{k} {v:.2f} s" for k, v in {**gpu, **model}.items())
    print(f"bench_cuda_start: {'overlapped' if a.overlap else 'in turn'}: {parts}; wall {wall:.2f} s", flush=True)


if __name__ == "__main__":
    main()
