"""The argument and state checks of CPUAdamW (and StochasticAdamW's seed): torch.optim.AdamW's refusals, made
alike; refusals of what CPUAdamW does not implement, rather than ignoring it silently; and of what the host
cannot hold."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from offload_ext.optim import eight_bit
from offload_ext.planning.host_sizes import Alternative, HostBlock, HostNeed, available_host_bytes, check_host_memory

_SUPPORTED = (torch.float32, torch.bfloat16)
# torch.optim.AdamW's keywords that CPUAdamW accepts at AdamW's defaults only, so that code forwarding AdamW's
# arguments runs unchanged; another value is refused rather than silently ignored.
_ADAMW_ONLY_AT_DEFAULT = {"amsgrad": False, "maximize": False, "capturable": False, "differentiable": False}
# AdamW's implementation choices: CPUAdamW always runs its fused kernel, whatever they say.
_ADAMW_IMPLEMENTATION = ("foreach", "fused")


def check_param(p: torch.Tensor) -> None:
    """A parameter (a DTensor's local shard) the kernel can step in place."""
    if p.device.type != "cpu":
        raise ValueError(f"CPUAdamW: parameters must live on the CPU, got one on {p.device}; "
                         "use torch.optim.AdamW(fused=True) for GPU parameters")
    if p.dtype not in _SUPPORTED:
        raise ValueError(f"CPUAdamW: parameters must be float32 or bfloat16, got {p.dtype}")
    if not p.is_contiguous():
        raise ValueError("CPUAdamW: parameters must be contiguous (the kernel steps flat spans); "
                         "make them contiguous before building the optimizer, e.g. p.data = p.data.contiguous()")


def check_host_memory_for(shards: Sequence[tuple[torch.Tensor, bool]], redo_copies: bool) -> None:
    """Refuse what this host cannot hold, before any state exists (the kernel would kill the process in the
    middle of a backward instead), naming the numbers and what needs less. `shards`: each parameter's local
    shard and whether it keeps an fp32 master (and fp32 moments); `redo_copies`: steps in backward may be
    redone (overlap with clipping), each from a copy of the state before it (the parameter, both moments and
    the master)."""
    state_bytes = preserved = 0
    for shard, master in shards:
        moment_size = 4 if master else shard.element_size()
        own = shard.numel() * (2 * moment_size + (4 if master else 0))
        state_bytes += own
        preserved += own + shard.numel() * shard.element_size()
    blocks = [HostBlock("moments and masters", state_bytes, False)]
    alternatives = []
    if redo_copies:
        blocks.append(HostBlock("state kept for a clipped redo", preserved, False))
        alternatives = [Alternative("overlap=False (clipping after backward, nothing kept for a redo)", state_bytes),
                        Alternative("max_grad_norm=None (no clipping)", state_bytes)]
    check_host_memory(HostNeed(tuple(blocks)), available_host_bytes(), alternatives, who="CPUAdamW")


def check_adamw_keywords(kwargs: dict[str, Any], owner: str = "CPUAdamW") -> None:
    """torch AdamW's keywords beyond the hyperparameters: its implementation choices taken whatever they say, the
    ones that change its rule at their defaults only; any other refused by name."""
    for key, value in kwargs.items():
        if key in _ADAMW_IMPLEMENTATION:
            continue
        if key not in _ADAMW_ONLY_AT_DEFAULT:
            raise TypeError(f"{owner} got an unexpected keyword argument {key!r}")
        if bool(value) != _ADAMW_ONLY_AT_DEFAULT[key]:
            raise ValueError(f"{owner}: {key}={value!r} is not supported (only AdamW's default, "
                             f"{key}={_ADAMW_ONLY_AT_DEFAULT[key]}); use torch.optim.AdamW for it")


def check_hyper(lr: float | torch.Tensor, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """torch.optim.AdamW's checks, with its messages."""
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if isinstance(betas[0], torch.Tensor) != isinstance(betas[1], torch.Tensor):
        raise ValueError("betas must be either both floats or both Tensors")
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def check_loaded_groups(groups: list[dict[str, Any]]) -> None:
    """Refuse a state saved by an AdamW whose rule differs from CPUAdamW's (amsgrad, maximize): loading it would
    report that rule and step by plain AdamW's."""
    for k, group in enumerate(groups):
        for key in ("amsgrad", "maximize"):
            if group.get(key):
                raise ValueError(f"CPUAdamW.load_state_dict: param group {k} was saved with {key}=True, which "
                                 "CPUAdamW does not implement; continue it with torch.optim.AdamW")


def check_loaded_moments(state: dict[str, torch.Tensor], numel: int, expected: bool) -> None:
    """Refuse a loaded parameter state whose moments are not what this group keeps: 8-bit codes and their scales
    for `numel` elements (`expected`), or moments of another kind."""
    held = "exp_avg_absmax" in state
    if held != expected:
        saved, asked = ("8-bit", "eight_bit=False") if held else ("full-width", "eight_bit=True")
        raise ValueError(f"CPUAdamW: the state has {saved} moments and this group {asked}: build the optimizer "
                         "with the groups' eight_bit as saved")
    if held and (state["exp_avg"].numel() != numel or state["exp_avg_absmax"].numel() != eight_bit.num_blocks(numel)):
        raise ValueError(f"CPUAdamW: the saved 8-bit moments are for {state['exp_avg'].numel()} elements, the "
                         f"parameter has {numel}")


def check_seed(state_dict: dict[str, Any], seed: int, who: str) -> None:
    """Refuse a state whose stochastic rounding drew from another seed: its stream could not continue."""
    saved = state_dict.get("sr_seed")  # states saved before the seed was kept have none
    if saved is not None and saved != seed:
        raise ValueError(f"{who}: the state's stochastic rounding drew from sr_seed={saved}, this optimizer's "
                         f"from sr_seed={seed}: build it with sr_seed={saved} to continue the same run")
