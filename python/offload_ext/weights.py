"""Weights: where a model's meta parameters get their values when the engine's buffers for them exist: a
safetensors checkpoint (CheckpointWeights), or fresh draws by the model's own init rule (InitWeights),
both behind one interface (WeightSource); and the model built with its parameters on the meta device.
So the weights are never whole in memory twice.
"""
from __future__ import annotations

import contextlib
import os
import threading
from collections import defaultdict
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import nn

from .checkpoint import SafetensorsCheckpoint

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
    """The values of a model's meta parameters, from a checkpoint: every one is looked up (by any of its
    names, for tied ones) and shape-checked when this is built, before anything is allocated."""

    thread_safe = True  # each read opens the file for itself

    def __init__(self, checkpoint: SafetensorsCheckpoint, model: nn.Module) -> None:
        self.checkpoint = checkpoint
        names: dict[int, list[str]] = defaultdict(list)
        params: dict[int, nn.Parameter] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            names[id(p)].append(name)
            params[id(p)] = p
        self._entries = {pid: checkpoint.entry_for(names[pid], p.shape) for pid, p in params.items() if p.is_meta}

    def fill(self, param: nn.Parameter, dst: torch.Tensor) -> None:
        """Write the parameter's values into a contiguous CPU tensor of its size, in dst's dtype."""
        self.checkpoint.read_into(self._entries[id(param)], dst)

    def value(self, param: nn.Parameter, device: torch.device | str) -> torch.Tensor:
        return filled_on(self, param, device)


class InitWeights:
    """Fresh weights by the model's own rule (its `_init_weights`, as transformers applies it to every
    module), drawn module by module in the model's dtype on `device`: a module's parameters are made real
    there, initialised together, and handed out one by one, so at most one module's are held at once.
    A GPU draws them in well under a second for 8 B parameters, where the CPU's generator (one thread)
    took minutes (run 35); the values depend on the seed and on the device kind that drew them."""

    thread_safe = False  # a module is drawn whole, with the process's RNG

    def __init__(self, model: nn.Module, seed: int = 0, device: torch.device | str = "cpu") -> None:
        if not hasattr(model, "_init_weights"):
            raise ValueError(f"InitWeights: {type(model).__name__} has no _init_weights (a transformers model has)")
        self.model = model
        self.device = torch.device(device)
        self.owner: dict[int, tuple[nn.Module, str]] = {}
        for module in model.modules():
            for name, p in module._parameters.items():
                if p is not None and p.is_meta:
                    self.owner.setdefault(id(p), (module, name))
        self._ready: dict[int, torch.Tensor] = {}  # drawn with their module, not handed out yet
        self._gen = torch.Generator().manual_seed(seed)

    def _draw(self, module: nn.Module) -> None:
        metas = {name: p for name, p in module._parameters.items() if p is not None and p.is_meta}
        real = {name: nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=self.device),
                                   requires_grad=p.requires_grad)
                for name, p in metas.items()}
        module._parameters.update(real)
        cuda = [self.device.index if self.device.index is not None else torch.cuda.current_device()] \
            if self.device.type == "cuda" else []
        # The module's own seed, drawn in module order: the process's RNG states are put back afterwards.
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(int(torch.randint(0, 1 << 62, (1,), generator=self._gen)))
            try:
                self.model._init_weights(module)
            finally:
                module._parameters.update(metas)  # the meta objects stay the model's until filled
        for name, p in metas.items():
            self._ready[id(p)] = real[name].data

    def _take(self, param: nn.Parameter) -> torch.Tensor:
        if id(param) not in self._ready:
            self._draw(self.owner[id(param)][0])
        return self._ready.pop(id(param))

    def fill(self, param: nn.Parameter, dst: torch.Tensor) -> None:
        dst.view(-1).copy_(self._take(param).reshape(-1))

    def value(self, param: nn.Parameter, device: torch.device | str) -> torch.Tensor:
        # Drawn on the training device already: no round trip through the host (1.9 s for the 8 B
        # shape's two 1 GB embeddings on the GPU machine).
        return self._take(param).to(device)


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
