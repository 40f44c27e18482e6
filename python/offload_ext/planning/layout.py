"""Layout: the frozen plan of what the Offloader streams, fixed once before any buffer exists.

Names used throughout the Offloader:
- a *unit* is the parameters stepped together on the host: one streamed layer, or (with
  offload_all) every parameter outside the stacks; `Unit.index` is its one global id, the backend's too;
- a *span* is one parameter's place in its unit's flat buffers (trainable spans first, then frozen; a frozen
  linear weight held quantized, `Span.quant`, takes `Span.stored` bf16 elements of raw storage, after the rest);
- a *position* is a layer's place in its stack (forward order);
- a *group* is a parameter group of the Offloader (its own lr, weight decay, ...): a unit's trainable
  spans are ordered by group, so each group is one contiguous range of the unit's trainable prefix.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from offload_ext.models.quantized_base import quantized_linears, stored_elements
from offload_ext.models.stacks import find_layer_stacks


@dataclass(frozen=True, eq=False)
class Span:
    param: nn.Parameter
    offset: int
    numel: int
    shape: torch.Size
    quant: str | None = None  # a BASE_DTYPES format: the frozen weight is held quantized
    stored: int = -1          # the bf16 elements it takes in the flat buffers (numel unless quantized)

    def __post_init__(self) -> None:
        if self.stored < 0:
            object.__setattr__(self, "stored", self.numel)


@dataclass(frozen=True, eq=False)
class Unit:
    index: int
    spans: tuple[Span, ...]   # trainable first (ordered by group), then frozen
    trainable: int            # how many spans are trainable
    group_ranges: tuple[tuple[int, int, int], ...]  # (param group, begin, end) over the trainable prefix

    @property
    def numel(self) -> int:
        """The bf16 elements of the unit's flat buffers (a quantized span's storage, not its values)."""
        return self.spans[-1].offset + self.spans[-1].stored if self.spans else 0

    @property
    def trainable_numel(self) -> int:
        return sum(s.numel for s in self.trainable_spans)

    @property
    def trainable_spans(self) -> tuple[Span, ...]:
        return self.spans[: self.trainable]


@dataclass(frozen=True, eq=False)
class Part:
    """A part of the model the Offloader hosts: a stack of layers (one unit per layer, in forward order),
    or the parameters outside the stacks (one unit)."""

    name: str
    layers: tuple[nn.Module, ...]   # the streamed layers; empty for the part outside the stacks
    units: tuple[Unit, ...]


@dataclass(frozen=True, eq=False)
class Layout:
    stacks: tuple[Part, ...]             # each stack's streamed layers
    outside: Part | None                 # offload_all: the rest as one more host-stepped unit
    device_params: tuple[nn.Parameter, ...]  # otherwise the rest stays on the device, with a device AdamW
    resident: tuple[nn.Module, ...] = ()     # the lowest layers of each stack kept on the device (their
                                             # parameters among device_params), checkpointed as streamed ones

    @property
    def parts(self) -> tuple[Part, ...]:
        return self.stacks + ((self.outside,) if self.outside is not None else ())

    @property
    def units(self) -> list[Unit]:
        return [u for part in self.parts for u in part.units]

    @property
    def resident_per_stack(self) -> int:
        return len(self.resident) // len(self.stacks)

    @property
    def fewest_stack_layers(self) -> int:
        """The fewest layers a stack has, resident and streamed."""
        return self.resident_per_stack + min(len(part.layers) for part in self.stacks)

    @property
    def stack_layers(self) -> int:
        """Every stack's layers, resident and streamed."""
        return len(self.resident) + sum(len(part.layers) for part in self.stacks)


GroupOf = Callable[[nn.Parameter], int]


def _unit(index: int, params: list[nn.Parameter], group_of: GroupOf, quantized: dict[int, str] | None = None
          ) -> Unit:
    """`quantized`: the formats of the frozen weights held quantized (by parameter id); they go last."""
    quantized = quantized or {}
    trainable = sorted((p for p in params if p.requires_grad), key=group_of)  # stable: model order within a group
    frozen = [p for p in params if not p.requires_grad]
    ordered = trainable + [p for p in frozen if id(p) not in quantized] + [p for p in frozen if id(p) in quantized]
    spans, groups, offset = [], [], 0
    for p in ordered:
        fmt = quantized.get(id(p))
        if fmt is not None:
            offset += offset % 2  # a quantized span's fp32 scales start 4-byte aligned
            spans.append(Span(p, offset, p.numel(), p.shape, fmt, stored_elements(fmt, p.shape)))
            offset += spans[-1].stored
            continue
        spans.append(Span(p, offset, p.numel(), p.shape))
        if p.requires_grad:
            g = group_of(p)
            if groups and groups[-1][0] == g:
                groups[-1] = (g, groups[-1][1], offset + p.numel())
            else:
                groups.append((g, offset, offset + p.numel()))
        offset += p.numel()
    return Unit(index, tuple(spans), len(trainable), tuple(groups))


def plan_layout(model: nn.Module, offload_all: bool, group_of: GroupOf = lambda p: 0,
                resident_layers: int = 0, base_dtype: str | None = None) -> Layout:
    """Find the model's layer stacks and lay out every streamed parameter (`group_of`: its param group).
    The lowest `resident_layers` of each stack stay on the device, stepped there. `base_dtype`: the frozen
    linear weights of the streamed layers are held in that format (offload_ext.models.quantized_base)."""
    found = find_layer_stacks(model)
    if not found:
        raise ValueError(
            f"Offloader: found no layer stack in {type(model).__name__}: expected an nn.ModuleList or "
            "nn.Sequential of two or more layers of one type (like model.model.layers in HF Llama)")
    shortest = min(len(stack) for _, stack in found)
    if not 0 <= resident_layers < shortest:
        raise ValueError(f"Offloader: resident_layers must be in [0, {shortest - 1}] (each stack keeps at least "
                         f"one streamed layer; the shortest has {shortest}), got {resident_layers}")
    stacks, resident, index = [], [], 0
    for name, stack in found:
        resident += list(stack)[:resident_layers]
        layers = tuple(stack)[resident_layers:]
        units = []
        for layer in layers:
            units.append(_unit(index, list(layer.parameters()), group_of, _quantized(layer, base_dtype)))
            index += 1
        stacks.append(Part(name, layers, tuple(units)))
    streamed = {id(p) for part in stacks for layer in part.layers for p in layer.parameters()}
    kept = {id(p) for layer in resident for p in layer.parameters()}
    rest = [p for p in model.parameters() if id(p) not in streamed and id(p) not in kept]
    on_device = tuple(p for layer in resident for p in layer.parameters())
    if offload_all and rest:
        outside = Part("outside the stacks", (), (_unit(index, rest, group_of),))
        return Layout(tuple(stacks), outside, on_device, tuple(resident))
    return Layout(tuple(stacks), None, on_device + tuple(rest), tuple(resident))


def _quantized(layer: nn.Module, base_dtype: str | None) -> dict[int, str]:
    """The layer's frozen linear weights that `base_dtype` holds (those of a shape it can), by parameter id."""
    if base_dtype is None:
        return {}
    return {id(m.weight): base_dtype for m in quantized_linears(layer, base_dtype)}


def speculative_units(layout: Layout) -> frozenset[int]:
    """The units whose host steps may run speculatively under clipping (they get second state buffers):
    every layer of each stack that is mostly trained. The lowest lands last, with the norm taken on the device
    just before its copy: its step is queued as the copy lands and held once the norm is known, so it steps
    once, in place, without the host pass a unit waiting for the norm makes first (B1: 2 ms at the end of
    backward). The part outside the stacks lands after it: it waits for the norm and steps once, clipped.
    A layer whose buffer is mostly frozen (a LoRA/PEFT base) waits for the norm too: its second params buffer
    would copy the whole base (70 B with an int8 base: 39 GB of the host) to hide a step of its adapters alone,
    a pass over a few per mille of its weights."""
    return frozenset(u.index for part in layout.stacks for u in part.units if 2 * u.trainable_numel >= u.numel)


def device_redo_units(layout: Layout, per_stack: int) -> frozenset[int]:
    """The top `per_stack` units of each stack, whose clipped redo runs on the device (offload_ext.engine.device_redo):
    the next forward needs them last, so the host redoes the ones below from the lowest up meanwhile."""
    return frozenset(u.index for part in layout.stacks for u in part.units[len(part.units) - per_stack:])
