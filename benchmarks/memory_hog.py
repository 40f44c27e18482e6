"""A steady load on the host's memory bus, to see what it costs work that never touches host memory on purpose.

Copies one large tensor into another on N of torch's threads until stopped (or for --seconds), printing the
bytes moved per second. Run beside a GPU-resident training benchmark: if the resident step slows as much as the
engine's does while its host steps run, the slowdown is the launching thread's memory stalls, not the engine.

    python benchmarks/memory_hog.py --threads 12 --seconds 60 &
"""
from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=12)
    ap.add_argument("--gib", type=float, default=1.0, help="size of each of the two buffers")
    ap.add_argument("--seconds", type=float, default=600.0, help="stop after this long")
    a = ap.parse_args()
    if a.threads < 1 or a.gib <= 0 or a.seconds <= 0:
        raise SystemExit("memory_hog: --threads must be >= 1, --gib and --seconds > 0")
    torch.set_num_threads(a.threads)
    src = torch.ones(int(a.gib * (1 << 30)) // 4)
    dst = torch.empty_like(src)
    moved = 2 * src.numel() * 4  # each copy reads one buffer and writes the other
    end = time.monotonic() + a.seconds
    t0, n = time.monotonic(), 0
    while time.monotonic() < end:
        dst.copy_(src)
        n += 1
        now = time.monotonic()
        if now - t0 >= 1.0:
            print(f"memory_hog: {n * moved / (now - t0) / 1e9:.1f} GB/s on {a.threads} threads", flush=True)
            t0, n = now, 0


if __name__ == "__main__":
    main()
