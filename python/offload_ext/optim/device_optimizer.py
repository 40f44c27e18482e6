"""Device optimizer: the parameters outside the stacks, kept on the device and stepped there by
torch's fused AdamW (on fp32 masters in "mixed"; in "bf16-sr" stored by stochastic rounding, the host
kernel's rule in torch ops), with the hyperparameters of each one's group."""
from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

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


def _on_host(state: dict[str, Any]) -> dict[str, Any]:
    """A torch optimizer's state_dict with each state tensor copied to the CPU."""
    per_param = {i: {k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                     for k, v in entries.items()} for i, entries in state["state"].items()}
    return {"state": per_param, "param_groups": copy.deepcopy(state["param_groups"])}
