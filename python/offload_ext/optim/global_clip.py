"""CPUAdamW's gradient clipping, by offload_ext.optim.clipping's rule: the global norm over every parameter
(across ranks for FSDP2's shards, one all-reduce of the sum of squares; each parameter's float64 sum added in
optimizer order), and the state a step in backward preserves so that it can be redone exactly once the norm
says it must be clipped.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Shard

from offload_ext.optim.clipping import Clipping, sum_squares

# What a refused (non-finite) norm leaves: the optimizer as it was before the step, ready for the next one.
_REFUSED = (" and the steps taken in backward are undone: zero_grad() and go on with the next batch, or lower "
            "the lr")


def local(t: torch.Tensor) -> torch.Tensor:
    """What the kernel steps and the norm reads: a DTensor's local shard (its storage), else the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


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
    return float(sum_squares(local(grad).detach()))


def global_sq(sums: Sequence[float], params: Sequence[torch.Tensor]) -> float:
    """The sum of squares from each parameter's local sum (in optimizer order), summed over the ranks of the
    parameters' mesh when they are DTensors."""
    total = sum(sums, 0.0)
    sharded = next((p for p in params if isinstance(p, DTensor)), None)
    if sharded is not None and dist.is_initialized():
        group = sharded.device_mesh.get_group()
        on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
        t = torch.tensor([total], dtype=torch.float64, device=on)  # NCCL reduces device tensors only
        dist.all_reduce(t, group=group)
        total = float(t[0])
    return total


class Preserved:
    """Copies of a parameter's optimizer state taken before a step in backward, to redo it from."""

    def __init__(self) -> None:
        self._copies: dict[int, list[torch.Tensor]] = {}

    @staticmethod
    def _tensors(p: torch.Tensor, state: dict) -> list[torch.Tensor]:
        # every state tensor but the step count: moments, a master, 8-bit codes' scales
        return [local(t) for t in (p.detach(), *(state[k] for k in sorted(state) if k != "step"))]

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


Stepped = Sequence[tuple[dict[str, Any], torch.Tensor, int]]  # (group, parameter, its stochastic rounding stream)


class GlobalClip:
    """CPUAdamW(max_grad_norm=...): a step in backward speculates (its parameter's local sum of squares taken
    and the state before it kept); step() then takes the global norm, commits or redoes those steps, and steps
    the other parameters with their gradients clipped."""

    def __init__(self, max_norm: float) -> None:
        if not max_norm > 0:
            raise ValueError(f"CPUAdamW: max_grad_norm must be a positive number (or None: no clipping), got "
                             f"{max_norm!r}")
        self.rule = Clipping(max_norm, who="CPUAdamW", consequence=_REFUSED)
        self._preserved = Preserved()
        self._sq: dict[int, float] = {}  # id -> the local sum of squares a step in backward took

    def __getstate__(self) -> dict[str, Any]:
        return {"rule": self.rule}  # what a step in backward kept belongs to that step: a copy starts without it

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.rule, self._preserved, self._sq = state["rule"], Preserved(), {}

    def speculate(self, p: torch.Tensor, state: dict) -> None:
        """Before `p`'s step in backward (its state `state`): its sum of squares, and the state to redo it from."""
        self._sq[id(p)] = local_sq(p.grad)
        self._preserved.save(p, state)

    def step(self, stepped: Stepped, done: set[int], states: Mapping[torch.Tensor, dict],
             step_param: Callable[[dict[str, Any], torch.Tensor, int, float], None]) -> None:
        """Clip and step the parameters that have a gradient (`stepped`, in optimizer order); those whose ids are
        in `done` were stepped in backward. `step_param(group, p, stream, scale)` steps with the gradient scaled by
        `scale` as torch's clipping scales it."""
        sums = [self._sq.pop(id(p)) if id(p) in done else local_sq(p.grad) for _, p, _ in stepped]

        def undo() -> None:
            for _, p, _ in stepped:
                if id(p) in done:
                    self._preserved.restore(p, states[p])

        def clipped_step(scale: float) -> None:
            for group, p, stream in stepped:
                if id(p) in done and scale == 1.0:
                    continue  # its step in backward stands
                if id(p) in done:
                    self._preserved.restore(p, states[p])
                step_param(group, p, stream, scale)

        self.rule.step(global_sq(sums, [p for _, p, _ in stepped]), clipped_step, speculated=bool(done), undo=undo)
