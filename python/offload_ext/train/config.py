"""TrainConfig: one training run's decisions, as the trainers take them: the offload configuration, the
optimizer and its schedule, the loss, and where checkpoints go. offload-train builds it from its flags."""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from offload_ext.config import OffloadConfig


@dataclass(frozen=True)
class TrainConfig:
    """A run of `steps` optimizer steps. `offloaded=False` trains on the device with a plain optimizer (the
    comparison offload-train calls `--backend none`); precision, grad_accum, max_grad_norm, activation
    checkpointing and compilation come from `offload` either way."""

    offload: OffloadConfig = OffloadConfig()
    offloaded: bool = True
    steps: int = 60
    warmup_steps: int = 0
    lr: float = 3e-4
    weight_decay: float = 0.0
    no_decay: tuple[str, ...] = ("bias", "norm")
    seed: int = 0
    loss_chunk_tokens: int = 4096
    loss_kernel: str = "auto"
    out: str = "runs/offload-train"
    keep_checkpoints: int = 2
    adapter_only: bool = False  # LoRA: a checkpoint holds the adapter alone, as peft saves it
    flags: Mapping[str, Any] = field(default_factory=dict)  # what a resume must repeat, kept in each checkpoint

    def lr_factor(self, step: int) -> float:
        """Linear warm-up to lr, then cosine decay to 10 % of it at `steps` (a multiple of lr)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
