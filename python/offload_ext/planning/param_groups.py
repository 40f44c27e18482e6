"""Parameter groups: which group each of the model's parameters belongs to, with which hyperparameters.

Group 0 holds every parameter no other group names, with the Offloader's own lr, betas, eps and
weight_decay. `groups` adds torch-style groups ({"params": [...], "lr": ..., ...}); `no_decay` adds one
more with weight_decay=0 for the parameters whose qualified name or owning module's class name
contains one of its strings (case-insensitive), as HF Trainer exempts biases and norm weights.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

HYPER_KEYS = ("lr", "betas", "eps", "weight_decay")


def _exempt(name: str, module: nn.Module, patterns: Sequence[str]) -> bool:
    haystacks = (name.lower(), type(module).__name__.lower())
    return any(p.lower() in h for p in patterns for h in haystacks)


def build_groups(model: nn.Module, groups: Sequence[dict[str, Any]] | None,
                 no_decay: Sequence[str]) -> tuple[list[dict[str, Any]], Callable[[nn.Parameter], int]]:
    """torch-style param groups over the model's trainable parameters (hyperparameters left out are the
    Offloader's), and the group index of any parameter."""
    known = {id(p) for p in model.parameters()}
    owner: dict[int, int] = {}
    specs: list[dict[str, Any]] = [{"params": []}]
    for k, group in enumerate(groups or [], start=1):
        unknown = set(group) - {"params", *HYPER_KEYS}
        if "params" not in group or unknown:
            raise ValueError(f"Offloader: groups[{k - 1}] must have 'params' and only {HYPER_KEYS} besides, got "
                             f"keys {sorted(group)}")
        for p in group["params"]:
            if id(p) not in known:
                raise ValueError(f"Offloader: groups[{k - 1}] names a tensor that is not a parameter of the model")
            if id(p) in owner:
                raise ValueError(f"Offloader: a parameter is in groups[{owner[id(p)] - 1}] and groups[{k - 1}]; "
                                 "each parameter belongs to one group")
            owner[id(p)] = k
        specs.append({key: v for key, v in group.items() if key != "params"} | {"params": []})
    if no_decay:
        specs.append({"weight_decay": 0.0, "params": []})
        for module_name, module in model.named_modules():
            for name, p in module.named_parameters(recurse=False):
                if id(p) not in owner and _exempt(f"{module_name}.{name}", module, no_decay):
                    owner[id(p)] = len(specs) - 1
    for p in model.parameters():
        if p.requires_grad:
            specs[owner.get(id(p), 0)]["params"].append(p)
    return specs, lambda p: owner.get(id(p), 0)
