"""offload_ext.plan: what training a model under the Offloader's settings needs in host RAM (pinned and
pageable) and GPU memory, and the largest batch x seq that fits, for this machine or one described;
and the refusal, before anything is allocated, of a run that cannot fit (the Offloader's device check,
offload-train's whole check), naming the numbers and the settings that need less.

The figures are memory_plan's: the same decisions and host blocks a real Offloader takes.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from offload_ext.config import PRECISIONS, OffloadConfig, check_hyper, parse_size, resolve_device
from offload_ext.models.quantized_base import quantized_linears
from offload_ext.models.stacks import find_layer_stacks
from offload_ext.planning import host_sizes
from offload_ext.planning.choices import EngineChoices, Settings, check_checkpointing
from offload_ext.planning.gpu import CUDA_CONTEXT, Shape, device_free_bytes, gpu_estimate
from offload_ext.planning.layout import GroupOf
from offload_ext.planning.memory import (
    CUDA_HOST,
    Evaluation,
    Machine,
    evaluate,
    host_activation_bytes,
    largest_batch,
    largest_seq,
    process_rss,
)
from offload_ext.planning.param_groups import build_groups
from offload_ext.planning.report import MemoryPlan

_GB = 1e9


def _options(model: nn.Module, ev: Evaluation, machine: Machine, group_of: GroupOf) -> list[str]:
    """What needs less of the memory that is short, each with its figures and whether it fits this machine:
    for the host the backend's own alternatives, for the GPU the settings below evaluated again."""
    options = []
    if not ev.host_fits(machine):
        alternatives = [*ev.host.alternatives, *_quantized_bases(model, ev, machine, group_of)]
        if any(not p.requires_grad for p in model.parameters()):  # already LoRA: "train LoRA" is no way out
            alternatives = [a for a in alternatives if a.option != "LoRA"]
        options += ["host: " + a.describe(ev.host.need.total, machine.host_available) for a in alternatives]
    if not ev.gpu_fits(machine):
        rows = [(text, evaluate(model, ev.settings.with_changes(**change), machine, group_of))
                for text, change in _gpu_changes(model, ev, machine)]
        rows.append(("LoRA (the base frozen; adapters not counted)", evaluate(model, ev.settings, machine, group_of,
                                                                              frozen=True)))
        options += [f"GPU: {text} (GPU {alt.gpu.needed / _GB:.1f} GB, host {alt.host.need.total / _GB:.1f} GB"
                    f"{', both fit' if alt.fits(machine) else ''})"
                    for text, alt in rows if alt.gpu.needed < ev.gpu.needed]
    return options


# LoRA's frozen base held smaller (offload_ext.models.quantized_base): fp8 needs what int8 does
BASE_NOTES = {"int8": "the frozen base's linear weights in int8, a scale per row",
              "nf4": "the frozen base's linear weights in NF4, bitsandbytes' QLoRA layout"}


def _streams_frozen_linears(model: nn.Module, fmt: str) -> bool:
    """Whether a streamed layer holds a frozen linear weight `fmt` can hold: what base_dtype quantizes."""
    return any(quantized_linears(layer, fmt) for _, stack in find_layer_stacks(model) for layer in stack)


def _quantized_bases(model: nn.Module, ev: Evaluation, machine: Machine,
                     group_of: GroupOf) -> list[host_sizes.Alternative]:
    """For LoRA's frozen base held in bf16, the base held in 8 and in 4 bits instead (each layer recomputed whole,
    as a quantized base needs: OffloadConfig.base_dtype)."""
    c = ev.settings.config
    if c.base_dtype is not None:
        return []
    recompute = "" if c.activation_checkpointing == "all" else ", activation_checkpointing='all'"
    options = []
    for fmt, note in BASE_NOTES.items():
        if not _streams_frozen_linears(model, fmt):  # a full fine-tune, or a base outside the streamed layers
            continue
        changed = ev.settings.with_changes(base_dtype=fmt, activation_checkpointing="all")
        alt = evaluate(model, changed, machine, group_of)
        options.append(host_sizes.Alternative(f"base_dtype={fmt!r}{recompute}", alt.host.need.total, note))
    return options


def _gpu_changes(model: nn.Module, ev: Evaluation, machine: Machine) -> list[tuple[str, dict[str, Any]]]:
    """Settings that take less device memory than `ev`'s."""
    s = ev.settings
    changes: list[tuple[str, dict[str, Any]]] = []
    if s.batch_size and s.seq_len:
        batch = largest_batch(model, ev, machine, s.seq_len)
        if batch:
            changes.append((f"batch_size={batch} (the largest at seq_len={s.seq_len})", dict(batch_size=batch)))
        elif seq := largest_seq(model, ev, machine):
            changes.append((f"batch_size=1, seq_len={seq} (the longest at batch 1)", dict(batch_size=1, seq_len=seq)))
        if s.loss_chunk_tokens > 1024:
            changes.append(("loss_chunk_tokens=1024 (fewer logits at once)", dict(loss_chunk_tokens=1024)))
    if s.config.tuning.device_layers > 2:
        changes.append(("device_layers=2", dict(device_layers=2)))
    if s.config.tuning.resident_layers:
        changes.append(("resident_layers=0", dict(resident_layers=0)))
    if s.config.precision == "mixed":
        changes.append(("precision='bf16' (no fp32 masters on the device)", dict(precision="bf16")))
    if not s.config.offload_all and ev.choices.layout.device_params:
        changes.append(("offload_all=True (the embeddings' and head's state on the host)", dict(offload_all=True)))
    return changes


def _reasons(ev: Evaluation, machine: Machine) -> list[str]:
    reasons = []
    if not ev.host_fits(machine):
        need = ev.host.need
        reasons.append(f"the host buffers need {need.total / _GB:.1f} GB ({need.pinned / _GB:.1f} GB pinned, "
                       f"{need.pageable / _GB:.1f} GB pageable) but {machine.host_available / _GB:.1f} GB is available")
    if not ev.gpu_fits(machine):
        reasons.append(f"the GPU needs {ev.gpu.needed / _GB:.1f} GB at its peak ({ev.gpu.peak_phase}, margin included) "
                       f"but {machine.gpu_available / _GB:.1f} GB is available")
    if machine.cuda and machine.gpu_available is None:
        reasons.append("the GPU's memory is unknown (no CUDA device here: pass gpu_memory=)")
    return reasons


def _checkpoint_bytes(ev: Evaluation, precision: str) -> int:
    """Host bytes save_state()/load_state() hold for a GPU's tensors: they pass one at a time, so the largest of
    them (a parameter in bf16, its moments bf16 or, in "mixed", fp32 like its master). The simulated device's are
    written and read where they lie."""
    largest = max((p.numel() for p in ev.choices.layout.device_params), default=0)
    return (4 if precision == "mixed" else 2) * largest


def plan_for(model: nn.Module, settings: Settings, machine: Machine, group_of: GroupOf = lambda p: 0) -> MemoryPlan:
    """The plan of `settings` for `model` on `machine`."""
    ev = evaluate(model, settings, machine, group_of)
    reasons = _reasons(ev, machine)
    fits = ev.fits(machine) and not (machine.cuda and machine.gpu_available is None)
    known = machine.gpu_available is not None and Shape.of(model) is not None
    batch = largest_batch(model, ev, machine, settings.seq_len) if known and settings.seq_len else None
    process = process_rss() + (CUDA_HOST if machine.cuda and not torch.cuda.is_initialized() else 0)
    params = sum(p.numel() for p in model.parameters())
    name = f"{type(model).__name__} ({params / 1e9:.2f} B params)"
    return MemoryPlan(name, settings, str(machine.device), ev.host.need.by_what(), machine.host_available, process,
                      _checkpoint_bytes(ev, settings.config.precision) if machine.cuda else 0,
                      ev.host.speculating, ev.gpu,
                      machine.gpu_available,
                      machine.gpu_total, batch, largest_seq(model, ev, machine) if known else None, fits,
                      tuple(reasons), tuple(_options(model, ev, machine, group_of)) if not fits else (),
                      host_activation_bytes(model, settings, ev.choices),
                      functools.partial(host_bytes_per_param, model, settings, machine, group_of))


def host_bytes_per_param(model: nn.Module, settings: Settings, machine: Machine, group_of: GroupOf
                         ) -> tuple[tuple[str, float, float], ...]:
    """(precision, without clipping, with max_grad_norm) for each precision: the engine's host buffers per
    parameter of the model, every unit speculating under clipping (what a host with room for all of it holds)."""
    unbounded = dataclasses.replace(machine, host_available=None)
    params = sum(p.numel() for p in model.parameters())

    def per_param(precision: str, clip: float | None) -> float:
        changed = settings.with_changes(precision=precision, max_grad_norm=clip)
        return evaluate(model, changed, unbounded, group_of).host.need.total / params
    return tuple((p, per_param(p, None), per_param(p, 1.0)) for p in PRECISIONS)


def machine(device: str | torch.device = "cuda", host_memory: int | str | None = None,
            gpu_memory: int | str | None = None, model: nn.Module | None = None) -> Machine:
    """The machine a plan is for: this one (the GPU's free memory counting what `model`'s parameters hold
    there already), or (`host_memory`, `gpu_memory`: sizes such as 125e9 or "139GiB") one with that much
    memory, all of it available (a device planned so loses its CUDA context first)."""
    dev = torch.device(device)
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"plan: device must be 'cuda', 'cuda:N' or 'cpu' (simulated), got {device!r}")
    host = host_sizes.available_host_bytes(_bytes(host_memory))
    if dev.type == "cpu":  # the simulated device's buffers are host memory: only the host is checked
        return Machine(dev, host, None)
    total = _bytes(gpu_memory)
    if total is not None:
        return Machine(dev if dev.index is not None else torch.device("cuda", 0), host, total - CUDA_CONTEXT, total)
    if not torch.cuda.is_available():
        return Machine(torch.device("cuda", dev.index or 0), host, None)
    dev = resolve_device(dev)
    return Machine(dev, host, _free_for(model, dev), torch.cuda.get_device_properties(dev).total_memory)


def _free_for(model: nn.Module | None, device: torch.device) -> int:
    """What the Offloader may allocate on `device`: the process's free memory there, and what the model's
    parameters already on it hold (the Offloader moves or frees them)."""
    held = sum(p.numel() * p.element_size() for p in model.parameters() if p.device == device) if model else 0
    return device_free_bytes(device) + held


def _bytes(size: int | str | None) -> int | None:
    return None if size is None else int(size) if isinstance(size, (int, float)) else parse_size(size)


def _model_of(model_or_config: Any, lora_r: int | None, lora_alpha: float | None,
              lora_targets: Sequence[str]) -> nn.Module:
    """The model to plan for: the module itself, or one built on the meta device from a transformers
    config or a config's directory or hub id (no weights), with LoRA adapters when asked."""
    if isinstance(model_or_config, nn.Module):
        if lora_r is not None:
            raise ValueError("plan: lora_r is for a model plan() builds from a config; wrap a module with peft "
                             "yourself and pass the peft model")
        return model_or_config
    from offload_ext.models.weights import from_config_empty

    config = model_or_config
    if isinstance(config, (str, os.PathLike)):
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(config)
    model, _ = from_config_empty(config)  # meta parameters; the init source draws nothing until asked
    if lora_r is not None:
        from offload_ext.models.lora import add_lora

        model = add_lora(model, lora_r, lora_alpha or 2 * lora_r, lora_targets)
    return model


def plan(model_or_config: Any, config: OffloadConfig | None = None, *, batch_size: int | None = None,
         seq_len: int | None = None, loss_chunk_tokens: int = 4096, loss_kernel: str = "auto",
         lora_r: int | None = None, lora_alpha: float | None = None,
         lora_targets: Sequence[str] = ("q_proj", "v_proj"), host_memory: int | str | None = None,
         gpu_memory: int | str | None = None, lr: float = 3e-4, betas: tuple[float, float] = (0.9, 0.999),
         eps: float = 1e-8, weight_decay: float = 0.0, groups: Sequence[dict[str, Any]] | None = None,
         no_decay: Sequence[str] = (), weights: Any = None, **options: Any) -> MemoryPlan:
    """The memory plan of `Offloader(model, config=config, **options)`, trained on micro-batches of
    `batch_size` x `seq_len` tokens with causal_lm_loss(chunk_tokens=loss_chunk_tokens, kernel=loss_kernel).
    `model_or_config`: a module (real or on the meta device; a peft model for LoRA), a transformers config,
    or a config's directory or hub id (built on the meta device, with LoRA adapters of rank `lora_r` on
    `lora_targets`). The optimizer's arguments are checked as the Offloader checks them, so the same keywords
    can be passed. Nothing is allocated. `host_memory` and `gpu_memory` plan for a machine of that size
    instead of this one (needed for a CUDA device where there is none)."""
    cfg = OffloadConfig.from_options(config, owner="plan", **options)
    check_hyper(lr, tuple(betas), eps, weight_decay)
    if (batch_size is None) != (seq_len is None) or (batch_size is not None and min(batch_size, seq_len) < 1):
        raise ValueError(f"plan: give batch_size and seq_len together, each at least 1 (got {batch_size}, {seq_len})")
    model = _model_of(model_or_config, lora_r, lora_alpha, lora_targets)
    _, group_of = build_groups(model, groups, no_decay)
    settings = Settings(cfg, batch_size=batch_size, seq_len=seq_len, loss_chunk_tokens=loss_chunk_tokens,
                        loss_kernel=loss_kernel)
    layers = cfg.tuning.resident_layers + min((len(stack) for _, stack in find_layer_stacks(model)), default=0)
    device = torch.device(cfg.device)
    check_checkpointing(cfg.activation_checkpointing, layers, cfg.gpu_memory_budget, device)
    return plan_for(model, settings, machine(device, host_memory, gpu_memory, model), group_of)


def check_device_memory(model: nn.Module, settings: Settings, choices: EngineChoices, device: torch.device,
                        group_of: GroupOf) -> None:
    """The Offloader's device check, before anything is put on the device: what stays allocated through
    training (parameters kept there and their state, layer and gradient buffers; activations come on top
    and depend on the batch, which offload-train checks too) must fit what the process may allocate."""
    if device.type != "cuda":
        return
    here = Machine(device, None, _free_for(model, device))
    gpu = gpu_estimate(model, choices, settings.config.precision, settings.config.tuning.device_layers, cuda=True)
    if gpu.needed <= here.gpu_available:
        return
    ev = Evaluation(settings, choices, evaluate(model, settings, here, group_of).host, gpu)
    rows = ", ".join(f"{what} {nbytes / _GB:.2f} GB" for what, nbytes in gpu.static if nbytes)
    raise MemoryError(f"Offloader: the device needs {gpu.needed / _GB:.1f} GB before any activation ({rows}, margin "
                      f"{gpu.margin / _GB:.2f} GB) but {here.gpu_available / _GB:.1f} GB is free for this process; "
                      f"nothing was allocated. Options: {'; '.join(_options(model, ev, here, group_of))}")
