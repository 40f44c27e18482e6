"""offload-train's training loop: the steps from the start (or the resumed step) to the end or --stop-after,
each step's metrics (jsonl and the progress bar), checkpoints on schedule, and the traces of steps 4-6."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from typing import Any

import numpy as np
import torch

from offload_ext.engine.timeline import Timeline
from offload_ext.planning.memory import process_peak_rss
from offload_ext.planning.report import MemoryPlan
from offload_ext.train import interrupt, prior_run, run_dir
from offload_ext.train.checkpoint_manifest import checkpoint_bytes
from offload_ext.train.trainer import Trainer
from offload_ext.train.watch import Watch


def dist_rank() -> int:
    """This process's rank (0 outside a process group): rank 0 alone writes metrics and prints."""
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def seconds_since_process_start() -> float:
    """How long this process has run, from Linux's /proc (its start in clock ticks since boot, against the
    uptime); 0.0 where /proc does not say, so that timings then count from the caller instead."""
    try:
        with open("/proc/self/stat") as f:
            after_name = f.read().rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(after_name[19]) / os.sysconf("SC_CLK_TCK"))  # field 22: starttime
    except (OSError, ValueError, IndexError):
        return 0.0


def print_setup(marks: list[tuple[str, float]], trainer: Trainer) -> None:
    if dist_rank() != 0:
        return
    phases = [f"{name} {t - marks[k][1]:.1f} s" for k, (name, t) in enumerate(marks[1:])]
    if trainer.off is not None:
        phases[-1] += " (" + ", ".join(f"{k} {v:.1f} s" for k, v in trainer.off.setup_seconds.items()) + ")"
    print(f"offload-train: set-up {marks[-1][1] - marks[0][1]:.1f} s: " + ", ".join(phases), flush=True)


def train_loop(args, trainer, stream, tokenizer, start, metrics_path, tokens_per_step, on_gpu,
               began: float, memory: MemoryPlan | None = None) -> dict[str, Any]:
    from tqdm import tqdm

    profiler = torch_profiler(args) if args.trace else None
    timeline = contextlib.ExitStack()  # the engine's timeline over the profiler's active steps
    traced: list[Timeline] = []
    losses, rates = [], []
    end = args.steps if args.stop_after is None else min(args.steps, start + args.stop_after)
    lead = dist_rank() == 0
    bar = tqdm(range(start, end), initial=start, total=args.steps, desc="offload-train",
               disable=os.environ.get("OFFLOAD_TRAIN_NO_BAR") == "1" or not lead)
    saved = None
    if lead and start > 0 and start < end:  # resumed: the checkpoint it resumed from tells the size of the next
        _warn_if_no_room(args, checkpoint_bytes(prior_run.complete_checkpoints(args.out)[-1][1]), start + 1, end)
    watch = Watch(args.out, args.report_to, lead)
    with open(metrics_path, "a") if lead else contextlib.nullcontext() as metrics:
        for k, step in enumerate(bar):
            if args.trace and trainer.off is not None and k == _TRACED[0]:
                traced.append(timeline.enter_context(trainer.off.trace()))
            lr = trainer.lr
            t0 = time.perf_counter()
            phases: dict[str, float] | None = {} if k == 0 else None  # the first step's warm-up, by phase
            loss = trainer.train_step(stream, phases)
            if on_gpu:
                # The compute stream, not the device: the engine's clipped redos on the device copy their results
                # back on side streams during the next forward; waiting for them here would serialize them.
                torch.cuda.current_stream().synchronize()
            rate = tokens_per_step / (time.perf_counter() - t0)
            # a fresh run's first save, judged after its first step (the single-device trainer estimates it)
            if k == 0 and lead and start == 0 and hasattr(trainer, "checkpoint_estimate"):
                _warn_if_no_room(args, trainer.checkpoint_estimate(), step + 1, end, about=True)
            if phases is not None and lead:
                print(f"offload-train: first step {tokens_per_step / rate:.1f} s, "
                      + ", ".join(f"{name} {v:.2f} s" for name, v in phases.items())
                      + f"; done {time.perf_counter() - began:.1f} s after the process started", flush=True)
            mem = torch.cuda.max_memory_allocated() / 1e9 if on_gpu else 0.0
            losses.append(loss)
            rates.append(rate)
            if profiler is not None:
                profiler.step()
            if k == _TRACED[-1]:
                timeline.close()
                _write_timeline(traced, args.out)
            if lead and (step + 1) % args.log_every == 0:
                row = {"step": step + 1, "loss": loss, "lr": lr, "tokens_per_s": rate, "gpu_mem_gb": mem,
                       "elapsed_s": time.perf_counter() - began}
                if trainer.last_grad_norm is not None:
                    row["grad_norm"] = trainer.last_grad_norm
                if trainer.last_clip_action is not None:
                    row["clip"] = trainer.last_clip_action
                if trainer.off is not None:
                    row["kept_layers"] = trainer.off.kept_layers  # layers per stack run without recompute
                    tuning = trainer.off.redo_tuning
                    if tuning is not None and (len(tuning.candidates) > 1 or tuning.layers):
                        row["device_redo_layers"] = tuning.layers  # top layers a stack redone on the device
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()
                watch.log(row)
                run_dir.boundary("metrics", step + 1)
            if lead:
                _tell_redo_choice(trainer)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{rate:,.0f}", mem_gb=f"{mem:.1f}")
            if args.save_every and (step + 1) % args.save_every == 0:
                saved = trainer.save(step + 1, stream, tokenizer)
                run_dir.boundary("saved", step + 1)
                if lead:
                    _warn_if_no_room(args, checkpoint_bytes(saved), step + 2, end)
                watch.draw()
            interrupt.raise_if_pressed()
    timeline.close()
    if profiler is not None:
        profiler.stop()
    _write_timeline(traced, args.out)
    if end > start and not (args.save_every and end % args.save_every == 0):  # not saved by the loop already
        saved = trainer.save(end, stream, tokenizer)
    elif saved is None:  # a resume with no step left: its checkpoint stays the run's last
        saved = prior_run.complete_checkpoints(args.out)[-1][1]
    watch.draw()
    watch.close()
    steady = rates[min(3, len(rates) - 1):] if rates else [0.0]
    summary = {"steps": end, "first_loss": losses[0] if losses else None,
               "final_loss": losses[-1] if losses else None, "tokens_per_s": float(np.median(steady)),
               "gpu_peak_gb": torch.cuda.max_memory_allocated() / 1e9 if on_gpu else 0.0,
               "host_rss_peak_gb": process_peak_rss() / 1e9, "out": args.out, **_planned(memory, on_gpu)}
    if lead:
        print(f"offload-train: done {summary['steps']} steps, loss {summary['first_loss']} -> {summary['final_loss']}, "
              f"{summary['tokens_per_s']:,.0f} tok/s (median), {_peaks(summary, on_gpu)}, checkpoint in {saved}",
              flush=True)
    return summary


def _warn_if_no_room(args: argparse.Namespace, size: int | None, earliest: int, end: int,
                     about: bool = False) -> None:
    """Said as soon as it is known, a save interval ahead: the run's next save at step `earliest` or after (up to
    `end`) will not fit in --out's free space, a checkpoint taking `size` bytes (`about` that: an estimate)."""
    if earliest > end or size is None:
        return
    step = min(-(-earliest // args.save_every) * args.save_every, end) if args.save_every else end
    warning = run_dir.room_warning(args.out, size, step, about)
    if warning is not None:
        print(warning, file=sys.stderr, flush=True)


def _planned(memory: MemoryPlan | None, on_gpu: bool) -> dict[str, float]:
    """The memory plan's expected peaks, beside which the run's own are reported (none without a plan; the GPU's
    only on one: the simulated device's memory is the host's, in its RSS)."""
    if memory is None:
        return {}
    gpu = {"planned_gpu_peak_gb": memory.gpu_peak / 1e9} if on_gpu else {}
    return {"planned_host_rss_peak_gb": memory.host_peak_rss / 1e9, **gpu}


def _peaks(summary: dict[str, Any], on_gpu: bool) -> str:
    """"GPU peak A GB (planned B), host RSS peak C GB (planned D)": a plan far from its run is seen at once."""
    def one(what: str, key: str) -> str:
        planned = summary.get(f"planned_{key}")
        return f"{what} {summary[key]:.2f} GB" + ("" if planned is None else f" (planned {planned:.2f})")
    host = one("host RSS peak", "host_rss_peak_gb")
    return f"{one('GPU peak', 'gpu_peak_gb')}, {host}" if on_gpu else host


def _tell_redo_choice(trainer: Trainer) -> None:
    """Print, when it is made, how many layers of each stack the device redoes clipped steps of, as measured, and
    the flag that fixes it."""
    tuning = trainer.off.redo_tuning if trainer.off is not None else None
    news = tuning.news() if tuning is not None else None
    if news is not None:
        print(f"offload-train: device redo of clipped steps: {news}; --tuning device_redo_layers={tuning.chosen} "
              "fixes it", flush=True)


_TRACED = (3, 4, 5)  # steps of this invocation that --trace records (0-based): the profiler's active ones


def _write_timeline(traced: list[Timeline], out: str) -> None:
    """timeline.json, with the GPU streams of the profiler's trace.json merged in when it has been written
    (the profiler's active steps are the timeline's)."""
    if not traced:
        return
    timeline = traced.pop()
    profile = os.path.join(out, "trace.json")
    if os.path.exists(profile):
        timeline.add_profile(profile)
    timeline.write(os.path.join(out, "timeline.json"))


def torch_profiler(args: argparse.Namespace):
    from torch.profiler import ProfilerActivity, profile, schedule

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if not cuda and "KINETO_LOG_LEVEL" not in os.environ:
        # Kineto asks for GPUs even when only CPU activity is recorded, and prints "ERROR ... gpuGetDeviceCount
        # failed" where there are none; level 5 keeps its log quiet (it reads the variable when it starts).
        os.environ["KINETO_LOG_LEVEL"] = "5"
    trace = os.path.join(args.out, "trace.json")
    p = profile(activities=activities, schedule=schedule(wait=2, warmup=1, active=3, repeat=1),
                on_trace_ready=lambda prof: prof.export_chrome_trace(trace))
    p.start()
    return p
