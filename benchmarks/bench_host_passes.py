"""The engine's host passes alone, per unit: a plain step, a speculative step (clipping), a clipped step and a
redo after the norm (each as its params pass and its moments pass, or whole with --one-pass), and the two
passes of gradient accumulation, on buffers laid out as the native backend lays them out (params and
gradients in the pinned pool, states in the host pool, a unit's buffers one after another).

Each unit is stepped alone (its gradient copied in on the simulated device, then waited for), as during
backward, where one unit lands at a time; the time of a pass is its first slice's start to its last
slice's end on the engine's timeline. `--skew` moves the k-th buffer of a unit k*skew bytes further
into its page, on top of the engine's own starts (since 6127aa0 successive buffers start 576 bytes apart;
before, all on a page boundary, and half the units' speculative steps took 1.8x as long).

    python benchmarks/bench_host_passes.py                         # B1's layer size, 16 units
    python benchmarks/bench_host_passes.py --numel 4e6 --units 4 --skew 0,576
    python benchmarks/bench_host_passes.py --passes scale_step,redo --one-pass   # the steps after the norm whole
    python benchmarks/bench_host_passes.py --precision bf16-8bit --skew 0          # 8-bit moments
    python benchmarks/bench_host_passes.py --prefetch 512:l1,2048:l2,512:l1,2048:l2  # prefetch settings in turns

`--precision bf16-8bit`: the moments as uint8 codes with an absmax per block (the skews move the bf16 buffers).
"""
from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from collections.abc import Callable

import torch

import _common
from offload_ext.engine.backends.base import absmaxes, moments
from offload_ext.engine.backends.native import default_engine_threads, native
from offload_ext.optim.eight_bit import eight_bit_codes

PASSES = ("step", "speculative", "scale_step", "redo", "accumulate_first", "accumulate_step")
# The jobs each pass times, by their names on the timeline (a norm on the host comes with some).
# "speculative" is the step alone, its norm taken on the device as in training without accumulation (before
# 6ff90d0 it timed a host norm pass too: ~1.9 ms of run 31's 8.4 ms per B1 layer).
# A step after the norm runs as a params pass and a moments pass (the engine's default), timed apart.
TIMED = {"step": "step", "speculative": "speculative step", "accumulate_first": "accumulate (first)",
         "accumulate_step": "accumulate + step"}
AFTER_NORM = {"scale_step": "scale + step", "redo": "scale + step from before (redo)"}


def timed(name: str, one_pass: bool) -> list[tuple[str, str]]:
    """(row label, job name prefix on the timeline) of each part a pass is timed in."""
    if name not in AFTER_NORM:
        return [(name, TIMED[name])]
    if one_pass:
        return [(name, AFTER_NORM[name] + " u")]
    return [(f"{name} {part}", f"{AFTER_NORM[name]} ({part}) u") for part in ("params", "moments")]


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=float, default=60_821_504, help="elements per unit (B1's decoder layer)")
    ap.add_argument("--units", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per pass, after --warmup")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--skew", default="0,576", help="comma-separated byte skews per buffer (multiples of 64)")
    ap.add_argument("--state-pool", default="host", help="comma-separated: host (as the backend) and/or pinned")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cuda: gradients copied from the GPU into page-locked buffers, as in training")
    ap.add_argument("--scale", type=float, default=0.5, help="the clipping scale of scale_step and redo")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--passes", default=",".join(PASSES))
    ap.add_argument("--one-pass", action="store_true",
                    help="a step after the norm in one pass (params_first=False) instead of params, then moments")
    ap.add_argument("--precision", choices=("bf16", "bf16-8bit"), default="bf16",
                    help="the units' state: bf16 moments, or 8-bit ones (codes and a per-block absmax)")
    ap.add_argument("--prefetch", default=None,
                    help="comma-separated kernel prefetch settings, each DISTANCE[:LEVEL] (elements; l1, l2 or nta), "
                         "measured in the order given (a setting may repeat); default: the current one")
    ap.add_argument("--stem", default="host_passes")
    return ap.parse_args()


class Units:
    """One engine with `units` units of bf16 params laid out as the native backend does, each bf16 buffer skewed;
    their moments in `precision`'s form."""

    def __init__(self, numel: int, units: int, skew: int, threads: int, speculative: bool, accumulate: bool,
                 state_pool: str, device: str, one_pass: bool, precision: str = "bf16") -> None:
        ext = native()
        self.ext = ext
        self.engine = ext.Engine(0 if device == "cuda" else -1, threads, True, 256 << 20)
        self.engine.set_params_first(not one_pass)
        self.engine.set_slice_elements(1 << 62)  # whole units, as with speculation or accumulation
        self.engine.set_hyper(1e-4, 0.9, 0.95, 1e-8, 0.0, 1, group=0)
        pad = 2048 if skew else 0  # elements: room to start a buffer up to a page past its block
        self._k = 0

        def buf(alloc: Callable[[int, torch.dtype], torch.Tensor]) -> torch.Tensor:
            off = (self._k * skew // 2) % 2048  # elements of 2 bytes past the page boundary
            self._k += 1
            return alloc(numel + pad, torch.bfloat16)[off:off + numel]

        pinned_states = state_pool == "pinned"
        per_unit = 3 + (5 if pinned_states else 0)  # params, grads, second params (+ states, accum)
        self.engine.reserve_pinned_blocks([2 * (numel + pad) + 8192] * (units * per_unit))  # as the backend

        def zeros(n: int, dtype: torch.dtype) -> torch.Tensor:
            return self.engine.pinned_empty(n, dtype).zero_() if pinned_states else self.engine.host_zeros(n, dtype)

        def empty(n: int, dtype: torch.dtype) -> torch.Tensor:
            return (self.engine.pinned_empty if pinned_states else self.engine.host_empty)(n, dtype)

        self.src = torch.randn(numel, generator=torch.Generator().manual_seed(0)).bfloat16().to(device)
        self.grads = []
        for _ in range(units):
            self._k = 0
            params = buf(self.engine.pinned_empty)
            params.copy_(self.src.cpu())
            grads = buf(self.engine.pinned_empty)
            m, v = (buf(zeros), buf(zeros)) if precision == "bf16" else moments(zeros, precision, numel)
            absmax = absmaxes(zeros, precision, numel, None)
            accum = buf(empty) if accumulate else (grads if speculative else None)
            # Second buffers as the backend lays them out: params page-locked (a forward copies from them once
            # swapped), the moments with the states.
            alt = []
            if speculative:
                second = (buf(zeros), buf(zeros)) if precision == "bf16" else moments(zeros, precision, numel)
                alt = [buf(self.engine.pinned_empty), *second, *absmaxes(zeros, precision, numel, None)]
            self.engine.add_unit(params, grads, m, v, accum=accum, alt=alt,
                                 eight_bit=[*absmax, eight_bit_codes()] if absmax else [])
            self.grads.append(grads)

    def run(self, unit: int, job: object) -> None:
        self.engine.copy(self.ext.Direction.D2H, self.grads[unit], self.src, notify_unit=unit, job=job)
        self.engine.wait_unit(unit)


def pass_times(events: list[tuple[str, str, int, int, int]], prefix: str) -> dict[int, float]:
    """Per unit: ms from the start of its first host-step slice whose name starts with `prefix` to its last one's
    end."""
    spans: dict[int, list[int]] = defaultdict(lambda: [1 << 62, 0])
    for lane, name, begin, end, unit in events:
        if lane.startswith("host step") and unit >= 0 and name.startswith(prefix):
            spans[unit][0] = min(spans[unit][0], begin)
            spans[unit][1] = max(spans[unit][1], end)
    return {u: (e - b) / 1e6 for u, (b, e) in spans.items()}


def measure(a: argparse.Namespace, name: str, skew: int, pool: str, threads: int) -> list[dict[str, object]]:
    numel = int(a.numel)
    units = Units(numel, a.units, skew, threads, speculative=name in ("speculative", "scale_step", "redo"),
                  accumulate=name.startswith("accumulate"), state_pool=pool, device=a.device, one_pass=a.one_pass,
                  precision=a.precision)
    jobs = units.ext.Job
    parts = timed(name, a.one_pass)
    per_unit: dict[str, dict[int, list[float]]] = {label: defaultdict(list) for label, _ in parts}
    for step in range(a.warmup + a.steps):
        if name == "accumulate_step":  # the first micro-batch's pass, untimed
            for u in reversed(range(a.units)):
                units.run(u, jobs.ACCUMULATE_FIRST)
        job = {"step": jobs.STEP, "accumulate_first": jobs.ACCUMULATE_FIRST, "accumulate_step": jobs.ACCUMULATE_STEP,
               "speculative": jobs.SPECULATIVE_STEP, "redo": jobs.SPECULATIVE_STEP}.get(name, jobs.NORM)
        units.engine.start_trace()
        for u in reversed(range(a.units)):  # backward's order
            units.run(u, job)
        for u in range(a.units):  # after the norm, the lowest first
            if name == "scale_step":
                units.engine.run(u, jobs.SCALE_STEP, a.scale)
            elif name == "redo":
                units.engine.redo(u, a.scale)
        units.engine.wait_all()
        events = units.engine.stop_trace()
        if step < a.warmup:
            continue
        for label, prefix in parts:
            for u, t in pass_times(events, prefix).items():
                per_unit[label][u].append(t)
    return [summary(label, times, skew, pool, numel, a.units) for label, times in per_unit.items()]


def summary(label: str, per_unit: dict[int, list[float]], skew: int, pool: str, numel: int,
            units: int) -> dict[str, object]:
    med = {u: statistics.median(t) for u, t in sorted(per_unit.items())}
    even = statistics.median(t for u, t in med.items() if u % 2 == 0)
    odd = statistics.median(t for u, t in med.items() if u % 2 == 1) if units > 1 else float("nan")
    return {"pass": label, "skew": skew, "state_pool": pool, "ms_per_unit": med, "median_even_ms": even,
            "median_odd_ms": odd, "ms_per_16M": statistics.median(med.values()) * (1 << 24) / numel}


def prefetch_settings(spec: str | None, distance: int, level: str) -> list[tuple[int, str]]:
    """(distance, level) of each --prefetch setting (a level left out: `level`); (distance, level) without one."""
    if spec is None:
        return [(distance, level)]
    settings = []
    for item in spec.split(","):
        dist, _, lvl = item.partition(":")
        if not dist.isdigit() or lvl not in ("", "l1", "l2", "nta"):
            raise SystemExit(f"--prefetch: expected DISTANCE[:LEVEL] items (level l1, l2 or nta), got {item!r}")
        settings.append((int(dist), lvl or level))
    return settings


def main() -> None:
    a = parse()
    threads = a.threads or default_engine_threads()
    distance, stream_out, level = native().memory_tuning()
    settings = prefetch_settings(a.prefetch, distance, level)
    rows = []
    skews = [int(s) for s in a.skew.split(",")]
    if any(s % 64 for s in skews):
        raise SystemExit(f"--skew: expected multiples of 64 bytes (cache lines), got {a.skew}")
    names, pools = a.passes.split(","), a.state_pool.split(",")
    if not set(names) <= set(PASSES) or not set(pools) <= {"host", "pinned"}:
        raise SystemExit(f"--passes: expected some of {', '.join(PASSES)}; --state-pool: host and/or pinned; "
                         f"got {a.passes!r} and {a.state_pool!r}")
    for pool, skew, name, (dist, level) in ((p, k, n, s) for p in pools for k in skews for n in names
                                            for s in settings):
        native().set_memory_tuning(dist, stream_out, level)
        for row in measure(a, name, skew, pool, threads):
            row["prefetch"] = f"{dist}:{level}"
            print(f"  {row['pass']:20s} {pool:6s} skew {skew:4d} B  prefetch {row['prefetch']:>8s}  even "
                  f"{row['median_even_ms']:6.2f} ms  odd "
                  f"{row['median_odd_ms']:6.2f} ms  per 16M {row['ms_per_16M']:5.2f} ms  "
                  f"units {' '.join(f'{t:.1f}' for t in row['ms_per_unit'].values())}", flush=True)
            rows.append(row)
    md = [f"{a.units} units of {int(a.numel)} elements ({a.precision}), {threads} threads, {a.steps} timed steps, "
          f"device {a.device}, steps after the norm {'in one pass' if a.one_pass else 'params, then moments'}\n",
          "| pass | state pool | skew (B) | prefetch | even units (ms) | odd units (ms) | ms per 16M elements |",
          "|---|---|---:|---|---:|---:|---:|"]
    md += [f"| {r['pass']} | {r['state_pool']} | {r['skew']} | {r['prefetch']} | {r['median_even_ms']:.2f} | "
           f"{r['median_odd_ms']:.2f} | {r['ms_per_16M']:.2f} |" for r in rows]
    for path in _common.write_results(a.stem, {"threads": threads, "numel": int(a.numel), "units": a.units,
                                                 "device": a.device, "one_pass": a.one_pass, "precision": a.precision,
                                                 "rows": rows},
                                      "\n".join(md)):
        print("wrote", path)


if __name__ == "__main__":
    main()
