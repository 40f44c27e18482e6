"""CheckpointWeights: a model's meta parameters filled from a safetensors checkpoint, read under transformers'
own key conversions for the model (renamings, and fusions or splits of several tensors), each parameter found
and shape-checked before anything is allocated."""
from __future__ import annotations

import copy
import functools
import threading
from collections import defaultdict
from typing import Any

import torch
from torch import nn

from offload_ext.models.safetensors_io import SafetensorsCheckpoint, TensorEntry
from offload_ext.models.weight_source import filled_on


class CheckpointWeights:
    """The values of a model's meta parameters, from a checkpoint, under the names and in the layout the
    model has: transformers' own conversion mapping for the model (renamings such as GPT-NeoX's `embed_out`,
    fusions such as Mixtral's per-expert `w1`/`w3` into `gate_up_proj`) is applied as from_pretrained applies
    it. Every parameter is looked up (by any of its names, for tied ones) and a renamed one shape-checked
    when this is built, before anything is allocated."""

    thread_safe = True  # each read opens the file for itself; a conversion runs under its own lock

    def __init__(self, checkpoint: SafetensorsCheckpoint, model: nn.Module) -> None:
        self.checkpoint = checkpoint
        names: dict[int, list[str]] = defaultdict(list)
        params: dict[int, nn.Parameter] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            names[id(p)].append(name)
            params[id(p)] = p
        plan = conversion_plan(checkpoint, model)
        self._entries = {pid: _planned(checkpoint, plan, names[pid], p.shape) for pid, p in params.items() if p.is_meta}

    def fill(self, param: nn.Parameter, dst: torch.Tensor) -> None:
        """Write the parameter's values into a contiguous CPU tensor of its size, in dst's dtype."""
        entry = self._entries[id(param)]
        if isinstance(entry, TensorEntry):
            self.checkpoint.read_into(entry, dst)
        else:
            value = entry.take()
            if value.shape != param.shape:
                raise ValueError(f"{self.checkpoint.path}: the tensors for {entry.target!r} convert to shape "
                                 f"{list(value.shape)}, the model's parameter is {list(param.shape)}")
            dst.view(-1).copy_(value.reshape(-1))

    def value(self, param: nn.Parameter, device: torch.device | str) -> torch.Tensor:
        return filled_on(self, param, device)


class _Converted:
    """One parameter that transformers makes from several checkpoint tensors (an MoE layer's experts fused),
    or one of several it cuts from one: the model's WeightConverter, fed readers of the source tensors, runs
    when the first of its targets is filled; the other targets' values are held until theirs are. So the
    most held at once is one converter's sources and results, never the model."""

    def __init__(self, group: _ConverterRun, target: str) -> None:
        self.group, self.target = group, target

    def take(self) -> torch.Tensor:
        return self.group.take(self.target)


class _ConverterRun:
    def __init__(self, converter: Any, layer_name: str, model: nn.Module, checkpoint: SafetensorsCheckpoint) -> None:
        self.converter, self.layer_name, self.model, self.checkpoint = converter, layer_name, model, checkpoint
        self.sources: list[tuple[str, str, TensorEntry]] = []  # (checkpoint key, source pattern, entry)
        self._lock = threading.Lock()
        self._values: dict[str, torch.Tensor] | None = None
        self._shapes: dict[str, tuple[int, ...]] | None = None

    def _run(self, read: Any) -> dict[str, torch.Tensor]:
        converter = copy.deepcopy(self.converter)  # convert() consumes what it collected
        for key, pattern, entry in self.sources:
            converter.add_tensor(self.layer_name, key, pattern, functools.partial(read, entry))
        out = converter.convert(self.layer_name, model=self.model, config=self.model.config)
        return {k: v[0] if isinstance(v, list) else v for k, v in out.items()}

    def shapes(self) -> dict[str, tuple[int, ...]] | None:
        """What the conversion gives, by target name and shape, from the sources' shapes alone (run on the
        meta device): checked before anything is allocated. None where an operation needs the values."""
        if self._shapes is None:
            try:
                self._shapes = {k: tuple(v.shape) for k, v in self._run(_on_meta).items()}
            except (NotImplementedError, RuntimeError):
                return None
        return self._shapes

    def take(self, target: str) -> torch.Tensor:
        with self._lock:
            if self._values is None:
                self._values = self._run(self.checkpoint.read)
            return self._values.pop(target)


def conversion_plan(checkpoint: SafetensorsCheckpoint, model: nn.Module) -> dict[str, TensorEntry | _Converted]:
    """Each of the model's tensor names -> the checkpoint entry it is read from, or the conversion that makes
    it; by transformers' get_model_conversion_mapping and rename_source_key, in from_pretrained's order
    (checkpoint keys sorted naturally, so experts stack as 0, 1, ..., 10)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    if not hasattr(model, "base_model_prefix"):  # not a transformers model: its names are the checkpoint's
        return dict(checkpoint.entries)
    mapping = get_model_conversion_mapping(model)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    wanted = dict.fromkeys(model.state_dict(keep_vars=True))
    prefix = model.base_model_prefix
    plan: dict[str, TensorEntry | _Converted] = {}
    for key in sorted(checkpoint.entries, key=dot_natural_key):
        entry = checkpoint.entries[key]
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, wanted)
        if renamed not in wanted and key in wanted:
            renamed, pattern = rename_source_key(key, [], [], prefix, wanted)
        if renamed not in wanted:
            continue  # a tensor the model has no place for: from_pretrained reports it and goes on too
        if pattern is None:
            plan[renamed] = entry
            continue
        if renamed not in plan:
            run = _ConverterRun(by_pattern[pattern], renamed, model, checkpoint)
            first = run.converter.target_patterns[0]
            for target in run.converter.target_patterns:
                plan[renamed.replace(first, target, 1)] = _Converted(run, renamed.replace(first, target, 1))
        plan[renamed].group.sources.append((key, pattern, entry))
    return plan


def _on_meta(entry: TensorEntry) -> torch.Tensor:
    return torch.empty(entry.shape, dtype=entry.dtype, device="meta")


def _planned(checkpoint: SafetensorsCheckpoint, plan: dict[str, TensorEntry | _Converted], names: list[str],
             shape: torch.Size) -> TensorEntry | _Converted:
    """Where the parameter called `names` (a tied one has several) comes from; raises, naming them, when
    nothing in the checkpoint makes it or a tensor read as it is has another shape."""
    for name in names:
        found = plan.get(name)
        if found is None:
            continue
        if isinstance(found, _Converted) and found.group.shapes() is None:
            return found  # checked when it is converted
        got = found.shape if isinstance(found, TensorEntry) else found.group.shapes().get(found.target)
        if got != tuple(shape):
            raise ValueError(f"{checkpoint.path}: the tensor for {name!r} has shape {list(got or [])}, the model's "
                             f"parameter {list(shape)}: is the checkpoint for this config?")
        return found
    entries = checkpoint.entries
    raise KeyError(f"{checkpoint.path}: no tensor for the model's parameter {' / '.join(names)} (the checkpoint "
                   f"has {len(entries)} tensors, e.g. {', '.join(sorted(entries)[:3])})")
