"""A1: fused CPU AdamW over 973 M parameters in Llama-3.2-1B layer shapes, native vs torch vs DeepSpeed.

Every precision mode of offload_ext's kernel (bf16, bf16-sr, mixed, fp32) against torch's fused AdamW (bf16;
fp32; fp32 with the casts that mixed precision needs) and DeepSpeed's CPUAdam when importable, with a host
memory-bandwidth line measured in the same run. `--scale` shrinks every layer for small machines.

    python benchmarks/bench_adamw.py                 # the full A1 workload
    python benchmarks/bench_adamw.py --scale 0.05    # a 2-core CI-sized machine
    python benchmarks/bench_adamw.py --contention --threads 14   # mixed kernel alone vs under DMA (GPU)
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from typing import Callable

import _common


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="threads for every implementation (default: all usable CPUs)")
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of each layer's parameters (default 1.0)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--steps", type=int, default=7, help="timed steps (median reported)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-deepspeed", action="store_true")
    ap.add_argument("--tune", action="store_true",
                    help="instead of A1: sweep native thread count, prefetch distance and non-temporal output")
    ap.add_argument("--contention", action="store_true",
                    help="only the native mixed kernel, alone and while pinned H2D + D2H copies run (the DMA "
                         "that training adds), side by side")
    ap.add_argument("--stem", default=None, help="result file name stem (default adamw_<threads>t_scale<scale>)")
    return ap.parse_args()


ARGS = _parse()
os.environ.setdefault("OMP_NUM_THREADS", str(ARGS.threads))  # DeepSpeed's CPUAdam threads with OpenMP

import torch  # noqa: E402

import offload_ext  # noqa: E402

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.01


def layer_numel(a: argparse.Namespace) -> int:
    h, kv = a.hidden, a.kv_heads * a.head_dim
    full = 2 * h * h + 2 * h * kv + 3 * h * a.intermediate + 2 * h
    return max(1, int(full * a.scale))


def random_layers(n: int, layers: int, dtype: torch.dtype, positive: bool = False) -> list[torch.Tensor]:
    """`layers` distinct buffers of random values (one random draw, copied: cheap to make)."""
    src = torch.randn(n, generator=torch.Generator().manual_seed(layers + n))
    if positive:
        src = src.abs_().mul_(1e-4)
    src = src.to(dtype)
    return [src.clone() for _ in range(layers)]


def zeros_layers(n: int, layers: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.zeros(n, dtype=dtype) for _ in range(layers)]


# Bytes each parameter moves through host memory per step (reads + writes).
BYTES = {"bf16": 14, "bf16-sr": 14, "mixed": 28, "fp32": 28, "torch_fp32_cast": 34, "torch_fp32_casts": 40}


def native_step(mode: str, n: int, layers: int) -> Callable[[], None]:
    sr_seed = 0 if mode == "bf16-sr" else None
    if mode in ("bf16", "bf16-sr"):
        p, g = random_layers(n, layers, torch.bfloat16), random_layers(n, layers, torch.bfloat16)
        m, v = random_layers(n, layers, torch.bfloat16), random_layers(n, layers, torch.bfloat16, positive=True)
        out = [None] * layers
    else:
        p = random_layers(n, layers, torch.float32)
        g = random_layers(n, layers, torch.bfloat16 if mode == "mixed" else torch.float32)
        m, v = random_layers(n, layers, torch.float32), random_layers(n, layers, torch.float32, positive=True)
        out = zeros_layers(n, layers, torch.bfloat16) if mode == "mixed" else [None] * layers
    state = {"step": 0}

    def run() -> None:
        state["step"] += 1
        for i in range(layers):
            offload_ext.adamw_step(p[i], g[i], m[i], v[i], lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                                   weight_decay=WD, step=state["step"], param_out=out[i], sr_seed=sr_seed, sr_stream=i)
    return run


def torch_step(dtype: torch.dtype, n: int, layers: int, casts: int = 0) -> Callable[[], None]:
    """torch fused AdamW; casts=1 adds the fp32->bf16 param cast, casts=2 also the bf16->fp32 grad cast."""
    params = [torch.nn.Parameter(t) for t in random_layers(n, layers, dtype)]
    for p, g in zip(params, random_layers(n, layers, dtype)):
        p.grad = g
    bf16_grads = random_layers(n, layers, torch.bfloat16) if casts >= 2 else []
    outs = zeros_layers(n, layers, torch.bfloat16) if casts >= 1 else []
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)

    def run() -> None:
        for p, g16 in zip(params, bf16_grads):
            p.grad.copy_(g16)
        opt.step()
        for p, o in zip(params, outs):
            o.copy_(p.detach())
    return run


def deepspeed_step(dtype: torch.dtype, n: int, layers: int) -> Callable[[], None]:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    params = [torch.nn.Parameter(t) for t in random_layers(n, layers, dtype)]
    for p, g in zip(params, random_layers(n, layers, dtype)):
        p.grad = g
    opt = DeepSpeedCPUAdam(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True,
                           fp32_optimizer_states=dtype == torch.float32)
    return opt.step


def tune(n: int, layers: int) -> None:
    """Native bf16 and mixed over threads x prefetch x non-temporal output, one line each."""
    total = n * layers
    rows = []
    max_threads = ARGS.threads
    thread_counts = sorted({max(1, max_threads - 1), max_threads})
    for mode in ("bf16", "mixed"):
        step = native_step(mode, n, layers)
        for threads in thread_counts:
            offload_ext.set_num_threads(threads)
            for prefetch in (0, 512, 1024, 2048):
                for stream_out in (False, True):
                    if mode == "bf16" and stream_out:
                        continue  # bf16 mode has no separate output
                    offload_ext.ops.native().set_memory_tuning(prefetch, stream_out)
                    sec = _common.median_seconds(step, ARGS.steps, ARGS.warmup)
                    row = {"mode": mode, "threads": threads, "prefetch": prefetch, "stream_out": stream_out,
                           "seconds": sec, "gparams_per_s": total / sec / 1e9}
                    rows.append(row)
                    print(f"  {mode:6s} threads {threads:3d} prefetch {prefetch:4d} stream_out {stream_out!s:5s} "
                          f"{sec:.4f} s {row['gparams_per_s']:.2f} Gparam/s", flush=True)
        step = None
    lines = ["| mode | threads | prefetch | stream_out | s/step | Gparam/s |", "|---|---:|---:|---|---:|---:|"]
    lines += [f"| {r['mode']} | {r['threads']} | {r['prefetch']} | {r['stream_out']} | {r['seconds']:.4f} | "
              f"{r['gparams_per_s']:.2f} |" for r in rows]
    for path in _common.write_results(ARGS.stem or f"adamw_tune_{ARGS.threads}t", {"rows": rows}, "\n".join(lines)):
        print(f"wrote {path}")


class CopyLoop:
    """Back-to-back pinned H2D and D2H copies (256 MB each, own streams) on a thread, until exit."""

    def __init__(self, mb: int = 256) -> None:
        n = mb << 20
        self.host = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.dev = [torch.empty(n, dtype=torch.uint8, device="cuda") for _ in range(2)]
        self.streams = [torch.cuda.Stream(), torch.cuda.Stream()]
        self.stop = threading.Event()
        self.bytes = 0
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        while not self.stop.is_set():
            with torch.cuda.stream(self.streams[0]):
                self.dev[0].copy_(self.host[0], non_blocking=True)
            with torch.cuda.stream(self.streams[1]):
                self.host[1].copy_(self.dev[1], non_blocking=True)
            torch.cuda.synchronize()  # releases the GIL while the copies run
            self.bytes += 2 * self.host[0].numel()

    def __enter__(self) -> "CopyLoop":
        self.t0 = time.perf_counter()
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self.gb_per_s = self.bytes / (time.perf_counter() - self.t0) / 1e9


def contention(n: int, layers: int) -> None:
    step = native_step("mixed", n, layers)
    alone = _common.median_seconds(step, ARGS.steps, ARGS.warmup)
    with CopyLoop() as loop:
        busy = _common.median_seconds(step, ARGS.steps, ARGS.warmup)
    rows = [{"case": "alone", "seconds": alone},
            {"case": "with H2D + D2H copies", "seconds": busy, "dma_gb_per_s": loop.gb_per_s}]
    markdown = "\n".join([
        f"Native mixed kernel, {layers} x {n:,} params, {ARGS.threads} threads", "",
        "| case | s/step | vs alone | DMA GB/s |", "|---|---:|---:|---:|",
        f"| alone | {alone:.4f} | 1.00x | 0 |",
        f"| with H2D + D2H copies | {busy:.4f} | {busy / alone:.2f}x | {loop.gb_per_s:.1f} |"])
    print(markdown)
    for path in _common.write_results(ARGS.stem or f"adamw_contention_{ARGS.threads}t", {"rows": rows}, markdown):
        print(f"wrote {path}")


def main() -> None:
    torch.set_num_threads(ARGS.threads)
    offload_ext.set_num_threads(ARGS.threads)
    n, layers = layer_numel(ARGS), ARGS.layers
    total = n * layers
    print(f"A1: {layers} layers x {n:,} params = {total / 1e6:.1f} M params, {ARGS.threads} threads, "
          f"offload_ext {offload_ext.build_info()['simd']}", flush=True)

    if ARGS.tune:
        tune(n, layers)
        return
    if ARGS.contention:
        contention(n, layers)
        return
    rows: list[dict] = []

    def measure(name: str, kind: str, make: Callable[[], Callable[[], None]]) -> None:
        try:
            fn = make()
            sec = _common.median_seconds(fn, ARGS.steps, ARGS.warmup)
        except Exception as exc:  # a peer that cannot run here is reported, not fatal
            print(f"  {name}: unavailable ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})", flush=True)
            rows.append({"name": name, "kind": kind, "error": f"{type(exc).__name__}: {exc}"[:500]})
            return
        finally:
            fn = None
        gps = total / sec / 1e9
        row = {"name": name, "kind": kind, "seconds": sec, "gparams_per_s": gps, "gb_per_s": gps * BYTES[kind]}
        rows.append(row)
        print(f"  {name:44s} {sec:8.4f} s  {gps:6.2f} Gparam/s  {row['gb_per_s']:6.1f} GB/s", flush=True)

    bw = _common.host_copy_gb_s()
    print(f"  host copy bandwidth (torch, read+write)      {bw:6.1f} GB/s", flush=True)
    measure("native bf16", "bf16", lambda: native_step("bf16", n, layers))
    measure("native bf16-sr (stochastic rounding)", "bf16-sr", lambda: native_step("bf16-sr", n, layers))
    measure("native mixed (bf16 grad in, bf16 param out)", "mixed", lambda: native_step("mixed", n, layers))
    measure("native fp32", "fp32", lambda: native_step("fp32", n, layers))
    measure("torch fused bf16", "bf16", lambda: torch_step(torch.bfloat16, n, layers))
    measure("torch fused fp32", "fp32", lambda: torch_step(torch.float32, n, layers))
    measure("torch fused fp32 + bf16 param cast", "torch_fp32_cast",
            lambda: torch_step(torch.float32, n, layers, casts=1))
    measure("torch fused fp32 + grad and param casts", "torch_fp32_casts",
            lambda: torch_step(torch.float32, n, layers, casts=2))
    if not ARGS.no_deepspeed:
        measure("DeepSpeed CPUAdam bf16/bf16", "bf16", lambda: deepspeed_step(torch.bfloat16, n, layers))
        measure("DeepSpeed CPUAdam fp32", "fp32", lambda: deepspeed_step(torch.float32, n, layers))

    by_name = {r["name"]: r for r in rows if "seconds" in r}

    def ratio(ours: str, peer: str) -> float | None:
        if ours in by_name and peer in by_name:
            return by_name[peer]["seconds"] / by_name[ours]["seconds"]
        return None

    comparisons = [
        ("native bf16-sr (stochastic rounding)", "native bf16"),
        ("native bf16", "torch fused bf16"),
        ("native bf16", "DeepSpeed CPUAdam bf16/bf16"),
        ("native mixed (bf16 grad in, bf16 param out)", "torch fused fp32 + bf16 param cast"),
        ("native mixed (bf16 grad in, bf16 param out)", "torch fused fp32 + grad and param casts"),
        ("native mixed (bf16 grad in, bf16 param out)", "DeepSpeed CPUAdam fp32"),
        ("native fp32", "torch fused fp32"),
        ("native fp32", "DeepSpeed CPUAdam fp32"),
    ]
    ratios = [{"ours": a, "peer": b, "speedup": ratio(a, b)} for a, b in comparisons if ratio(a, b) is not None]

    lines = [f"A1: {layers} layers x {n:,} = {total / 1e6:.1f} M params, {ARGS.threads} threads, "
             f"SIMD {offload_ext.build_info()['simd']}; host copy bandwidth {bw:.1f} GB/s (read+write)", "",
             "| implementation | s/step | Gparam/s | GB/s |", "|---|---:|---:|---:|"]
    for r in rows:
        if "seconds" in r:
            lines.append(f"| {r['name']} | {r['seconds']:.4f} | {r['gparams_per_s']:.2f} | {r['gb_per_s']:.1f} |")
        else:
            lines.append(f"| {r['name']} | unavailable: {r['error'][:80]} | | |")
    lines += ["", "| ours | peer | speedup (peer time / ours) |", "|---|---|---:|"]
    lines += [f"| {r['ours']} | {r['peer']} | {r['speedup']:.2f}x |" for r in ratios]
    markdown = "\n".join(lines)
    print("\n" + markdown)
    stem = ARGS.stem or f"adamw_{ARGS.threads}t_scale{ARGS.scale:g}"
    payload = {"workload": {"layers": layers, "params_per_layer": n, "total_params": total, "threads": ARGS.threads,
                            "simd": offload_ext.build_info()["simd"]},
               "host_copy_gb_per_s": bw, "rows": rows, "ratios": ratios}
    for path in _common.write_results(stem, payload, markdown):
        print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
