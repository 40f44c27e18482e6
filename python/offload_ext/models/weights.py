"""Weights: where a model's meta parameters get their values when the engine's buffers for them exist: a
safetensors checkpoint read under transformers' own key conversions for the model (CheckpointWeights), or
fresh draws by the model's own init rule, a function of the seed and the model alone (InitWeights),
both behind one interface (WeightSource); and the model built with its parameters on the meta device.
So the weights are never whole in memory twice.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import os
import threading
from collections import defaultdict
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import nn

from offload_ext.models.safetensors_io import SafetensorsCheckpoint, TensorEntry

_META_LOCK = threading.Lock()  # parameters_on_meta patches nn.Module for the whole process


class WeightSource(Protocol):
    """Values for a model's meta parameters, each given when the buffer that will hold it exists."""

    thread_safe: bool  # fill() may run on several threads at once (for different parameters)

    def fill(self, param: nn.Parameter, dst: torch.Tensor) -> None: ...

    def value(self, param: nn.Parameter, device: torch.device | str) -> torch.Tensor:
        """The parameter's values as a tensor on `device` (for parameters kept there)."""
        ...


def filled_on(weights: WeightSource, param: nn.Parameter, device: torch.device | str,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """`value` by way of a host tensor that `fill` writes (for sources that read or make values on the CPU)."""
    host = torch.empty(param.shape, dtype=dtype or param.dtype)
    weights.fill(param, host)
    return host.to(device)


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
                self._values = self._run(functools.partial(_read, self.checkpoint))
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


def _read(checkpoint: SafetensorsCheckpoint, entry: TensorEntry) -> torch.Tensor:
    out = torch.empty(entry.shape, dtype=entry.dtype)
    checkpoint.read_into(entry, out)
    return out


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


class InitWeights:
    """Fresh weights by the model's own rule, as transformers' initialize_weights applies it: a module's
    parameters are made real on `device` and given its `_init_weights`, then each of its ancestors' (as the
    post-order walk does: GPT-2's attention and MLP blocks redraw their `c_proj` with the depth-scaled std),
    in the model's dtype, and handed out one by one, so at most one module's are held at once. Each module
    draws from its own seed, a hash of `seed` and its name, so the values are a function of the seed and the
    model alone, whatever order a layout fills them in (resident layers, offload_all), and of the device kind
    that drew them. A GPU draws 8 B parameters in well under a second, where the CPU's generator (one thread)
    took minutes (run 35)."""

    thread_safe = False  # a module is drawn whole, with the process's RNG

    def __init__(self, model: nn.Module, seed: int = 0, device: torch.device | str = "cpu") -> None:
        if not hasattr(model, "_init_weights"):
            raise ValueError(f"InitWeights: {type(model).__name__} has no _init_weights (a transformers model has)")
        self.model = model
        self.seed = seed
        self.device = torch.device(device)
        self.owner: dict[int, tuple[str, nn.Module]] = {}
        for name, module in model.named_modules():
            for p in module._parameters.values():
                if p is not None and p.is_meta:
                    self.owner.setdefault(id(p), (name, module))
        self._ready: dict[int, torch.Tensor] = {}  # drawn with their module, not handed out yet

    def _draw(self, name: str, module: nn.Module) -> None:
        metas = {n: p for n, p in module._parameters.items() if p is not None and p.is_meta}
        real = {n: nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=self.device), requires_grad=p.requires_grad)
                for n, p in metas.items()}
        module._parameters.update(real)
        cuda = [self.device.index if self.device.index is not None else torch.cuda.current_device()] \
            if self.device.type == "cuda" else []
        # The process's RNG states are put back afterwards: drawing leaves the training's own RNG untouched.
        with torch.random.fork_rng(devices=cuda), torch.no_grad():
            torch.manual_seed(module_seed(self.seed, name))
            try:
                for init, target in self._init_chain(name):
                    init(target)
            finally:
                module._parameters.update(metas)  # the meta objects stay the model's until filled
        for n, p in metas.items():
            self._ready[id(p)] = real[n].data

    def _init_chain(self, name: str) -> list[tuple[Any, nn.Module]]:
        """The module `name` and its ancestors, innermost first, each with the `_init_weights` transformers
        gives it (that of the nearest pretrained model holding it: a composite's parts have their own). An
        ancestor's rule touches only this module's parameters here: every other one is still on the meta
        device, where a draw is a no-op."""
        parts = name.split(".") if name else []
        chain = [self.model.get_submodule(".".join(parts[:k])) for k in range(len(parts), -1, -1)]
        from transformers import PreTrainedModel

        out = []
        for k, module in enumerate(chain):
            owner = next((m for m in chain[k:] if isinstance(m, PreTrainedModel)), self.model)
            out.append((owner._init_weights, module))
        return out

    def _take(self, param: nn.Parameter) -> torch.Tensor:
        if id(param) not in self._ready:
            self._draw(*self.owner[id(param)])
        return self._ready.pop(id(param))

    def fill(self, param: nn.Parameter, dst: torch.Tensor) -> None:
        dst.view(-1).copy_(self._take(param).reshape(-1))

    def value(self, param: nn.Parameter, device: torch.device | str) -> torch.Tensor:
        # Drawn on the training device already: no round trip through the host (1.9 s for the 8 B
        # shape's two 1 GB embeddings on the GPU machine).
        return self._take(param).to(device)


def module_seed(seed: int, name: str) -> int:
    """The seed module `name` draws its initial weights from: a hash of the run's seed and the name, so no
    module's values depend on which others were drawn before it."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2  # torch.manual_seed takes below 2**63


def materialize(weights: WeightSource, param: nn.Parameter, device: torch.device | str) -> None:
    """Give a meta parameter its values from `weights` on `device`."""
    make_real(param, weights.value(param, device))


def make_real(param: nn.Parameter, value: torch.Tensor) -> None:
    """Turn a meta parameter into one holding `value`, keeping the Parameter object (which layouts, tied
    modules and optimizers hold): `.data` cannot move a tensor off the meta device, a swap can."""
    torch.utils.swap_tensors(param, nn.Parameter(value, requires_grad=param.requires_grad))


def dtype_keyword() -> str:
    """from_pretrained's dtype argument: `dtype` since transformers 4.56 (`torch_dtype` warns there)."""
    import transformers
    from packaging.version import Version

    return "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"


def check_materialized(model: nn.Module, weights: WeightSource | None) -> None:
    """Refuse a model with parameters on the meta device unless `weights` hold their values."""
    if weights is not None:
        return
    meta = [name for name, p in model.named_parameters() if p.is_meta]
    if meta:
        raise ValueError(f"Offloader: {len(meta)} parameters are on the meta device (e.g. {meta[0]!r}) and no "
                         "weights= hold their values: build with Offloader.from_pretrained(path), or load the model "
                         "before offloading it")


def from_config_empty(config: Any, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                      device: torch.device | str = "cpu") -> tuple[nn.Module, InitWeights]:
    """A causal LM of `config` with its parameters on the meta device, and fresh weights for them drawn
    by its own init rule on `device`."""
    from transformers import AutoModelForCausalLM

    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, **{dtype_keyword(): dtype})
    return model, InitWeights(model, seed, device)


def from_pretrained_empty(name_or_path: str,
                          dtype: torch.dtype = torch.bfloat16) -> tuple[nn.Module, CheckpointWeights]:
    """A causal LM built from its config with its parameters on the meta device, and the checkpoint's
    weights for them: a local directory, or a hub id (only its config and safetensors are fetched)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = name_or_path
    if not os.path.isdir(path) and not os.path.isfile(path):
        from huggingface_hub import snapshot_download

        path = snapshot_download(name_or_path, allow_patterns=["*.json", "*.safetensors"])
    checkpoint = SafetensorsCheckpoint(path)  # raises first when there are no safetensors
    config = AutoConfig.from_pretrained(path)
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, **{dtype_keyword(): dtype})
    return model, CheckpointWeights(checkpoint, model)


def tile_random(flat: torch.Tensor, block: torch.Tensor, gen: torch.Generator) -> None:
    """Fill `flat` with copies of `block` (pre-drawn random values), each starting at a random place in
    it: random-looking weights at memory-copy speed, where drawing every value (normal_) takes tens of
    seconds per billion parameters."""
    done = 0
    while done < flat.numel():
        start = int(torch.randint(0, block.numel(), (1,), generator=gen))
        n = min(block.numel() - start, flat.numel() - done)
        flat[done:done + n].copy_(block[start:start + n])
        done += n


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Inside, modules register their parameters on the meta device (shape, dtype and requires_grad
    kept, no memory); buffers stay real, so values computed at construction (rotary frequencies) hold."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)

    with _META_LOCK:
        nn.Module.register_parameter = register
        try:
            yield
        finally:
            nn.Module.register_parameter = original
