"""Page-locking cost: the engine's PinnedPool (slab size x pre-faulting) against torch's pin_memory.

Each variant runs in a fresh process (the pre-fault switch is read once per process, and freed pinned
memory would otherwise be reused). Default size: what the native backend pins for B1 in bf16
(16 layers of params + a 6-slot gradient ring = 2.7 GB).

    python benchmarks/bench_pin.py [--gb 2.7]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import _common

CHILD = """
import json, sys, time, torch
import offload_ext
kind, gb, slab_mb = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
n = int(gb * 2**30)
torch.cuda.init()
t0 = time.perf_counter()
if kind == "torch":
    t = torch.empty(n, dtype=torch.uint8, pin_memory=True)
else:
    engine = offload_ext.ops.native().Engine(0, 1, False, slab_mb << 20)
    engine.reserve_pinned(n)
print(json.dumps({"seconds": time.perf_counter() - t0}))
"""


def run(kind: str, gb: float, slab_mb: int, prefault: bool) -> float:
    env = dict(os.environ, OFFLOAD_EXT_PREFAULT="1" if prefault else "0")
    out = subprocess.run([sys.executable, "-c", CHILD, kind, str(gb), str(slab_mb)], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["seconds"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=2.7)
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    variants = [("torch pin_memory", "torch", 0, False)]
    variants += [(f"engine, {mb} MB slabs, prefault {'on' if pf else 'off'}", "engine", mb, pf)
                 for mb in (128, 256) for pf in (False, True)]
    rows = []
    for name, kind, mb, pf in variants:
        seconds = min(run(kind, a.gb, mb, pf) for _ in range(a.repeat))
        rows.append({"variant": name, "seconds": seconds, "gb_per_s": a.gb / seconds})
        print(f"  {name:36s} {seconds:.3f} s  {a.gb / seconds:.1f} GB/s", flush=True)
    lines = [f"Page-locking {a.gb} GB (best of {a.repeat}, fresh process each)", "",
             "| variant | s | GB/s |", "|---|---:|---:|"]
    lines += [f"| {r['variant']} | {r['seconds']:.3f} | {r['gb_per_s']:.1f} |" for r in rows]
    _common.publish("pin", {"args": vars(a), "rows": rows}, lines)


if __name__ == "__main__":
    main()
