"""WeightSource: the interface through which a model's meta parameters get their values when the buffers that
will hold them exist, and how a meta parameter is made real from one (or refused when none holds its values)."""
from __future__ import annotations

from typing import Protocol

import torch
from torch import nn


class WeightSource(Protocol):
    """Values for a model's meta parameters, each given when the buffer that will hold it exists."""

    thread_safe: bool  # fill() may run on several threads at once (for different parameters)

    def fill(self, param: nn.Parameter, dst: torch.Tensor) -> None: ...

    def value(self, param: nn.Parameter, device: torch.device | str) -> torch.Tensor:
        """The parameter's values as a tensor on `device` (for parameters kept there)."""
        ...


def filled_on(weights: WeightSource, param: nn.Parameter, device: torch.device | str,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """`value` by way of a host tensor that `fill` writes (for sources that read or make values on the CPU)."""
    host = torch.empty(param.shape, dtype=dtype or param.dtype)
    weights.fill(param, host)
    return host.to(device)


def materialize(weights: WeightSource, param: nn.Parameter, device: torch.device | str) -> None:
    """Give a meta parameter its values from `weights` on `device`."""
    make_real(param, weights.value(param, device))


def make_real(param: nn.Parameter, value: torch.Tensor) -> None:
    """Turn a meta parameter into one holding `value`, keeping the Parameter object (which layouts, tied
    modules and optimizers hold): `.data` cannot move a tensor off the meta device, a swap can."""
    torch.utils.swap_tensors(param, nn.Parameter(value, requires_grad=param.requires_grad))


def check_materialized(model: nn.Module, weights: WeightSource | None) -> None:
    """Refuse a model with parameters on the meta device unless `weights` hold their values."""
    if weights is not None:
        return
    meta = [name for name, p in model.named_parameters() if p.is_meta]
    if meta:
        raise ValueError(f"Offloader: {len(meta)} parameters are on the meta device (e.g. {meta[0]!r}) and no "
                         "weights= hold their values: build with Offloader.from_pretrained(path), or load the model "
                         "before offloading it")
