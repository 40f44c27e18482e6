"""A steady load on the host, to see what it costs work that never touches host memory on purpose.

`--kernel copy` copies one large tensor into another on N of torch's threads; `--kernel adamw` runs the
engine's own bf16 AdamW kernel over buffers of that size on N threads of its pool, pinned as the engine pins
them: the host steps' load without the engine around it. Until stopped (or for --seconds), it prints the bytes
moved per second. Run beside a GPU-resident training benchmark: if the resident step slows as much as the
engine's does while its host steps run, the slowdown is what that load does to the launching thread (its
memory stalls, a shared core), not the engine's bookkeeping.

    python benchmarks/memory_hog.py --threads 12 --seconds 60 &
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

import offload_ext


def copy_load(threads: int, gib: float) -> tuple[Callable[[], object], int]:
    """(one pass, bytes it moves): a copy of one buffer into another on torch's threads."""
    torch.set_num_threads(threads)
    src = torch.ones(int(gib * (1 << 30)) // 4)
    dst = torch.empty_like(src)
    return (lambda: dst.copy_(src)), 2 * src.numel() * 4  # each copy reads one buffer and writes the other


def adamw_load(threads: int, gib: float) -> tuple[Callable[[], object], int]:
    """(one pass, bytes it moves): the engine's bf16 AdamW step over `gib` of parameters, in its pinned pool."""
    offload_ext.set_num_threads(threads, pin=True)
    n = int(gib * (1 << 30)) // 2
    param, grad, m, v = (torch.full((n,), 1e-3, dtype=torch.bfloat16) for _ in range(4))
    step = offload_ext.adamw_step
    return (lambda: step(param, grad, m, v, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                         step=10)), n * 2 * 7  # reads four bf16 arrays, writes three


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=12)
    ap.add_argument("--gib", type=float, default=1.0, help="size of each buffer (copy: two, adamw: four)")
    ap.add_argument("--seconds", type=float, default=600.0, help="stop after this long")
    ap.add_argument("--kernel", choices=("copy", "adamw"), default="copy")
    a = ap.parse_args()
    if a.threads < 1 or a.gib <= 0 or a.seconds <= 0:
        raise SystemExit("memory_hog: --threads must be >= 1, --gib and --seconds > 0")
    once, moved = (adamw_load if a.kernel == "adamw" else copy_load)(a.threads, a.gib)
    end = time.monotonic() + a.seconds
    t0, n = time.monotonic(), 0
    while time.monotonic() < end:
        once()
        n += 1
        now = time.monotonic()
        if now - t0 >= 1.0:
            print(f"memory_hog: {a.kernel} {n * moved / (now - t0) / 1e9:.1f} GB/s on {a.threads} threads", flush=True)
            t0, n = now, 0


if __name__ == "__main__":
    main()
