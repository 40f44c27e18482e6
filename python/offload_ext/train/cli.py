"""offload-train's run: the set-up in order (inputs, data, model, memory plan, trainer), the training loop
with its metrics and checkpoints, and the one-line refusals of bad input (flags and configs: train/flags.py;
the FSDP2 run: train/fsdp_trainer.py)."""
from __future__ import annotations

import argparse
import gc
import os
import random
import shlex
import shutil
import sys
import time
from typing import Any, NoReturn

import numpy as np
import torch

from offload_ext.config import device_precision, eight_bit
from offload_ext.models.lora import add_lora
from offload_ext.models.weights import from_config_empty
from offload_ext.planning.auto_layout import choose_layout
from offload_ext.planning.choices import Settings
from offload_ext.planning.param_groups import build_groups
from offload_ext.planning.plan import machine, plan
from offload_ext.planning.report import MemoryPlan
from offload_ext.train import checkpoint_manifest, errors, interrupt, prior_run
from offload_ext.train import data as data_mod
from offload_ext.train.errors import CheckpointWriteError, UsageError
from offload_ext.train.flags import parse_args, run_flags, train_config
from offload_ext.train.gpu_warmup import GpuWarmup
from offload_ext.train.inputs import check_inputs
from offload_ext.train.loop import dist_rank, print_setup, seconds_since_process_start, train_loop
from offload_ext.train.machine import (
    allocator_for_kept_layers,
    apply_defaults,
    check_loss_args,
    check_loss_chunk,
    choose_device,
)
from offload_ext.train.model_configs import model_config
from offload_ext.train.setup import build_model
from offload_ext.train.tokens import build_stream, planned_vocab
from offload_ext.train.trainer import Trainer


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.dry_run:
        return {"plan": dry_run(args)}
    if args.gpu_memory is not None or args.host_memory is not None:
        raise UsageError("--gpu-memory and --host-memory describe the machine a plan is for: use them with --dry-run")
    entered = time.perf_counter()
    began = entered - seconds_since_process_start()  # metrics' elapsed_s: the interpreter and set-up count
    _check_out(args)
    device, simulated = choose_device(args)
    if args.fsdp:
        return _run_fsdp(args, device, simulated, began, entered)
    on_gpu = device.type == "cuda"  # args.backend resolved by choose_device: none on the CPU unless simulated
    apply_defaults(args, on_gpu)
    check_loss_args(args, device)
    if args.backend == "none" and any(getattr(args, k) == "auto" for k in prior_run.AUTO_FLAGS):
        raise UsageError("--resident-layers and --device-layers auto lay out the offload engine: --backend none has "
                         "none (drop them, or train with --backend native)")
    if args.backend != "none" and args.device == "cpu":
        raise UsageError("--device cpu trains without offload (--backend none); use --device cpu-sim to run the "
                         "offload engine on the simulated device")
    resume_from = _resume_point(args)
    if args.backend == "native":
        from offload_ext import _ext

        if not _ext.available():
            raise UsageError(f"--backend native: the native extension is not available ({_ext.error()}); "
                             "reinstall with `pip install --no-build-isolation .`, or use --backend python")
    # The GPU's libraries load on a thread while the data and the model are prepared (both hold the GIL).
    warmup = GpuWarmup(device, args.seq_len) if on_gpu else None
    # One phase after another: tokenizing the corpus on a thread while the engine page-locked its buffers made
    # both slower (8 B: data 9.0 s, page-locking 17.1 s, against 2.5 and 6.1 alone).
    marks, stream, tokenizer, vocab = _seed_and_data(args, began, entered)
    model, weights = build_model(args, vocab, device)
    if warmup is not None:
        warmup.join()  # before the memory plan measures the GPU's free memory
    marks.append(("model", time.perf_counter()))
    model = _with_lora(args, model)
    _resolve_layout(args, model, device, resume_from)
    memory = None
    if args.backend != "none" and (on_gpu or simulated):  # the whole memory check, activations included
        memory = _plan(args, model, device)
        if not memory.fits:
            raise UsageError(memory.refusal())
    try:
        trainer = Trainer(train_config(args, device), model, device, simulated, weights)
    except MemoryError as exc:  # the Offloader's check, before anything was allocated: it names the options
        raise UsageError(str(exc)) from exc
    marks.append(("engine", time.perf_counter()))
    print_setup(marks, trainer)
    start = trainer.load(stream, resume_from) if resume_from is not None else 0
    metrics_path = _settle_out(args, resume_from is not None, start)
    tokens_per_step = args.batch_size * args.seq_len * args.grad_accum
    return train_loop(args, trainer, stream, tokenizer, start, metrics_path, tokens_per_step, on_gpu, began, memory)


def _settle_out(args: argparse.Namespace, resumed: bool, start: int) -> str:
    """--out made ready for the run's metrics and checkpoints: a resumed run's metrics after its checkpoint trimmed
    (those steps are trained and logged again), --overwrite's previous run removed; the metrics' path."""
    if resumed:
        prior_run.trim_metrics(args.out, start)
    else:
        prior_run.remove_run(args.out)  # --overwrite's (_check_out refused an --out holding a run without it)
    return os.path.join(args.out, prior_run.METRICS)


def _check_out(args: argparse.Namespace) -> None:
    """Refuse, before anything is allocated or written, an --out that holds a run unless --resume or
    --overwrite says what to do with it, and a --resume with nothing to continue."""
    if args.resume is not None and args.overwrite:
        raise UsageError("--resume and --overwrite contradict each other: --resume continues the run in --out, "
                         "--overwrite replaces it; pass one")
    held = prior_run.existing_run(args.out)
    if held is not None and args.resume is None and not args.overwrite:
        raise UsageError(f"--out {args.out} already holds a run ({held}): continue it with --resume, or replace "
                         "it with --overwrite (or pick another --out)")


def _resume_point(args: argparse.Namespace) -> checkpoint_manifest.Checkpoint | None:
    """The verified checkpoint --resume continues from (None without --resume), its flags checked against
    this run's: before the model or the engine is built."""
    if args.resume is None:
        return None
    try:
        ckpt = prior_run.find(args.out, args.resume)
        prior_run.check_flags(ckpt, run_flags(args))
    except errors.CheckpointError as exc:
        raise UsageError(str(exc)) from exc
    return ckpt


def _seed_and_data(args: argparse.Namespace, began: float,
                   entered: float) -> tuple[list[tuple[str, float]], data_mod.TokenStream, Any, int]:
    """Seed Python's and numpy's RNGs, make --out, build the token stream; the set-up's phase marks so far. The
    phases are printed once (what "time to the first step" counts), from the process's start: the interpreter and
    the imports before run() (torch's among them) are the first."""
    random.seed(args.seed)
    np.random.seed(args.seed)
    marks = [("start", began), ("imports", entered)]
    os.makedirs(args.out, exist_ok=True)  # by every rank of an FSDP run: each may write the corpus's files there
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
    resume_from = _resume_point(args)
    marks, stream, tokenizer, vocab = _seed_and_data(args, began, entered)
    model, weights = build_model(args, vocab, device)  # on the meta device, with the weights to fill it from
    marks.append(("model", time.perf_counter()))
    trainer = FsdpTrainer(train_config(args, device), model, weights, device)
    marks.append(("engine", time.perf_counter()))
    print_setup(marks, trainer)
    if dist_rank() == 0:
        print(f"offload-train: {trainer.describe()}", flush=True)
    start = trainer.load(stream, resume_from) if resume_from is not None else 0
    metrics_path = os.path.join(args.out, prior_run.METRICS)
    if dist_rank() == 0:
        _settle_out(args, resume_from is not None, start)
    torch.distributed.barrier()  # no rank writes into --out before it is settled
    world = torch.distributed.get_world_size()
    summary = train_loop(args, trainer, stream, tokenizer, start, metrics_path,
                    args.batch_size * args.seq_len * args.grad_accum * world, on_gpu, began)
    # The sharded model and optimizer hold the group's last work objects: freed while the interpreter is whole,
    # or gloo's loop thread frees them during finalization and can abort the process after its checkpoint.
    del trainer, model, weights
    gc.collect()
    torch.distributed.destroy_process_group()
    return summary


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
        c = train_config(args, device)
        return plan(model, c.offload, lr=c.lr, weight_decay=c.weight_decay, no_decay=c.no_decay,
                    batch_size=args.batch_size, seq_len=args.seq_len, loss_chunk_tokens=c.loss_chunk_tokens,
                    loss_kernel=c.loss_kernel, gpu_memory=args.gpu_memory, host_memory=args.host_memory)
    except ValueError as exc:  # a bad size or setting: the message names it
        raise UsageError(str(exc)) from exc


def _resolve_layout(args: argparse.Namespace, model: torch.nn.Module, device: torch.device,
                    resume_from: checkpoint_manifest.Checkpoint | None) -> None:
    """The run's layout settled and said: auto flags as numbers, and what 8-bit moments cover under it."""
    _choose_auto_layout(args, model, device, resume_from)
    _note_device_precision(args)


def _choose_auto_layout(args: argparse.Namespace, model: torch.nn.Module, device: torch.device,
                        resume_from: checkpoint_manifest.Checkpoint | None) -> None:
    """--resident-layers / --device-layers auto as numbers: a resumed run's from its checkpoint, a new one's from
    the memory plan of its batch; printed as the flags that reproduce it, and recorded so in its checkpoints."""
    auto = [k for k in prior_run.AUTO_FLAGS if getattr(args, k) == "auto"]
    if not auto:
        return
    if resume_from is not None:
        chosen = {k: resume_from.manifest["args"][k] for k in auto}
        reason = "the checkpoint's"
    else:
        fixed = argparse.Namespace(**{**vars(args), "resident_layers": 0 if "resident_layers" in auto else
                                      args.resident_layers, "device_layers": 2})
        c = train_config(fixed, device)
        settings = Settings(c.offload, batch_size=args.batch_size, seq_len=args.seq_len,
                            loss_chunk_tokens=c.loss_chunk_tokens, loss_kernel=c.loss_kernel)
        _, group_of = build_groups(model, None, c.no_decay)
        choice = choose_layout(model, settings, machine(device, args.host_memory, args.gpu_memory, model), group_of,
                               resident=None if "resident_layers" in auto else args.resident_layers)
        chosen = {k: getattr(choice, k) for k in auto}
        reason = choice.reason
    for key, value in chosen.items():
        setattr(args, key, value)
    run_flags(args).update(chosen)
    if dist_rank() == 0:
        print(f"offload-train: layout --resident-layers {args.resident_layers} --device-layers {args.device_layers} "
              f"({reason})", flush=True)


def _note_device_precision(args: argparse.Namespace) -> None:
    """An 8-bit precision's moments are the streamed layers' alone (the device's optimizer has none): said where
    layers stay on the GPU, so that nobody reads a run mostly resident as a run of 8-bit moments."""
    if eight_bit(args.precision) and args.resident_layers and dist_rank() == 0:
        print(f"offload-train: the {args.resident_layers} resident layers step on the GPU in "
              f"{device_precision(args.precision)}, bf16 moments; the 8-bit moments are the streamed layers' "
              "(--resident-layers 0 streams them all)", flush=True)


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
    model = _with_lora(args, model)
    _resolve_layout(args, model, device, None)
    memory = _plan(args, model, device)
    print(memory, flush=True)
    if not memory.fits:
        raise UsageError(memory.refusal())
    return memory


def interrupted_message(args: argparse.Namespace, argv: list[str]) -> str:
    """Ctrl-C's one line: the last complete checkpoint and the command that continues from it."""
    return _continue_message(args, argv, prior_run.complete_checkpoints(args.out), "interrupted", "")


def write_failed_message(args: argparse.Namespace, argv: list[str], exc: CheckpointWriteError) -> str:
    """The one line of a run stopped by a checkpoint it could not write: why, and how to go on once there is room."""
    complete = prior_run.complete_checkpoints(args.out)
    size = checkpoint_manifest.checkpoint_bytes(complete[-1][1]) if complete else None
    room = f"each checkpoint here takes {checkpoint_manifest.readable_size(size)}, " if size is not None else ""
    if exc.step in (step for step, _ in complete):  # sealed: what failed came after, pointing `latest` or pruning
        what = (f"stopped after step {exc.step}: its checkpoint is complete, but --out could not be tidied after it "
                f"({exc})")
    else:
        what = (f"stopped at step {exc.step}: its checkpoint could not be written ({exc}); its partial files were "
                "removed")
    return _continue_message(args, argv, complete, what, f"make room at --out ({room}--keep-checkpoints "
                             f"{args.keep_checkpoints} of them are kept), then ")


def _continue_message(args: argparse.Namespace, argv: list[str], complete: list[tuple[int, str]], what: str,
                      before: str) -> str:
    """`what` happened; the last of the `complete` checkpoints and the command that continues from it (`before` it:
    what to do first), or that there is none."""
    if not complete:
        return (f"offload-train: {what}; nothing to resume in {args.out} (no complete checkpoint): {before}start "
                "again with --overwrite")
    last = "last complete checkpoint: step {} ({})".format(*complete[-1])
    kept = [a for k, a in enumerate(argv) if not _is_resume_or_overwrite(argv, k)]
    command = shlex.join([*_launcher(args), *kept, "--resume"])
    return f"offload-train: {what}; {last}; {before}continue with: {command}"


def _launcher(args: argparse.Namespace) -> list[str]:
    """How this run was started, before its flags: an --fsdp run under torchrun with its ranks."""
    if not args.fsdp:
        return ["offload-train"]
    local, world = os.environ.get("LOCAL_WORLD_SIZE", "N"), os.environ.get("WORLD_SIZE", "N")  # torchrun's
    several = local.isdigit() and world.isdigit() and int(world) > int(local)
    nodes = ["--nnodes", str(int(world) // int(local))] if several else []
    return ["torchrun", *nodes, "--nproc-per-node", local, "-m", "offload_ext.train.cli"]


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
    given = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parse_args(argv)
    except UsageError as exc:
        _refuse(exc, debug="--debug" in given)
    # Most inputs are checked before --out is made; what only the data or the model can tell (a tokenizer that
    # does not load, a sequence longer than the model's positions, a plan that does not fit) comes after the
    # corpus's tokenizer is written there: an --out this invocation made is then removed with its refusal.
    fresh_out = not os.path.lexists(args.out)
    allocator_for_kept_layers(args.activation_checkpointing)
    try:
        with interrupt.recorded():
            check_inputs(args)
            run(args)
    except UsageError as exc:
        if fresh_out and prior_run.existing_run(args.out) is None:  # never a run's metrics or checkpoints
            shutil.rmtree(args.out, ignore_errors=True)
        _refuse(exc, args.debug)
    except CheckpointWriteError as exc:  # raised on every rank of an --fsdp run: rank 0 says it
        if dist_rank() == 0:
            print(write_failed_message(args, given, exc), file=sys.stderr, flush=True)
        sys.exit(1)
    except KeyboardInterrupt:
        _interrupted(args, given)
    except Exception:
        if not interrupt.pressed():
            raise
        _interrupted(args, given)  # the key's, turned into a library's own error


def _interrupted(args: argparse.Namespace, argv: list[str]) -> NoReturn:
    """Ctrl-C's end: its one line, no traceback, exit status 130. A checkpoint being written when the key came
    stays a .partial directory, never read."""
    print("\n" + interrupted_message(args, argv), file=sys.stderr, flush=True)
    interrupt.exit_interrupted()


if __name__ == "__main__":
    main()
