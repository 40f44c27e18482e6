"""PerLayerOffloadWithBackwardGradient: a drop-in for the pure-Python hook offloader of that name, run by the
Offloader, so that a loop written for it trains unchanged with one import swapped.

The loop it serves: `off = PerLayerOffloadWithBackwardGradient(model, torch.optim.AdamW, dict(lr=...)).cuda()`,
then per step `loss.backward()` (with `off.disable_forward_hook` set around it, which the engine does not need:
it tells a recompute from a forward itself), `off.optim_step()`, `off.optim_zero_grad()`. torch's AdamW and its
keywords map onto the host AdamW (the same update rule); the model's parameters must be bf16, the dtype the
original trains them in when it is used at scale.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from offload_ext.engine.offloader import Offloader
from offload_ext.optim.adamw_checks import check_adamw_keywords

_HYPER = ("lr", "betas", "eps", "weight_decay")


def _offloader_kwargs(optim_cls: type, optim_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The Offloader's optimizer arguments for torch.optim.AdamW(**optim_kwargs); anything else refused."""
    if optim_cls is not torch.optim.AdamW:
        raise TypeError(f"PerLayerOffloadWithBackwardGradient: optim_cls must be torch.optim.AdamW (the host AdamW "
                        f"runs its rule), got {getattr(optim_cls, '__name__', optim_cls)}; for another optimizer "
                        "keep the original hook offloader")
    check_adamw_keywords({k: v for k, v in optim_kwargs.items() if k not in _HYPER},
                         owner="PerLayerOffloadWithBackwardGradient")
    return {k: v for k, v in optim_kwargs.items() if k in _HYPER}


class PerLayerOffloadWithBackwardGradient:
    """The hook offloader's interface over the Offloader: `cuda()` (or `cpu()`: the simulated device) builds it,
    `optim_step()` and `optim_zero_grad()` are its step and zero_grad. With `enable=False` the model is left alone
    and `optim_cls(model.parameters(), **optim_kwargs)` steps it."""

    def __init__(self, model: nn.Module, optim_cls: type[torch.optim.Optimizer],
                 optim_kwargs: dict[str, Any] | None = None, enable: bool = True) -> None:
        self.model = model
        self.enable = enable
        self.disable_forward_hook = False  # the original's recompute switch: the engine needs none
        self.offloader: Offloader | None = None
        kwargs = dict(optim_kwargs or {})
        if not enable:
            self.optimizer = optim_cls(model.parameters(), **kwargs)
            return
        self._kwargs = _offloader_kwargs(optim_cls, kwargs)  # refused here, before anything is moved
        dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
        if dtypes != {torch.bfloat16}:
            found = ", ".join(sorted(map(str, dtypes)))
            raise TypeError(f"PerLayerOffloadWithBackwardGradient: the trainable parameters are {found}; the host AdamW"
                            " trains bf16 parameters: call model.bfloat16() first (or use "
                            "offload_ext.Offloader(model, precision='mixed') for fp32 masters)")

    def cuda(self) -> PerLayerOffloadWithBackwardGradient:
        return self._to("cuda")

    def cpu(self) -> PerLayerOffloadWithBackwardGradient:
        """Without a GPU: the engine on the simulated device (the CPU), the same steps bit for bit."""
        return self._to("cpu")

    def _to(self, device: str) -> PerLayerOffloadWithBackwardGradient:
        if not self.enable:
            self.model.to(device)
        elif self.offloader is None:
            self.offloader = Offloader(self.model, device=device, precision="bf16", **self._kwargs)
        elif self.offloader.device.type != device:
            raise RuntimeError(f"PerLayerOffloadWithBackwardGradient: already training on {self.offloader.device}; "
                               "build a new one to train elsewhere")
        return self

    def _built(self) -> Offloader:
        if self.offloader is None:
            raise RuntimeError("PerLayerOffloadWithBackwardGradient: call .cuda() (or .cpu()) before training")
        return self.offloader

    @torch.no_grad()
    def optim_step(self) -> None:
        if not self.enable:
            self.optimizer.step()
        else:
            self._built().step()

    def optim_zero_grad(self) -> None:
        if not self.enable:
            self.optimizer.zero_grad()
        else:
            self._built().zero_grad()
