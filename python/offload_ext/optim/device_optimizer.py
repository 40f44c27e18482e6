"""Device optimizer: the parameters outside the stacks, kept on the device and stepped there by
torch's fused AdamW (on fp32 masters in "mixed"; in "bf16-sr" stored by stochastic rounding, the host
kernel's rule in torch ops), with the hyperparameters of each one's group."""
from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from offload_ext.models.safetensors_io import SafetensorsCheckpoint, TensorSource
from offload_ext.optim.cpu_adamw import StochasticAdamW
from offload_ext.optim.stochastic_rounding import DEVICE_STREAMS


class DeviceOptimizer:
    def __init__(self, params: tuple[nn.Parameter, ...], model: nn.Module, device: torch.device,
                 precision: str, hypers: list[dict[str, Any]], group_of: Callable[[nn.Parameter], int],
                 sr_seed: int = 0) -> None:
        self.params = params
        self.mixed = precision == "mixed"
        self.trainable = [p for p in params if p.requires_grad]
        self.masters = [p.detach().to(device, torch.float32, copy=True) for p in self.trainable] if self.mixed else []
        for p in params:
            p.data = p.data.to(device, torch.bfloat16)
        model.to(device)  # buffers; the streamed parameters are already device placeholders
        stepped = self.masters if self.mixed else self.trainable
        by_group: dict[int, list[torch.Tensor]] = {}
        for p, s in zip(self.trainable, stepped):
            by_group.setdefault(group_of(p), []).append(s)
        self.groups = sorted(by_group)  # the Offloader's group index of each torch group
        torch_groups = [{"params": by_group[g], **hypers[g]} for g in self.groups]
        if not torch_groups:
            self.opt = None
        elif precision == "bf16-sr":  # streams past the host units', which count from 0
            self.opt = StochasticAdamW(torch_groups, seed=sr_seed, first_stream=DEVICE_STREAMS)
        else:
            self.opt = torch.optim.AdamW(torch_groups, fused=True)

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def step(self, hypers: list[dict[str, Any]]) -> None:
        if self.opt is None:
            return
        for g, torch_group in zip(self.groups, self.opt.param_groups):
            torch_group.update(hypers[g])
        if not self.mixed:
            self.opt.step()
            return
        for p, m in zip(self.trainable, self.masters):
            m.grad = p.grad.float() if p.grad is not None else None
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.trainable, self.masters):
                p.copy_(m)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        for m in self.masters:
            m.grad = None

    def state_dict(self) -> dict[str, Any]:
        """Copies on the host, not views: the state must not change when training goes on, and a copy on the
        device would need room there beside the moments (what would otherwise bound the resident layers under a
        cap). load_state_dict moves them back, as torch's optimizers do."""
        return {
            "params": [p.detach().to("cpu", copy=True) for p in self.params],
            "masters": [m.detach().to("cpu", copy=True) for m in self.masters],
            "optimizer": _on_host(self.opt.state_dict()) if self.opt is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for p, saved in zip(self.params, state["params"]):
                p.copy_(saved)
            for m, saved in zip(self.masters, state["masters"]):
                m.copy_(saved)
        if self.opt is not None and state["optimizer"] is not None:
            self.opt.load_state_dict(state["optimizer"])

    # save_state's form: the tensors stream into a safetensors file one at a time, so a checkpoint never holds
    # the device's whole state on the host (an 8 B model's embeddings and resident layers: 13 GB in bf16, 30 in
    # mixed); the rest, tensor-free, goes into the small state file.

    def tensor_sources(self) -> list[tuple[str, TensorSource]]:
        """Every tensor of state_dict() by name, each copied off the device only when its turn to be written
        comes."""
        return [(name, TensorSource(t.dtype, tuple(t.shape), lambda t=t: t.cpu().contiguous()))
                for name, t in self._named_tensors()]

    def skeleton(self) -> dict[str, Any]:
        """state_dict() without its tensors: what load_streamed needs beside the file of tensor_sources()."""
        if self.opt is None:
            return {"streamed": True, "optimizer": None}
        state = self.opt.state_dict()
        return {"streamed": True, "optimizer": {
            "state": {i: {k: copy.deepcopy(v) for k, v in entries.items() if not isinstance(v, torch.Tensor)}
                      for i, entries in state["state"].items()},
            "param_groups": copy.deepcopy(state["param_groups"])}}

    def check_streamed(self, checkpoint: SafetensorsCheckpoint) -> None:
        """Raise ValueError, before anything is written, unless `checkpoint` holds this optimizer's tensors: its
        parameters and masters by name and shape, and optimizer state only for parameters it steps."""
        live = dict(self._named_tensors(with_optimizer=False))
        saved_live = {n: e for n, e in checkpoint.entries.items() if not n.startswith("optimizer.")}
        if set(saved_live) != set(live):
            raise ValueError(f"Offloader: {checkpoint.path} holds {len(saved_live)} device tensors, this Offloader "
                             f"has {len(live)}: was the state made for another model or precision?")
        stepped = self._stepped()
        for name, entry in checkpoint.entries.items():
            expected = self._saved_shape(name, live, stepped)
            scalar_state = name.startswith("optimizer.") and entry.shape == ()  # a step count
            if expected is None or (entry.shape != expected and not scalar_state):
                raise ValueError(f"Offloader: saved {name} is {list(entry.shape)}, which this Offloader's device "
                                 "parameters do not hold: was the state made for another model?")

    def load_streamed(self, skeleton: dict[str, Any], checkpoint: SafetensorsCheckpoint) -> None:
        """Read back what tensor_sources() wrote (checked by check_streamed) into the live tensors and the
        optimizer's state, a tensor at a time."""
        with torch.no_grad():
            for name, t in self._named_tensors(with_optimizer=False):
                checkpoint.copy_into(checkpoint.entries[name], t)
        if self.opt is None or skeleton["optimizer"] is None:
            return
        stepped = self._stepped()
        state: dict[int, dict[str, Any]] = {int(i): dict(v) for i, v in skeleton["optimizer"]["state"].items()}
        for name, entry in checkpoint.entries.items():
            if name.startswith("optimizer."):
                _, i, key = name.split(".", 2)
                value = self._state_target(stepped[int(i)], key, entry.shape, entry.dtype)
                checkpoint.copy_into(entry, value)
                state.setdefault(int(i), {})[key] = value
        self.opt.load_state_dict({"state": state, "param_groups": skeleton["optimizer"]["param_groups"]})

    def _state_target(self, param: torch.Tensor, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Where a saved optimizer state tensor is read into: the live one when it matches (an optimizer that has
        stepped keeps its moments, so a load never holds two sets on the device; torch's load_state_dict keeps a
        tensor already of its parameter's device and dtype), else a new one."""
        live = self.opt.state.get(param, {}).get(key)
        if isinstance(live, torch.Tensor) and tuple(live.shape) == shape and live.dtype == dtype and shape:
            return live
        # A scalar (the step count) stays on the CPU: torch's load_state_dict moves it where its rule says.
        return torch.empty(shape, dtype=dtype, device=param.device if shape else torch.device("cpu"))

    def _stepped(self) -> list[torch.Tensor]:
        """The tensors the torch optimizer steps, in the order its state_dict numbers them."""
        return [p for g in self.opt.param_groups for p in g["params"]] if self.opt is not None else []

    def _named_tensors(self, with_optimizer: bool = True) -> list[tuple[str, torch.Tensor]]:
        named = [(f"params.{i}", p.detach()) for i, p in enumerate(self.params)]
        named += [(f"masters.{i}", m.detach()) for i, m in enumerate(self.masters)]
        if with_optimizer and self.opt is not None:
            named += [(f"optimizer.{i}.{k}", v.detach()) for i, entries in self.opt.state_dict()["state"].items()
                      for k, v in entries.items() if isinstance(v, torch.Tensor)]
        return named

    @staticmethod
    def _saved_shape(name: str, live: dict[str, torch.Tensor], stepped: list[torch.Tensor]) -> tuple[int, ...] | None:
        """The shape a saved tensor must have here, None where this optimizer has no such tensor."""
        if name in live:
            return tuple(live[name].shape)
        parts = name.split(".")  # optimizer.<index>.<state key>
        if len(parts) != 3 or parts[0] != "optimizer" or not parts[1].isdigit() or int(parts[1]) >= len(stepped):
            return None
        return tuple(stepped[int(parts[1])].shape)


def _on_host(state: dict[str, Any]) -> dict[str, Any]:
    """A torch optimizer's state_dict with each state tensor copied to the CPU."""
    per_param = {i: {k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                     for k, v in entries.items()} for i, entries in state["state"].items()}
    return {"state": per_param, "param_groups": copy.deepcopy(state["param_groups"])}

