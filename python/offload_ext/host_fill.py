"""Host fill: each unit's values moved from the model into its host buffers, leaving device placeholders."""
from __future__ import annotations

import torch

from .backends import Backend, LayerBuffers
from .layout import Unit


def fill_unit(unit: Unit, backend: Backend, device: torch.device, own_grads: bool = False) -> LayerBuffers:
    """Host buffers for `unit`, filled from its parameters (and fp32 masters from them in "mixed"); each
    parameter then holds an empty bf16 placeholder on `device` until a device buffer is bound to it."""
    host = backend.new_layer(unit.numel, unit.trainable_numel, own_grads=own_grads, groups=unit.group_ranges)
    for k, s in enumerate(unit.spans):
        src = s.param.detach().reshape(-1)
        host.params[s.offset:s.offset + s.numel].copy_(src)
        if host.master is not None and k < unit.trainable:
            host.master[s.offset:s.offset + s.numel].copy_(src)
        s.param.data = torch.empty(0, dtype=torch.bfloat16, device=device)
    host.mirror_frozen()
    return host
