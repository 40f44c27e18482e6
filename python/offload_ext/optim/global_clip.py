"""CPUAdamW's gradient clipping: the global norm over every parameter (across ranks for FSDP2's shards, one
all-reduce of the sum of squares), and the state a step in backward preserves so that it can be redone
exactly once the norm says it must be clipped.

The rule is the Offloader's: each parameter's squares summed in float64, the parameters' sums added in
their optimizer order, the norm their square root, scale = min(1, max_norm / (norm + 1e-6)), each gradient
multiplied by it in its own dtype (as clip_grad_norm_ does) before the step.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Shard


def check_clippable(params: Sequence[torch.Tensor]) -> None:
    """Refuse what the global norm cannot count once per element: plain tensors beside DTensors (each rank
    would count its replica), or DTensors replicated on some mesh dimension."""
    sharded = [p for p in params if isinstance(p, DTensor)]
    if sharded and len(sharded) != len(params):
        raise ValueError("CPUAdamW(max_grad_norm=...): the parameters mix DTensors and plain tensors; the global "
                         "norm would count the plain ones once per rank. Shard every parameter (fully_shard) or "
                         "none of them")
    for p in sharded:
        if p.device_mesh.ndim != 1 or not all(isinstance(pl, Shard) for pl in p.placements):
            raise ValueError(f"CPUAdamW(max_grad_norm=...): a parameter is placed {p.placements}; the global norm "
                             "supports sharded placements only (FSDP2's fully_shard): clip with overlap=False and "
                             "torch.nn.utils.clip_grad_norm_ instead")


def local_sq(grad: torch.Tensor) -> float:
    """The float64 sum of the squares of this rank's part of a gradient."""
    g = grad.to_local() if isinstance(grad, DTensor) else grad
    return float(torch.sum(torch.square(g.detach().to(torch.float64))))


def global_norm(sums: Sequence[float], params: Sequence[torch.Tensor]) -> float:
    """The norm from each parameter's local sum (in optimizer order), summed over the ranks of the
    parameters' mesh when they are DTensors."""
    total = sum(sums, 0.0)
    sharded = next((p for p in params if isinstance(p, DTensor)), None)
    if sharded is not None and dist.is_initialized():
        group = sharded.device_mesh.get_group()
        on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
        t = torch.tensor([total], dtype=torch.float64, device=on)  # NCCL reduces device tensors only
        dist.all_reduce(t, group=group)
        total = float(t[0])
    return math.sqrt(total)


def clip_scale(norm: float, max_norm: float) -> float:
    return min(1.0, max_norm / (norm + 1e-6))


class Preserved:
    """Copies of a parameter's optimizer state taken before a step in backward, to redo it from."""

    def __init__(self) -> None:
        self._copies: dict[int, list[torch.Tensor]] = {}

    @staticmethod
    def _tensors(p: torch.Tensor, state: dict) -> list[torch.Tensor]:
        local = [p.detach(), state["exp_avg"], state["exp_avg_sq"], state.get("master_param")]
        return [t.to_local() if isinstance(t, DTensor) else t for t in local if t is not None]

    def save(self, p: torch.Tensor, state: dict) -> None:
        tensors = self._tensors(p, state)
        copies = self._copies.get(id(p))
        if copies is None or any(c.shape != t.shape or c.dtype != t.dtype for c, t in zip(copies, tensors)):
            copies = [torch.empty_like(t) for t in tensors]  # kept for the next steps: no allocation per step
            self._copies[id(p)] = copies
        for c, t in zip(copies, tensors):
            c.copy_(t)

    def restore(self, p: torch.Tensor, state: dict) -> None:
        for t, c in zip(self._tensors(p, state), self._copies[id(p)]):
            t.copy_(c)
        state["step"] -= 1
