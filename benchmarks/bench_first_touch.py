"""How fast this host hands out fresh memory: the first touch of N GB, then the same again after freeing it.

On a freshly booted virtual machine the first touch of guest memory can cost several times what a reuse
does (the hypervisor backs each page on first use); every set-up phase that page-locks or faults in host
buffers pays it once. Run before a timed start to tell the host's cost from the engine's.

    python benchmarks/bench_first_touch.py --gb 64 --rounds 2
"""
from __future__ import annotations

import argparse
import time

import torch

CHUNK = 1 << 30  # a GiB per allocation (its own mapping: returned to the kernel when freed), written by torch's threads


def touch_round(gib: int) -> float:
    """Seconds to allocate and write `gib` GiB of fresh memory."""
    t0 = time.perf_counter()
    blocks = []
    for _ in range(gib):
        b = torch.empty(CHUNK, dtype=torch.uint8)
        b.fill_(1)
        blocks.append(b)
    seconds = time.perf_counter() - t0
    del blocks
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=int, default=64, help="GiB to touch each round")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    for k in range(a.rounds):
        s = touch_round(a.gb)
        print(f"bench_first_touch: round {k + 1}: {a.gb} GiB in {s:.2f} s ({a.gb / s:.1f} GiB/s, "
              f"{torch.get_num_threads()} threads)", flush=True)


if __name__ == "__main__":
    main()
