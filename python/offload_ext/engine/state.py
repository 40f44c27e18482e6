"""State: the Offloader's training state (host buffers, device optimizer, hyperparameters) saved and
restored, and the model's weights read back by name from where they live."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from offload_ext.engine.backends import LayerBuffers
from offload_ext.models.quantized_base import dequantize
from offload_ext.models.safetensors_io import SafetensorsCheckpoint, TensorSource
from offload_ext.planning.layout import Layout, Span

_HOST_KEYS = ("params", "exp_avg", "exp_avg_sq", "master", "exp_avg_absmax", "exp_avg_sq_absmax")


def host_state(host: list[LayerBuffers]) -> list[dict[str, torch.Tensor | None]]:
    """Copies of every unit's host buffers, in unit order."""
    return [{k: getattr(b, k).clone() if getattr(b, k) is not None else None for k in _HOST_KEYS} for b in host]


def _named_host_buffers(host: list[LayerBuffers]) -> list[tuple[str, torch.Tensor]]:
    """Every unit's live host buffers, named layers.<unit>.<buffer>."""
    return [(f"layers.{i}.{k}", getattr(b, k)) for i, b in enumerate(host) for k in _HOST_KEYS
            if getattr(b, k) is not None]


def host_sources(host: list[LayerBuffers]) -> list[tuple[str, TensorSource]]:
    """Every unit's host buffers as tensors to write: views of the live buffers, no copies."""
    return [(name, TensorSource(t.dtype, tuple(t.shape), lambda t=t: t)) for name, t in _named_host_buffers(host)]


def read_host_state(host: list[LayerBuffers], checkpoint: SafetensorsCheckpoint) -> None:
    """Read what host_sources wrote straight back into the live host buffers."""
    buffers = _named_host_buffers(host)
    if set(checkpoint.entries) != {name for name, _ in buffers}:
        raise ValueError(f"Offloader: {checkpoint.path} holds {len(checkpoint.entries)} host buffers, this "
                         f"Offloader has {len(buffers)}: was the state made for another model or precision?")
    pairs = [(checkpoint.entries[name], dst, name) for name, dst in buffers]
    for entry, dst, name in pairs:  # all checked before any buffer is written
        if entry.shape != tuple(dst.shape) or entry.dtype != dst.dtype:
            raise ValueError(f"Offloader: saved {name} is {entry.dtype} {list(entry.shape)}, the buffer "
                             f"{dst.dtype} {list(dst.shape)}: was the state made for another model?")
    for entry, dst, _ in pairs:
        checkpoint.read_into(entry, dst)
    for b in host:
        b.mirror_frozen()


def load_host_state(host: list[LayerBuffers], saved_units: list[dict[str, Any]]) -> None:
    if len(saved_units) != len(host):
        raise ValueError(f"Offloader: state has {len(saved_units)} layers, the model {len(host)}")
    for b, saved in zip(host, saved_units):
        for key in _HOST_KEYS:
            dst = getattr(b, key)
            if dst is None:
                continue
            if saved[key].shape != dst.shape:
                raise ValueError(f"Offloader: saved {key} of shape {tuple(saved[key].shape)} does not fit "
                                 f"{tuple(dst.shape)}: was the state made for another model?")
            dst.copy_(saved[key])
        b.mirror_frozen()


def span_names(model: nn.Module, layout: Layout) -> list[list[str]]:
    """Per unit, the names of its parameters in buffer order (the order depends on the param groups)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names.get(id(s.param), "?") for s in unit.spans] for unit in layout.units]


def check_state(state: dict[str, Any], precision: str, spans: list[list[str]], groups: int,
                sr_seed: int | None = None) -> None:
    """Refuse a state this Offloader cannot continue exactly (`sr_seed`: its bf16-sr stream's seed)."""
    if state["precision"] != precision:
        raise ValueError(f"Offloader: state is for precision {state['precision']!r}, this Offloader uses "
                         f"{precision!r}")
    saved = state.get("sr_seed")  # states from before bf16-sr have none: nothing to continue
    if sr_seed is not None and saved is not None and saved != sr_seed:
        raise ValueError(f"Offloader: the state's bf16-sr steps drew from sr_seed={saved}, this Offloader's from "
                         f"sr_seed={sr_seed}: build it with sr_seed={saved} to continue the same run "
                         "(offload-train: the same --seed)")
    if len(state["param_groups"]) != groups:
        raise ValueError(f"Offloader: state has {len(state['param_groups'])} param groups, this Offloader {groups}: "
                         "build it with the same groups / no_decay")
    if state["spans"] != spans:
        raise ValueError("Offloader: the state's parameters are laid out in another order (other param groups, or "
                         "another model); build the Offloader with the same groups / no_decay as the saved one")


def _streamed_values(layout: Layout, host: list[LayerBuffers]) -> dict[int, Callable[[], torch.Tensor]]:
    """Per streamed parameter (by id), what gives its values: the view of its span in its unit's live host params,
    or for a weight held quantized, a new bf16 tensor dequantized from it."""
    def value(span: Span, params: torch.Tensor) -> Callable[[], torch.Tensor]:
        stored = params[span.offset:span.offset + span.stored]
        if span.quant is None:
            return lambda: stored.view(span.shape)

        def dequantized() -> torch.Tensor:
            out = torch.empty(span.shape, dtype=torch.bfloat16)
            dequantize(span.quant, span.shape, stored, out)
            return out
        return dequantized
    return {id(s.param): value(s, host[unit.index].params) for unit in layout.units for s in unit.spans}


def weight_sources(model: nn.Module, layout: Layout, host: list[LayerBuffers]) -> list[tuple[str, TensorSource]]:
    """The model's state_dict entries by name, each tensor once (a tied one under its first name), as
    sources that give each value when asked: a view of its host span, or a CPU copy of a device tensor."""
    streamed = _streamed_values(layout, host)
    out, seen = [], set()
    for name, t in model.state_dict(keep_vars=True).items():  # keep_vars: the Parameter objects themselves
        if id(t) in seen:
            continue
        seen.add(id(t))
        if id(t) in streamed:
            out.append((name, TensorSource(torch.bfloat16, tuple(t.shape), streamed[id(t)])))
        else:
            out.append((name, TensorSource(t.dtype, tuple(t.shape), lambda t=t: t.detach().cpu().contiguous())))
    return out


def model_weights(model: nn.Module, layout: Layout, host: list[LayerBuffers],
                  include: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
    """The model's weights by name as CPU tensors: streamed ones copied from the host buffers; with
    `include`, only the names it accepts."""
    streamed = _streamed_values(layout, host)
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if include is None or include(name):
            # copy=True: on the simulated device .cpu() would hand out the live tensor itself.
            out[name] = streamed[id(p)]().clone() if id(p) in streamed else p.detach().to("cpu", copy=True)
    for name, buf in persistent_buffers(model):
        if include is None or include(name):
            out[name] = buf.detach().to("cpu", copy=True)
    return out


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers state_dict() has: a non-persistent one (rotary frequencies, computed at construction)
    would make model.load_state_dict(weights) fail in strict mode."""
    return [(f"{prefix}.{name}" if prefix else name, buf) for prefix, module in model.named_modules()
            for name, buf in module._buffers.items()
            if buf is not None and name not in module._non_persistent_buffers_set]
