"""Host fill: each unit's values moved from the model into its host buffers, leaving device placeholders."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from offload_ext.engine.backends import Backend, LayerBuffers
from offload_ext.models.quantized_base import quantize_into
from offload_ext.models.weight_source import WeightSource, make_real
from offload_ext.planning.layout import Span, Unit


def fill_unit(unit: Unit, backend: Backend, device: torch.device, own_grads: bool = False,
              weights: WeightSource | None = None, pool: ThreadPoolExecutor | None = None) -> LayerBuffers:
    """Host buffers for `unit`, filled from its parameters (and fp32 masters from them in "mixed"), or for a
    parameter on the meta device from `weights` (on `pool`'s threads where the source allows: reads
    release the GIL); each parameter then holds an empty bf16 placeholder on `device` until a device
    buffer is bound to it."""
    host = backend.new_layer(unit.numel, unit.trainable_numel, own_grads=own_grads, groups=unit.group_ranges)
    reads = []
    for k, s in enumerate(unit.spans):
        params = host.params[s.offset:s.offset + s.stored]
        master = host.master[s.offset:s.offset + s.numel] if host.master is not None and k < unit.trainable else None
        if s.param.is_meta:
            reads.append((s, params, master))
            continue
        if s.quant is not None:
            quantize_into(s.quant, s.param.detach().to(torch.bfloat16), params)
        else:
            src = s.param.detach().reshape(-1)
            params.copy_(src)
            if master is not None:
                master.copy_(src)
        s.param.data = torch.empty(0, dtype=torch.bfloat16, device=device)
    if reads:
        run = pool.map if pool is not None and weights.thread_safe else map
        list(run(lambda r: _read(weights, *r), reads))
        for s, _, _ in reads:
            make_real(s.param, torch.empty(0, dtype=torch.bfloat16, device=device))
    host.mirror_frozen()
    return host


def _read(weights: WeightSource, span: Span, params: torch.Tensor, master: torch.Tensor | None) -> None:
    if span.quant is not None:  # its values once, whole, then held in its format
        values = torch.empty(span.shape, dtype=torch.bfloat16)
        weights.fill(span.param, values)
        quantize_into(span.quant, values, params)
        return
    # Once, into the widest buffer that keeps it (an fp32 checkpoint's values into the master).
    weights.fill(span.param, master if master is not None else params)
    if master is not None:
        params.copy_(master)
