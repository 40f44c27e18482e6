"""The device a run trains on, and what follows from it: the backend (offload or not), the defaults of the
size flags, and the loss backend."""
from __future__ import annotations

import argparse
import os

import torch

from offload_ext.models.losses import resolve_loss_kernel
from offload_ext.train.errors import UsageError
from offload_ext.train.model_configs import SMALL_BUILTINS

_DEVICES = "cuda, cuda:N, cpu, cpu-sim (the offload engine on the simulated device) or auto"


def allocator_for_kept_layers(checkpointing: str | int) -> None:
    """Kept layers' activations come and go near the GPU's limit, where the caching allocator's default
    releases and re-maps cached blocks, each a device synchronization (docs/history.md measures what that costs
    a step). So a run that keeps layers grows segments instead, unless the user's
    PYTORCH_CUDA_ALLOC_CONF says otherwise; it is read when CUDA's allocator starts, after this."""
    if checkpointing != "all" and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"


def choose_device(args: argparse.Namespace) -> tuple[torch.device, bool]:
    """(device, simulated), and args.backend resolved for it (see resolve_backend)."""
    device, simulated = _device(args.device)
    args.backend = resolve_backend(args, device, simulated)
    return device, simulated


def _device(name: str) -> tuple[torch.device, bool]:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu"), False
    if name == "cpu-sim":
        return torch.device("cpu"), True
    try:
        dev = torch.device(name)
    except RuntimeError as exc:
        raise UsageError(f"--device {name}: not a device; expected {_DEVICES}") from exc
    if dev.type not in ("cuda", "cpu"):
        raise UsageError(f"--device {name}: offload-train runs on CUDA or the CPU; expected {_DEVICES}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: CUDA is not available here; use --device cpu or cpu-sim")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UsageError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s); use "
                         f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return dev, False


def resolve_backend(args: argparse.Namespace, device: torch.device, simulated: bool) -> str:
    """--backend as given, or its default: native, except where the run is on the CPU and not simulated
    (--device cpu, or auto without CUDA), which trains without offload and says so. An explicit offload
    backend on the CPU is refused with the fix: offload there needs the simulated device."""
    on_cpu = device.type == "cpu" and not simulated
    if args.fsdp:  # FSDP2's own CPU offload; --device cpu runs gloo ranks
        return args.backend or "native"
    if args.backend is None:
        if not on_cpu:
            return "native"
        why = "--device cpu" if args.device != "auto" else "no CUDA device"
        print(f"offload-train: {why}: training on the CPU without offload (--backend none); --device cpu-sim runs "
              "the offload engine on the CPU", flush=True)
        return "none"
    if simulated and args.backend == "none":
        raise UsageError("--device cpu-sim runs the offload engine: pick --backend native or python, or --device cpu "
                         "to train on the CPU without offload")
    if on_cpu and args.backend != "none":
        given = f"--backend {args.backend}" + (f" --device {args.device}" if args.device != "auto" else "")
        where = "" if args.device != "auto" else "there is no CUDA device here, and "
        raise UsageError(f"{given}: {where}the offload engine needs a CUDA device or the simulated one; use "
                         "--device cpu-sim to run it on the CPU, or leave --backend out to train on the CPU "
                         "without offload")
    return args.backend


def apply_defaults(args: argparse.Namespace, on_gpu: bool) -> None:
    if args.model == "auto":
        args.model = "small" if on_gpu else "tiny"
    for name, gpu, cpu in (("batch_size", 8, 4), ("seq_len", 512, 64), ("steps", 200, 60)):
        if getattr(args, name) is None:
            setattr(args, name, gpu if on_gpu else cpu)
    if args.warmup_steps is None:
        args.warmup_steps = max(1, args.steps // 20)
    if args.lr is None:  # the small built-ins learn fast; 3e-3 made a random 8 B model diverge at once
        args.lr = 3e-3 if args.model in SMALL_BUILTINS else 3e-4
    # the engine lays itself out on a GPU; elsewhere (no GPU memory to plan with, or no engine) the fixed layout
    engine_on_gpu = on_gpu and args.backend != "none" and not args.fsdp
    for name, fixed in (("resident_layers", 0), ("device_layers", 2)):
        if getattr(args, name) is None:
            setattr(args, name, "auto" if engine_on_gpu else fixed)


def check_loss_chunk(args: argparse.Namespace) -> None:
    if args.loss_chunk_tokens < 1:
        raise UsageError(f"--loss-chunk-tokens must be at least 1, got {args.loss_chunk_tokens}")


def check_loss_args(args: argparse.Namespace, device: torch.device) -> None:
    check_loss_chunk(args)
    try:
        resolve_loss_kernel(args.loss_kernel, device)
    except RuntimeError as exc:
        raise UsageError(f"--loss-kernel {args.loss_kernel}: {exc}") from exc
