"""CPUAdamW: a torch.optim.Optimizer on the native fused AdamW kernel, for CPU parameters (plain, or the
local shards of DTensor ones), optionally stepped in backward; and StochasticAdamW, bf16 AdamW with
stochastic rounding in torch ops on any device."""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor

from offload_ext.ops import adamw_step
from offload_ext.optim import eight_bit
from offload_ext.optim.adamw_checks import (
    check_adamw_keywords,
    check_host_memory_for,
    check_hyper,
    check_loaded_groups,
    check_loaded_moments,
    check_param,
    check_seed,
)
from offload_ext.optim.global_clip import GlobalClip, check_clippable, local
from offload_ext.optim.overlap import InBackwardSteps
from offload_ext.optim.stochastic_rounding import adamw_step_sr


def _closure_loss(closure: Callable[[], float] | None) -> float | None:
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _stepped(param_groups: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], torch.Tensor, int]]:
    """_all_params' triples of the parameters with a gradient: the index is the parameter's stochastic
    rounding stream."""
    return ((group, p, index) for group, p, index in _all_params(param_groups) if p.grad is not None)


def _all_params(param_groups: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], torch.Tensor, int]]:
    """(group, parameter, its index counting through the groups in order) of every parameter."""
    index = 0
    for group in param_groups:
        for p in group["params"]:
            yield group, p, index
            index += 1


class CPUAdamW(torch.optim.Optimizer):
    """Drop-in for torch.optim.AdamW on CPU parameters. AdamW's other keywords are taken at its defaults
    (amsgrad, maximize, capturable and differentiable False; foreach and fused any value: the kernel is fused),
    and refused otherwise.

    `master_weights=True` keeps an fp32 master copy and fp32 moments for bf16 parameters: the kernel
    updates the master and writes the rounded bf16 value into the parameter in the same pass.
    `stochastic_rounding=True` keeps bf16 parameters and bf16 moments, as without it, but stores the
    parameters and exp_avg_sq by stochastic rounding (offload_ext.optim.stochastic_rounding's rule): parameter k
    of the optimizer, counting through the groups in order, draws stream k of `sr_seed`. `eight_bit=True` keeps
    the moments in 8 bits (offload_ext.optim.eight_bit's rule, bitsandbytes' block-wise dynamic quantization:
    uint8 codes in `exp_avg` and `exp_avg_sq`, an fp32 scale per 256 elements in `exp_avg_absmax` and
    `exp_avg_sq_absmax`), the parameter rounded to nearest or, with stochastic_rounding, stochastically. All three
    are group options for bf16 parameters; master_weights takes neither of the others.
    State keys follow torch's (`step`, `exp_avg`, `exp_avg_sq`), plus `master_param`; for DTensor
    parameters (FSDP2's shards) the states are DTensors of the same placement and the kernel steps the
    local shard.
    `overlap=True` steps each parameter in backward, on a worker thread, as soon as its gradient is final
    (offload_ext.optim.overlap); `step()` waits for those and steps the parameters they did not reach. The
    gradients are consumed by then: change them only with overlap=False. With gradient accumulation, run
    every backward but a step's last inside `with opt.no_overlap():`.
    `max_grad_norm` clips by the global norm (offload_ext.optim.clipping's rule, the Offloader's: float64 sums,
    across ranks for DTensor shards; offload_ext.optim.global_clip). With overlap, the steps in backward keep a
    copy of the state before them; `step()` takes the norm and commits them, or redoes each from its copy with
    the scaled gradient (`last_clip_action`: "committed" / "redone"; without overlap "unclipped" / "clipped";
    `last_grad_norm`). The step reads the gradient scaled inside the kernel and leaves `.grad` as backward
    made it; with 8-bit states it is scaled in place, as clip_grad_norm_ does. The copies cost one
    more parameter and both moments (and the fp32 master) per parameter, on the host. A non-finite norm raises
    FloatingPointError, as clip_grad_norm_(error_if_nonfinite=True) does, with no step applied (the steps in
    backward undone).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        master_weights: bool = False,
        stochastic_rounding: bool = False,
        eight_bit: bool = False,
        sr_seed: int = 0,
        overlap: bool = False,
        max_grad_norm: float | None = None,
        **adamw_keywords: Any,
    ) -> None:
        check_adamw_keywords(adamw_keywords)
        check_hyper(lr, betas, eps, weight_decay)
        self._clip = GlobalClip(max_grad_norm) if max_grad_norm is not None else None
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, master_weights=master_weights,
                        stochastic_rounding=stochastic_rounding, eight_bit=eight_bit)
        self.overlap: InBackwardSteps | None = None
        self._located: tuple[list, tuple, dict] | None = None  # _locate's map and the groups it was made from
        super().__init__(params, defaults)  # add_param_group checks (and with overlap, watches) each group
        self.sr_seed = sr_seed
        if max_grad_norm is not None:
            check_clippable([p for _, p, _ in _all_params(self.param_groups)])
        # No state exists yet: what each parameter's will be, and with overlap and clipping its copy for a redo.
        shards = [(local(p.detach()), self._uses_master(p, group)) for group, p, _ in _all_params(self.param_groups)]
        check_host_memory_for(shards, bool(overlap) and self._clip is not None)
        if overlap:
            self.overlap = InBackwardSteps(self._in_backward)
            for _, p, _ in _all_params(self.param_groups):
                self.overlap.watch(p)

    @property
    def max_grad_norm(self) -> float | None:
        return self._clip.rule.max_norm if self._clip is not None else None

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm of the last step (with max_grad_norm), before clipping."""
        return self._clip.rule.last_grad_norm if self._clip is not None else None

    @property
    def last_clip_action(self) -> str | None:
        """With max_grad_norm, what the last step did: "committed" / "redone" (steps in backward), else
        "unclipped" / "clipped"."""
        return self._clip.rule.last_clip_action if self._clip is not None else None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if group["master_weights"] and (group["stochastic_rounding"] or group["eight_bit"]):
            other = "stochastic_rounding" if group["stochastic_rounding"] else "eight_bit"
            raise ValueError(f"CPUAdamW: a group takes master_weights or {other}, not both")
        for p in group["params"]:
            check_param(local(p.detach()))
            if group["eight_bit"] and (p.dtype != torch.bfloat16 or isinstance(p, DTensor)):
                raise ValueError("CPUAdamW: eight_bit steps plain bf16 parameters (got "
                                 f"{'a DTensor shard' if p.dtype == torch.bfloat16 else p.dtype}): its codes and "
                                 "scales are laid out over the whole tensor")
        if self.overlap is not None:  # a group added after construction
            for p in group["params"]:
                self.overlap.watch(p)

    @contextlib.contextmanager
    def no_overlap(self) -> Iterator[None]:
        """A backward inside this block leaves its gradients to step() (a micro-batch before a step's last)."""
        if self.overlap is None:
            yield
            return
        with self.overlap.paused():
            yield

    def __getstate__(self) -> dict[str, Any]:
        # torch's Optimizer pickles only defaults, state and groups: a copy (deepcopy, pickle) would lose these
        # settings and fail at its first step. The in-backward hooks are made again for the copy's parameters.
        return {**super().__getstate__(), "sr_seed": self.sr_seed, "_clip": self._clip,
                "_overlapped": self.overlap is not None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Called by load_state_dict with the loaded state and groups only, and by unpickling with everything.
        overlapped = state.pop("_overlapped", None)
        super().__setstate__(state)
        # A loaded state dict's groups replace these (torch.optim.AdamW's carry neither key): what it
        # lacks keeps this optimizer's choice.
        for group in self.param_groups:
            for key in ("master_weights", "stochastic_rounding", "eight_bit"):
                group.setdefault(key, self.defaults[key])
        for name, value in (("_located", None), ("overlap", None)):
            self.__dict__.setdefault(name, value)
        if overlapped and self.overlap is None:
            self.overlap = InBackwardSteps(self._in_backward)
            for _, p, _ in _all_params(self.param_groups):
                self.overlap.watch(p)

    @staticmethod
    def _uses_master(p: torch.Tensor, group: dict[str, Any]) -> bool:
        return bool(group["master_weights"]) and p.dtype == torch.bfloat16

    @staticmethod
    def _own_dtype_states(p: torch.Tensor, group: dict[str, Any]) -> bool:
        """Whether p's moments are kept in a dtype other than its own (fp32 with a master, 8-bit codes)."""
        return CPUAdamW._uses_master(p, group) or bool(group.get("eight_bit"))

    def _init_state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            if group["eight_bit"]:
                codes = eight_bit.zero_state(p.numel())
                for key, value in zip(("exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax"), codes):
                    state[key] = value
                return state
            if self._uses_master(p, group):
                state["master_param"] = p.detach().to(torch.float32, copy=True)
                like = state["master_param"]
            else:
                like = p.detach()
            state["exp_avg"] = torch.zeros_like(like, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(like, memory_format=torch.contiguous_format)
        return state

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = _closure_loss(closure)
        done = self.overlap.take_stepped() if self.overlap is not None else set()
        stepped = list(_stepped(self.param_groups))
        if any(p.grad.is_sparse for _, p, _ in stepped):  # refused before any parameter is stepped
            raise RuntimeError("CPUAdamW does not support sparse gradients")
        if self._clip is not None:
            self._clip.step(stepped, done, self.state, self._step_param)
            return loss
        for group, p, stream in stepped:
            if id(p) not in done:
                self._step_param(group, p, stream)
        return loss

    def _locate(self, p: torch.Tensor) -> tuple[dict[str, Any], int]:
        """p's group now and its index counting through the groups (its stochastic rounding stream). The map
        is made again when the groups are no longer the ones it was made from (load_state_dict replaces
        them, add_param_group adds one): a scan per parameter per step held the GIL for O(n^2) lookups."""
        groups = self.param_groups
        made = self._located
        if made is None or made[0] is not groups or len(made[1]) != len(groups) or \
                any(a is not b for a, b in zip(made[1], groups)):
            where = {id(q): (group, index) for group, q, index in _all_params(groups)}
            made = self._located = (groups, tuple(groups), where)
        return made[2][id(p)]

    @torch.no_grad()
    def _in_backward(self, p: torch.Tensor) -> None:
        """A step in backward; with clipping, the local sum of squares first and the state kept for a redo."""
        group, stream = self._locate(p)
        if self._clip is not None:
            self._clip.speculate(p, self._init_state(p, group))
        self._step_param(group, p, stream)

    @torch.no_grad()
    def _step_param(self, group: dict[str, Any], p: torch.Tensor, stream: int, scale: float = 1.0) -> None:
        """One parameter's fused AdamW step with its gradient as it is now, scaled by `scale` (clipping; `stream`:
        its stochastic rounding stream)."""
        if p.grad.is_sparse:
            raise RuntimeError("CPUAdamW does not support sparse gradients")
        state = self._init_state(p, group)
        state["step"] += 1
        sr_seed = self.sr_seed if group["stochastic_rounding"] and p.dtype == torch.bfloat16 else None
        # The fused kernel reads the gradient scaled as torch's clipping scales it, bit for bit: no pass of its
        # own over the gradient; the 8-bit kernel's gradient takes the scale in place first.
        if "exp_avg_absmax" in state:
            if scale != 1.0:
                local(p.grad).mul_(scale)
            eight_bit.adamw8bit_step(p.detach().view(-1), p.grad.detach().contiguous().view(-1), state["exp_avg"],
                                     state["exp_avg_sq"], state["exp_avg_absmax"], state["exp_avg_sq_absmax"],
                                     lr=float(group["lr"]), beta1=group["betas"][0], beta2=group["betas"][1],
                                     eps=group["eps"], weight_decay=group["weight_decay"],
                                     step=int(state["step"].item()), sr_seed=sr_seed, sr_stream=stream)
            return
        master = state.get("master_param")
        adamw_step(
            local(master if master is not None else p.detach()),
            local(p.grad.detach()).contiguous(),
            local(state["exp_avg"]),
            local(state["exp_avg_sq"]),
            param_out=local(p.detach()) if master is not None else None,
            lr=float(group["lr"]),
            beta1=group["betas"][0],
            beta2=group["betas"][1],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            step=int(state["step"].item()),
            sr_seed=sr_seed,
            sr_stream=stream,
            grad_scale=scale,
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.overlap is not None:
            self.overlap.wait()  # a step in backward may still read a gradient that zeroing would overwrite
        super().zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        if self.overlap is not None:
            self.overlap.wait()
        return {**super().state_dict(), "sr_seed": self.sr_seed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.overlap is not None:
            self.overlap.wait()
        if any(g["stochastic_rounding"] for g in self.param_groups):
            check_seed(state_dict, self.sr_seed, "CPUAdamW")
        check_loaded_groups(state_dict["param_groups"])
        # torch casts every loaded state tensor to its parameter's dtype; states kept in another (fp32 masters
        # and moments, 8-bit codes and their scales) are restored from the originals afterwards.
        saved_groups = state_dict["param_groups"]
        saved_state = state_dict["state"]
        own_dtype: dict[int, dict[str, torch.Tensor]] = {}
        for saved_group, group in zip(saved_groups, self.param_groups):
            merged = {**group, **saved_group}
            for index, p in zip(saved_group["params"], group["params"]):
                if index in saved_state and self._own_dtype_states(p, merged):
                    own_dtype[id(p)] = {k: v for k, v in saved_state[index].items() if k != "step"}
                    check_loaded_moments(own_dtype[id(p)], p.numel(), bool(merged.get("eight_bit")))
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if not state:
                    continue
                if not isinstance(state["step"], torch.Tensor):  # older checkpoints keep a plain number
                    state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
                for key, value in own_dtype.get(id(p), {}).items():
                    state[key] = value.to(device=p.device, copy=True, memory_format=torch.contiguous_format)


class StochasticAdamW(torch.optim.AdamW):
    """torch.optim.AdamW over bf16 parameters on any device, with bf16 moments (in the state under torch's
    keys), stepped by stochastic_rounding.adamw_step_sr: what CPUAdamW(stochastic_rounding=True) does on
    the CPU, bit for bit, in torch ops. Parameter k (counting through the groups in order) draws stream
    `first_stream + k` of `seed`."""

    def __init__(self, params: Any, *, seed: int, first_stream: int = 0, **kwargs: Any) -> None:
        if kwargs.get("amsgrad") or kwargs.get("maximize"):
            raise ValueError("StochasticAdamW: amsgrad and maximize are not supported")
        super().__init__(params, **kwargs)
        self.seed, self.first_stream = seed, first_stream
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != torch.bfloat16 or not p.is_contiguous():
                    raise ValueError("StochasticAdamW: parameters must be contiguous bf16 tensors")

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "sr_seed": self.seed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        check_seed(state_dict, self.seed, "StochasticAdamW")
        super().load_state_dict(state_dict)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = _closure_loss(closure)
        for group, p, index in _stepped(self.param_groups):
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            state["step"] += 1
            adamw_step_sr(p, p.grad.contiguous(), state["exp_avg"], state["exp_avg_sq"], lr=group["lr"],
                          beta1=group["betas"][0], beta2=group["betas"][1], eps=group["eps"],
                          weight_decay=group["weight_decay"], step=int(state["step"].item()), sr_seed=self.seed,
                          sr_stream=self.first_stream + index)
        return loss
