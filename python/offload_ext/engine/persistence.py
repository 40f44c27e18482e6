"""The Offloader's state and weights in and out: state_dict / save_state (the host buffers and the device's tensors
written straight from where they live, the rest beside them), their loads (everything checked before anything is
written), and the model's weights as transformers writes and reads them (save_pretrained, from_pretrained,
from_config)."""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from offload_ext.config import OffloadConfig, resolve_device
from offload_ext.engine.state import (
    check_state,
    host_sources,
    host_state,
    load_host_state,
    model_weights,
    read_host_state,
    span_names,
    weight_sources,
)
from offload_ext.models.safetensors_io import SafetensorsCheckpoint, write_safetensors
from offload_ext.models.weights import from_config_empty, from_pretrained_empty

if TYPE_CHECKING:
    from offload_ext.engine.offloader import Offloader

_CONSTRUCTOR_ARGS = ("lr", "betas", "eps", "weight_decay", "groups", "no_decay", "batch_shape")
# save_state's files: engine_state.safetensors (the host buffers), engine_device.safetensors (the device optimizer's
# parameters and state), engine_state.pt (the rest, no tensors).
_STATE_STEM = "engine_state"
_DEVICE_STEM = "engine_device"
STATE_FILE = _STATE_STEM + ".pt"  # written last: a directory with it holds a whole state


class StateIO:
    """Offloader's persistence, a mixin: it reads the Offloader's host buffers, layout, groups and device
    optimizer, and settles the engine (`_settle`) before touching them."""

    @classmethod
    def from_pretrained(cls, name_or_path: str, **kwargs: Any) -> Offloader:
        """An Offloader over a causal LM's safetensors checkpoint (a local directory or a hub id), read
        tensor by tensor straight into the host buffers and the device: the model is built on the meta
        device and the weights are never whole in memory twice. The model is `off.model`; keyword
        arguments are the constructor's."""
        model, weights = from_pretrained_empty(name_or_path)
        return cls(model, weights=weights, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        self._check_open()
        self._settle()
        return {**self._small_state(self._device_opt.state_dict()), "layers": host_state(self._host)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_open()
        self._settle()
        self._check_small_state(state)
        load_host_state(self._host, state["layers"])
        self._load_small_state(state)

    def save_state(self, path: str) -> None:
        """state_dict() written to a directory without a copy of the state in memory: the host buffers go to
        engine_state.safetensors straight from where they live, the device optimizer's tensors to
        engine_device.safetensors one at a time, the rest (step, groups) to engine_state.pt. load_state(path)
        reads it back."""
        self._check_open()
        self._settle()
        write_safetensors(path, host_sources(self._host), stem=_STATE_STEM)
        write_safetensors(path, self._device_opt.tensor_sources(), stem=_DEVICE_STEM)
        small = os.path.join(path, STATE_FILE)
        torch.save(self._small_state(self._device_opt.skeleton()), small + ".partial")
        os.replace(small + ".partial", small)

    def saved_nbytes(self, weights: bool = True, include: Callable[[str], bool] | None = None) -> int:
        """The tensor bytes save_state (and, with `weights`, save_pretrained) would write now: what a checkpoint of
        this Offloader takes on disk, its small files aside; with `include`, of the weights only the names it
        accepts count (model_state_dict's filter: a LoRA adapter saved alone). Nothing is copied. The device
        optimizer's state counts once it exists (after the first step)."""
        self._check_open()
        sources = [*host_sources(self._host), *self._device_opt.tensor_sources()]
        if weights:
            sources += [(name, source) for name, source in weight_sources(self.model, self.layout, self._host)
                        if include is None or include(name)]
        return sum(source.nbytes for _, source in sources)

    def load_state(self, path: str) -> None:
        """Restore what save_state(path) wrote, reading the host buffers and the device's tensors straight
        into place; everything is checked against this Offloader before any of it is written. A directory
        written before the device's tensors had a file of their own (engine_state.pt holding them) loads too."""
        self._check_open()
        self._settle()
        # weights_only: a state file is data; unpickling arbitrary objects from it could run code.
        state = torch.load(os.path.join(path, STATE_FILE), weights_only=True)
        self._check_small_state(state)
        device = SafetensorsCheckpoint(path, stem=_DEVICE_STEM) if state["outer"].get("streamed") else None
        if device is not None:
            self._device_opt.check_streamed(device)
        read_host_state(self._host, SafetensorsCheckpoint(path, stem=_STATE_STEM))
        self._load_small_state(state, device)

    def _small_state(self, outer: dict[str, Any]) -> dict[str, Any]:
        """Everything but the host buffers; `outer`: the device optimizer's state (or its skeleton)."""
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        return {"step": self._step, "precision": self.precision, "param_groups": groups,
                "spans": span_names(self.model, self.layout), "outer": outer, "sr_seed": self._sr_seed}

    def _check_small_state(self, state: dict[str, Any]) -> None:
        check_state(state, self.precision, span_names(self.model, self.layout), len(self.param_groups), self._sr_seed)

    def _load_small_state(self, state: dict[str, Any], device: SafetensorsCheckpoint | None = None) -> None:
        if device is None:
            self._device_opt.load_state_dict(state["outer"])
        else:
            self._device_opt.load_streamed(state["outer"], device)
        self._step = int(state["step"])
        for group, saved in zip(self.param_groups, state["param_groups"]):
            group.update(saved)
        self._restart_rings(stepped=False)

    @classmethod
    def from_config(cls, model_config: Any, seed: int = 0, config: OffloadConfig | None = None,
                    **kwargs: Any) -> Offloader:
        """An Offloader over a fresh causal LM of a transformers config: built on the meta device, each
        module's weights drawn by the model's own init rule straight into the host buffers and the device,
        the model never whole on the CPU. `seed` fixes the draw; keyword arguments are the constructor's."""
        optimizer = {k: kwargs.pop(k) for k in _CONSTRUCTOR_ARGS if k in kwargs}
        cfg = OffloadConfig.from_options(config, **kwargs)
        # Drawn on the training device: a GPU draws an 8 B model's parameters in seconds, the CPU in minutes.
        model, weights = from_config_empty(model_config, seed=seed, device=resolve_device(cfg.device))
        return cls(model, config=cfg, weights=weights, **optimizer)

    def save_pretrained(self, path: str, max_shard_size: int = 5 << 30) -> list[str]:
        """Write the model as transformers does (config.json, safetensors shards of at most max_shard_size
        bytes and their index), straight from where the weights live: one tensor in memory at a time,
        each file complete under its name or not there. `AutoModelForCausalLM.from_pretrained(path)`
        and `Offloader.from_pretrained(path)` load it. Returns the weight files written."""
        self._settle()
        files = write_safetensors(path, weight_sources(self.model, self.layout, self._host), max_shard_size)
        self.model.config.save_pretrained(path)
        generation = getattr(self.model, "generation_config", None)
        if generation is not None:
            generation.save_pretrained(path)
        return files

    def model_state_dict(self, include: Callable[[str], bool] | None = None) -> dict[str, torch.Tensor]:
        """The model's weights by name, as CPU tensors (streamed ones read from the host buffers); with
        `include`, only the names it accepts are copied (a LoRA adapter out of a large model)."""
        self._settle()
        return model_weights(self.model, self.layout, self._host, include)
