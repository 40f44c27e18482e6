"""offload-train: train a causal LM with CPU offload (or without, for comparison) on one device, or with
--fsdp under torchrun on several (offload_ext.train.fsdp_trainer).

With no arguments it runs an embedded default that needs no download: a small Llama config (tiny on a
CPU), the Python standard library's own sources as text, and a BPE tokenizer trained on them in seconds.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shlex
import shutil
import sys
import time
from typing import Any, NoReturn

import numpy as np
import torch

from offload_ext.engine.timeline import Timeline
from offload_ext.models.lora import add_lora
from offload_ext.models.losses import BACKENDS
from offload_ext.models.weights import from_config_empty
from offload_ext.planning.plan import MemoryPlan, plan
from offload_ext.train import data as data_mod
from offload_ext.train import run_dir
from offload_ext.train.gpu_warmup import GpuWarmup
from offload_ext.train.inputs import check_inputs, check_numbers
from offload_ext.train.setup import (
    BUILTIN,
    UsageError,
    apply_defaults,
    build_model,
    build_stream,
    check_loss_args,
    check_loss_chunk,
    model_config,
    planned_vocab,
    resolve_device,
)
from offload_ext.train.trainer import Trainer, offloader_kwargs, run_flags


def _checkpointing(value: str) -> str | int:
    """--activation-checkpointing's value: a name, or a number of layers."""
    return int(value) if value.isdigit() else value


class _Parser(argparse.ArgumentParser):
    """argparse's errors as offload-train's: one line and exit status 2, without the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (offload-train --help lists the options)\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, each numeric flag in its range (a UsageError otherwise)."""
    ap = _Parser(prog="offload-train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="auto",
                    help=f"built-in config ({', '.join(BUILTIN)}; auto = small on a GPU, tiny on a CPU), "
                         "a local directory, or a hub id")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--from-scratch", dest="pretrained", action="store_false",
                   help="random init from the model's config (default for built-in configs and a directory "
                        "without weights)")
    g.add_argument("--pretrained", dest="pretrained", action="store_true",
                   help="load the model's weights (default for a directory with weights, or a hub id)")
    ap.set_defaults(pretrained=None)
    ap.add_argument("--dataset", default=data_mod.EMBEDDED,
                    help="'stdlib' (embedded), a datasets hub id, a local dataset directory or a data file")
    ap.add_argument("--text-field", default="text")
    ap.add_argument("--split", default="train")
    ap.add_argument("--streaming", action="store_true")
    ap.add_argument("--tokenizer", default=None, help="HF tokenizer (hub id, directory or tokenizer.json file); "
                                                      "default: the model's, or one trained on the embedded corpus")
    ap.add_argument("--batch-size", type=int, default=None, help="default 8 on a GPU, 4 on a CPU")
    ap.add_argument("--seq-len", type=int, default=None, help="default 512 on a GPU, 64 on a CPU")
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--resident-layers", type=int, default=0,
                    help="keep the lowest N layers of each stack on the GPU, stepped there (offload)")
    ap.add_argument("--device-layers", type=int, default=2,
                    help="layer buffers on the GPU per stack (offload): with one per layer the weights stay there "
                         "between a step's micro-batches instead of streaming twice in each")
    ap.add_argument("--accumulate-on", choices=("auto", "device", "host"), default="auto",
                    help="where --grad-accum's micro-batches are summed (offload): on the GPU, one gradient copy "
                         "per layer and step, or on the host; auto: the GPU when the sums fit a quarter of its "
                         "free memory")
    ap.add_argument("--steps", type=int, default=None, help="default 200 on a GPU, 60 on a CPU")
    ap.add_argument("--lr", type=float, default=None,
                    help="peak learning rate (default 3e-3 for tiny and small, 3e-4 for every larger model)")
    ap.add_argument("--warmup-steps", type=int, default=None, help="linear warm-up, then cosine decay to 10%%")
    ap.add_argument("--weight-decay", type=float, default=0.0,
                    help="decoupled weight decay of every parameter --no-decay does not name")
    ap.add_argument("--no-decay", default="bias,norm",
                    help="comma-separated name parts: parameters whose name or module class contains one get no "
                         "weight decay (HF Trainer's rule: biases and norm weights); '' decays all")
    ap.add_argument("--lora-r", type=int, default=None,
                    help="train rank-R LoRA adapters (peft) instead of the whole model; the checkpoint is the adapter")
    ap.add_argument("--lora-alpha", type=float, default=None, help="LoRA scale numerator (default 2 x --lora-r)")
    ap.add_argument("--lora-targets", default="q_proj,v_proj", help="comma-separated module names to adapt")
    ap.add_argument("--max-grad-norm", type=float, default=None,
                    help="clip by the global gradient norm (native offload: host steps run speculatively during "
                         "backward and are redone exactly when the norm clips; metrics log 'clip')")
    ap.add_argument("--backend", choices=["none", "python", "native"], default=None,
                    help="none = no offload (the model and optimizer on the device); default native, or none where "
                         "it trains on the CPU (no CUDA device, or --device cpu)")
    ap.add_argument("--precision", choices=["bf16", "bf16-sr", "mixed"], default="bf16",
                    help="bf16 params and moments; bf16-sr: the same, params and exp_avg_sq stored by stochastic "
                         "rounding (seeded by --seed); mixed: fp32 masters and moments on the host")
    ap.add_argument("--offload-all", action="store_true",
                    help="also keep the embeddings, final norm and head's grads and optimizer state on the host")
    ap.add_argument("--device", default="auto", help="cuda, cuda:N, cpu, or cpu-sim (offload engine on the "
                                                     "simulated device); auto = cuda if available, else cpu")
    ap.add_argument("--activation-checkpointing", default="all", type=_checkpointing, metavar="all|none|auto|N",
                    help="all: every layer recomputes in backward; none: none does; N: the lowest N of each stack do "
                         "(offload keeps the rest's saved tensors); auto (offload): as many top layers kept as "
                         "--gpu-memory-budget holds, measured in the first step")
    ap.add_argument("--no-activation-checkpointing", dest="activation_checkpointing", action="store_const",
                    const="none", help="the same as --activation-checkpointing none")
    ap.add_argument("--activation-offload", action="store_true",
                    help="offload: the input each checkpointed layer keeps waits in host memory until its backward")
    ap.add_argument("--gpu-memory-budget", default=None, metavar="SIZE",
                    help="--activation-checkpointing auto: the GPU peak it may reach (e.g. 20GB; default what the "
                         "process may allocate, less 5 %% and 1 GiB; needed with --device cpu-sim)")
    ap.add_argument("--compile", action="store_true", help="torch.compile each layer")
    ap.add_argument("--loss-backend", choices=BACKENDS, default="auto",
                    help="cross-entropy of the loss: the extension's kernels (native), torch's, or auto "
                         "(native on CUDA)")
    ap.add_argument("--loss-chunk-tokens", type=int, default=4096,
                    help="tokens per chunk of the vocabulary projection (GPU memory for logits vs speed)")
    ap.add_argument("--dry-run", action="store_true",
                    help="print this run's memory plan (host RAM pinned and pageable, GPU memory, the largest batch x "
                         "seq that fits) from the model built on the meta device, and exit: 0 if it fits, 2 if not")
    ap.add_argument("--gpu-memory", default=None,
                    help="with --dry-run: plan for a GPU of this size (e.g. 80GB, 139GiB), all of it free; needed for "
                         "--device cuda where there is no GPU")
    ap.add_argument("--host-memory", default=None,
                    help="with --dry-run: plan for a host of this size (e.g. 125GB), all of it available")
    ap.add_argument("--fsdp", action="store_true",
                    help="under torchrun: FSDP2 over the ranks (CPU offload on GPUs), CPUAdamW stepping each shard in "
                         "backward, each rank its own batches, checkpoints gathered on rank 0")
    ap.add_argument("--out", default="runs/offload-train")
    ap.add_argument("--resume", nargs="?", const="latest", default=None, metavar="CHECKPOINT",
                    help="continue the run in --out from its newest complete checkpoint, verified against its "
                         "manifest (a torn one is refused), or from the step directory given (e.g. the previous "
                         "one, --out/checkpoints/step-000010); the flags that shape the run (model, batch, "
                         "layout, precision, schedule: --steps too, which the cosine schedule spans) must be the "
                         "checkpoint's")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace the run --out already holds (its metrics and checkpoints); without it or "
                         "--resume, such an --out is refused")
    ap.add_argument("--save-every", type=int, default=0,
                    help="checkpoint every N steps (always at the end), each into --out/checkpoints/step-N/ "
                         "(from_pretrained loads it; --out/latest points at the newest complete one)")
    ap.add_argument("--keep-checkpoints", type=int, default=2,
                    help="complete checkpoints kept; older ones are deleted once a newer one is whole")
    ap.add_argument("--stop-after", type=int, default=None,
                    help="stop (with a checkpoint) after this many steps of this invocation; the lr schedule "
                         "still spans --steps, and --resume continues (for preemptible jobs)")
    ap.add_argument("--log-every", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace", action="store_true",
                    help="write a torch.profiler trace (trace.json) and, with offload, the engine's timeline "
                         "(timeline.json; benchmarks/plot_timeline.py draws it) of steps 4-6 to --out")
    ap.add_argument("--debug", action="store_true", help="show the traceback of an error on the inputs")
    args = ap.parse_args(argv)
    check_numbers(args)
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.dry_run:
        return {"plan": dry_run(args)}
    if args.gpu_memory is not None or args.host_memory is not None:
        raise UsageError("--gpu-memory and --host-memory describe the machine a plan is for: use them with --dry-run")
    entered = time.perf_counter()
    began = entered - seconds_since_process_start()  # metrics' elapsed_s: the interpreter and set-up count
    _check_out(args)
    device, simulated = resolve_device(args)
    if args.fsdp:
        return _run_fsdp(args, device, simulated, began, entered)
    on_gpu = device.type == "cuda"  # args.backend resolved by resolve_device: none on the CPU unless simulated
    apply_defaults(args, on_gpu)
    check_loss_args(args, device)
    resume_from = _resume_point(args)
    if args.backend == "native":
        from offload_ext import _ext

        if not _ext.available():
            raise UsageError(f"--backend native: the native extension is not available ({_ext.error()}); "
                             "reinstall with `pip install --no-build-isolation .`, or use --backend python")
    os.makedirs(args.out, exist_ok=True)
    # The GPU's libraries load on a thread while the data and the model are prepared (both hold the GIL).
    warmup = GpuWarmup(device, args.seq_len) if on_gpu else None
    # One phase after another: tokenizing the corpus on a thread while the engine page-locked its buffers made
    # both slower (8 B: data 9.0 s, page-locking 17.1 s, against 2.5 and 6.1 alone; run 53).
    marks, stream, tokenizer, vocab = _seed_and_data(args, began, entered)
    model, weights = build_model(args, vocab, device)
    if warmup is not None:
        warmup.join()  # before the memory plan measures the GPU's free memory
    marks.append(("model", time.perf_counter()))
    model = _with_lora(args, model)
    if args.backend != "none" and (on_gpu or simulated):  # the whole memory check, activations included
        memory = _plan(args, model, device)
        if not memory.fits:
            raise UsageError(memory.refusal())
    try:
        trainer = Trainer(args, model, device, simulated, weights)
    except MemoryError as exc:  # the Offloader's check, before anything was allocated: it names the options
        raise UsageError(str(exc)) from exc
    marks.append(("engine", time.perf_counter()))
    _print_setup(marks, trainer)
    start = trainer.load(stream, resume_from) if resume_from is not None else 0
    metrics_path = os.path.join(args.out, run_dir.METRICS)
    if resume_from is not None:
        run_dir.trim_metrics(args.out, start)  # the steps after the checkpoint are trained (and logged) again
    else:
        run_dir.remove_run(args.out)  # --overwrite's (_check_out refused an --out holding a run without it)
    tokens_per_step = args.batch_size * args.seq_len * args.grad_accum
    return _loop(args, trainer, stream, tokenizer, start, metrics_path, tokens_per_step, on_gpu, began)


def _check_out(args: argparse.Namespace) -> None:
    """Refuse, before anything is allocated or written, an --out that holds a run unless --resume or
    --overwrite says what to do with it, and a --resume with nothing to continue."""
    if args.resume is not None and args.overwrite:
        raise UsageError("--resume and --overwrite contradict each other: --resume continues the run in --out, "
                         "--overwrite replaces it; pass one")
    held = run_dir.existing_run(args.out)
    if held is not None and args.resume is None and not args.overwrite:
        raise UsageError(f"--out {args.out} already holds a run ({held}): continue it with --resume, or replace "
                         "it with --overwrite (or pick another --out)")


def _resume_point(args: argparse.Namespace) -> run_dir.Checkpoint | None:
    """The verified checkpoint --resume continues from (None without --resume), its flags checked against
    this run's: before the model or the engine is built."""
    if args.resume is None:
        return None
    try:
        ckpt = run_dir.find(args.out, args.resume)
        run_dir.check_flags(ckpt, run_flags(args))
    except run_dir.CheckpointError as exc:
        raise UsageError(str(exc)) from exc
    return ckpt


def _seed_and_data(args: argparse.Namespace, began: float,
                   entered: float) -> tuple[list[tuple[str, float]], data_mod.TokenStream, Any, int]:
    """Seed Python's and numpy's RNGs, build the token stream; the set-up's phase marks so far. The phases are
    printed once (issue 12's "first step within N s"), from the process's start: the interpreter and the
    imports before run() (torch's among them) are the first."""
    random.seed(args.seed)
    np.random.seed(args.seed)
    marks = [("start", began), ("imports", entered)]
    try:
        stream, tokenizer, vocab = build_stream(args)
    except ValueError as exc:  # bad data arguments: the message names the flag and the fix
        raise UsageError(str(exc)) from exc
    marks.append(("data", time.perf_counter()))
    return marks, stream, tokenizer, vocab


def _run_fsdp(args: argparse.Namespace, device: torch.device, simulated: bool, began: float,
              entered: float) -> dict[str, Any]:
    """offload-train --fsdp: the same data, schedule, metrics and checkpoints, over FSDP2's ranks."""
    from offload_ext.train.fsdp_trainer import FsdpTrainer, check_fsdp_args, init_process_group, rank_device

    if simulated or args.backend != "native":
        raise UsageError("--fsdp shards with FSDP2 and steps with CPUAdamW: drop --backend and --device cpu-sim "
                         "(use --device cpu for gloo ranks on the CPU)")
    check_fsdp_args(args)
    init_process_group(device)
    device = rank_device(device)
    on_gpu = device.type == "cuda"
    apply_defaults(args, on_gpu)
    check_loss_args(args, device)
    if dist_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
    marks, stream, tokenizer, vocab = _seed_and_data(args, began, entered)
    model, weights = build_model(args, vocab, device)  # on the meta device, with the weights to fill it from
    marks.append(("model", time.perf_counter()))
    trainer = FsdpTrainer(args, model, weights, device)
    marks.append(("engine", time.perf_counter()))
    _print_setup(marks, trainer)
    start = trainer.load(stream) if args.resume else 0
    metrics_path = os.path.join(args.out, "metrics.jsonl")
    if dist_rank() == 0 and not args.resume and os.path.exists(metrics_path):
        os.remove(metrics_path)
    world = torch.distributed.get_world_size()
    summary = _loop(args, trainer, stream, tokenizer, start, metrics_path,
                    args.batch_size * args.seq_len * args.grad_accum * world, on_gpu, began)
    torch.distributed.destroy_process_group()
    return summary


def dist_rank() -> int:
    """This process's rank (0 outside a process group): rank 0 alone writes metrics and prints."""
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _with_lora(args: argparse.Namespace, model: torch.nn.Module) -> torch.nn.Module:
    """The model with --lora-r adapters (and --seq-len checked against its positions)."""
    if args.lora_r is not None:
        if args.lora_r < 1:
            raise UsageError(f"--lora-r must be at least 1, got {args.lora_r}")
        try:
            model = add_lora(model, args.lora_r, args.lora_alpha or 2 * args.lora_r, args.lora_targets.split(","))
        except (ImportError, ValueError) as exc:
            raise UsageError(f"--lora-r: {exc}") from exc
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if max_pos is not None and args.seq_len > max_pos:
        raise UsageError(f"--seq-len {args.seq_len} is above the model's maximum of {max_pos} positions")
    return model


def _plan(args: argparse.Namespace, model: torch.nn.Module, device: torch.device) -> MemoryPlan:
    try:
        return plan(model, **offloader_kwargs(args, device), batch_size=args.batch_size, seq_len=args.seq_len,
                    loss_chunk_tokens=args.loss_chunk_tokens, loss_backend=args.loss_backend,
                    gpu_memory=args.gpu_memory, host_memory=args.host_memory)
    except ValueError as exc:  # a bad size or setting: the message names it
        raise UsageError(str(exc)) from exc


def _planned_device(args: argparse.Namespace) -> torch.device:
    """The device a dry run plans for: a CUDA one even where there is none (its size from --gpu-memory)."""
    if args.device == "cpu-sim":
        return torch.device("cpu")
    if args.device == "cpu":
        raise UsageError("--dry-run plans the offload engine: --device cpu trains without it; use cpu-sim or cuda")
    if args.device == "auto" and not torch.cuda.is_available() and args.gpu_memory is None:
        raise UsageError("--dry-run: no CUDA device here; pass --device cuda --gpu-memory SIZE to plan for one, "
                         "or --device cpu-sim")
    dev = torch.device("cuda" if args.device == "auto" else args.device)
    if dev.type == "cuda" and not torch.cuda.is_available() and args.gpu_memory is None:
        raise UsageError(f"--dry-run --device {args.device}: there is no CUDA device here to measure; pass "
                         "--gpu-memory SIZE (e.g. 80GB, 139GiB) for the GPU to plan for")
    return dev


def dry_run(args: argparse.Namespace) -> MemoryPlan:
    """Print the run's memory plan, the model built on the meta device (no weights drawn or read, no data, no
    engine); a plan that does not fit raises UsageError with its refusal."""
    if args.backend == "none":
        raise UsageError("--dry-run plans the offload engine's memory: use --backend native or python")
    args.backend = args.backend or "native"
    device = _planned_device(args)
    apply_defaults(args, device.type == "cuda")
    check_loss_chunk(args)
    model, _ = from_config_empty(model_config(args, planned_vocab(args)), seed=args.seed)
    memory = _plan(args, _with_lora(args, model), device)
    print(memory, flush=True)
    if not memory.fits:
        raise UsageError(memory.refusal())
    return memory


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


def _print_setup(marks: list[tuple[str, float]], trainer: Trainer) -> None:
    if dist_rank() != 0:
        return
    phases = [f"{name} {t - marks[k][1]:.1f} s" for k, (name, t) in enumerate(marks[1:])]
    if trainer.off is not None:
        phases[-1] += " (" + ", ".join(f"{k} {v:.1f} s" for k, v in trainer.off.setup_seconds.items()) + ")"
    print(f"offload-train: set-up {marks[-1][1] - marks[0][1]:.1f} s: " + ", ".join(phases), flush=True)


def _loop(args, trainer, stream, tokenizer, start, metrics_path, tokens_per_step, on_gpu,
          began: float) -> dict[str, Any]:
    from tqdm import tqdm

    profiler = _profiler(args) if args.trace else None
    timeline = contextlib.ExitStack()  # the engine's timeline over the profiler's active steps
    traced: list[Timeline] = []
    losses, rates = [], []
    end = args.steps if args.stop_after is None else min(args.steps, start + args.stop_after)
    lead = dist_rank() == 0
    bar = tqdm(range(start, end), initial=start, total=args.steps, desc="offload-train",
               disable=os.environ.get("OFFLOAD_TRAIN_NO_BAR") == "1" or not lead)
    saved = None
    with open(metrics_path, "a") if lead else contextlib.nullcontext() as metrics:
        for k, step in enumerate(bar):
            if args.trace and trainer.off is not None and k == _TRACED[0]:
                traced.append(timeline.enter_context(trainer.off.trace()))
            lr = trainer.lr
            t0 = time.perf_counter()
            phases: dict[str, float] | None = {} if k == 0 else None  # the first step's warm-up, by phase
            loss = trainer.train_step(stream, phases)
            if on_gpu:
                torch.cuda.synchronize()
            rate = tokens_per_step / (time.perf_counter() - t0)
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
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()
                run_dir.boundary("metrics", step + 1)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{rate:,.0f}", mem_gb=f"{mem:.1f}")
            if args.save_every and (step + 1) % args.save_every == 0:
                saved = trainer.save(step + 1, stream, tokenizer)
                run_dir.boundary("saved", step + 1)
    timeline.close()
    if profiler is not None:
        profiler.stop()
    _write_timeline(traced, args.out)
    if end > start and not (args.save_every and end % args.save_every == 0):  # not saved by the loop already
        saved = trainer.save(end, stream, tokenizer)
    elif saved is None:  # a resume with no step left: its checkpoint stays the run's last
        complete = run_dir.complete_checkpoints(args.out)
        saved = complete[-1][1] if complete else os.path.join(args.out, run_dir.LEGACY)  # --fsdp's, in place
    steady = rates[min(3, len(rates) - 1):] if rates else [0.0]
    summary = {"steps": end, "first_loss": losses[0] if losses else None,
               "final_loss": losses[-1] if losses else None, "tokens_per_s": float(np.median(steady)),
               "gpu_peak_gb": torch.cuda.max_memory_allocated() / 1e9 if on_gpu else 0.0, "out": args.out}
    if lead:
        print(f"offload-train: done {summary['steps']} steps, loss {summary['first_loss']} -> {summary['final_loss']}, "
              f"{summary['tokens_per_s']:,.0f} tok/s (median), GPU peak {summary['gpu_peak_gb']:.2f} GB, "
              f"checkpoint in {saved}", flush=True)
    return summary


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


def _profiler(args: argparse.Namespace):
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


def _allocator_settings(args: argparse.Namespace) -> None:
    """Kept layers' activations come and go near the GPU's limit, where the caching allocator's default
    releases and re-maps cached blocks (each a device synchronization: B2's auto step 1.12 s against 1.07 s
    with expandable segments, run 50). So offload-train grows segments instead, unless the user's
    PYTORCH_CUDA_ALLOC_CONF says otherwise; it is read when CUDA's allocator starts, after this."""
    if args.activation_checkpointing != "all" and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"


def interrupted_message(args: argparse.Namespace, argv: list[str]) -> str:
    """Ctrl-C's one line: the last complete checkpoint and the command that continues from it."""
    complete = run_dir.complete_checkpoints(args.out)
    legacy = os.path.join(args.out, run_dir.LEGACY)
    if complete:
        last = "last complete checkpoint: step {} ({})".format(*complete[-1])
    elif args.fsdp and os.path.isdir(legacy):  # --fsdp writes its checkpoint in place
        last = f"last checkpoint: {legacy}"
    else:
        return (f"offload-train: interrupted before the first complete checkpoint; nothing to resume in {args.out}: "
                "start again with --overwrite")
    kept = [a for k, a in enumerate(argv) if not _is_resume_or_overwrite(argv, k)]
    command = shlex.join(["offload-train", *kept, "--resume"])
    return f"offload-train: interrupted; {last}; continue with: {command}"


def _is_resume_or_overwrite(argv: list[str], k: int) -> bool:
    """Whether argv[k] is --overwrite, --resume or --resume's value (the continuing command has its own)."""
    a = argv[k]
    if a in ("--overwrite", "--resume") or a.startswith("--resume="):
        return True
    return k > 0 and argv[k - 1] == "--resume" and not a.startswith("-")


def _refuse(exc: UsageError, debug: bool) -> NoReturn:
    """A bad input's one line and exit status 2; with --debug, the traceback instead."""
    if debug:
        raise exc
    print(f"offload-train: error: {exc}", file=sys.stderr, flush=True)
    sys.exit(2)


def main(argv: list[str] | None = None) -> None:
    try:
        args = parse_args(argv)
    except UsageError as exc:
        _refuse(exc, debug="--debug" in (sys.argv[1:] if argv is None else argv))
    # Most inputs are checked before --out is made; what only the data or the model can tell (a tokenizer that
    # does not load, a sequence longer than the model's positions, a plan that does not fit) comes after the
    # corpus's tokenizer is written there: an --out this invocation made is then removed with its refusal.
    fresh_out = not os.path.lexists(args.out)
    _allocator_settings(args)
    try:
        check_inputs(args)
        run(args)
    except UsageError as exc:
        if fresh_out and run_dir.existing_run(args.out) is None:  # never a run's metrics or checkpoints
            shutil.rmtree(args.out, ignore_errors=True)
        _refuse(exc, args.debug)
    except KeyboardInterrupt:
        # No traceback: a checkpoint being written when the key came stays a .partial directory, never read.
        print("\n" + interrupted_message(args, sys.argv[1:] if argv is None else list(argv)), file=sys.stderr,
              flush=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
