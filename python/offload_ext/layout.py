"""Layout: the frozen plan of what the Offloader streams, fixed once before any buffer exists.

Names used throughout the Offloader:
- a *unit* is one group of parameters stepped together on the host: one streamed layer, or (with
  offload_all) every parameter outside the stacks; `Unit.index` is its one global id, the backend's too;
- a *span* is one parameter's place in its unit's flat buffers (trainable spans first, then frozen);
- a *position* is a layer's place in its stack (forward order).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .stacks import find_layer_stacks


@dataclass(frozen=True, eq=False)
class Span:
    param: nn.Parameter
    offset: int
    numel: int
    shape: torch.Size


@dataclass(frozen=True, eq=False)
class Unit:
    index: int
    spans: tuple[Span, ...]   # trainable first, then frozen
    trainable: int            # how many spans are trainable

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.spans)

    @property
    def trainable_numel(self) -> int:
        return sum(s.numel for s in self.trainable_spans)

    @property
    def trainable_spans(self) -> tuple[Span, ...]:
        return self.spans[: self.trainable]


@dataclass(frozen=True, eq=False)
class Group:
    """A stack of layers (one unit per layer, in forward order), or the parameters outside the stacks."""

    name: str
    layers: tuple[nn.Module, ...]   # the streamed layers; empty for the group outside the stacks
    units: tuple[Unit, ...]


@dataclass(frozen=True, eq=False)
class Layout:
    stacks: tuple[Group, ...]
    outside: Group | None                 # offload_all: the rest as one more host-stepped unit
    device_params: tuple[nn.Parameter, ...]  # otherwise the rest stays on the device, with a device AdamW

    @property
    def groups(self) -> tuple[Group, ...]:
        return self.stacks + ((self.outside,) if self.outside is not None else ())

    @property
    def units(self) -> list[Unit]:
        return [u for g in self.groups for u in g.units]


def _unit(index: int, params: list[nn.Parameter]) -> Unit:
    ordered = [p for p in params if p.requires_grad] + [p for p in params if not p.requires_grad]
    spans, offset = [], 0
    for p in ordered:
        spans.append(Span(p, offset, p.numel(), p.shape))
        offset += p.numel()
    return Unit(index, tuple(spans), sum(p.requires_grad for p in params))


def plan_layout(model: nn.Module, offload_all: bool) -> Layout:
    """Find the model's layer stacks and lay out every streamed parameter."""
    found = find_layer_stacks(model)
    if not found:
        raise ValueError(
            f"Offloader: found no layer stack in {type(model).__name__}: expected an nn.ModuleList or "
            "nn.Sequential of two or more layers of one type (like model.model.layers in HF Llama)")
    stacks, index = [], 0
    for name, stack in found:
        units = []
        for layer in stack:
            units.append(_unit(index, list(layer.parameters())))
            index += 1
        stacks.append(Group(name, tuple(stack), tuple(units)))
    streamed = {id(p) for _, s in found for p in s.parameters()}
    rest = [p for p in model.parameters() if id(p) not in streamed]
    if offload_all and rest:
        return Layout(tuple(stacks), Group("outside the stacks", (), (_unit(index, rest),)), ())
    return Layout(tuple(stacks), None, tuple(rest))
