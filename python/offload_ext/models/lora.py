"""LoRA: peft adapters put on a causal LM for offload-train, including one whose base weights are still
on the meta device (they come from a checkpoint or an init draw later): the adapters themselves are
made real on the CPU and initialised by peft's own rule, so the Offloader copies them like any weight."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def is_adapter(name: str) -> bool:
    """Whether a state-dict name is a LoRA adapter weight (what a saved adapter holds)."""
    return ".lora_" in name


def add_lora(model: nn.Module, r: int, alpha: float, targets: Sequence[str]) -> nn.Module:
    """`model` wrapped by peft with rank-r LoRA adapters on the `targets` modules (no dropout)."""
    try:
        import peft
    except ImportError as exc:
        raise ImportError("LoRA needs peft: pip install \"offload_ext[lora]\"") from exc
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                                                         lora_dropout=0.0))
    for module in wrapped.modules():
        adapters = getattr(module, "lora_A", None)
        if not isinstance(adapters, nn.ModuleDict):
            continue
        for name in adapters:
            if any(p.is_meta for p in (*module.lora_A[name].parameters(), *module.lora_B[name].parameters())):
                module.lora_A[name].to_empty(device="cpu")
                module.lora_B[name].to_empty(device="cpu")
                with torch.no_grad():
                    module.reset_lora_parameters(name, True)  # peft's init: A kaiming-uniform, B zeros
    return wrapped
