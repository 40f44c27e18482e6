"""Host fill: each unit's values moved from the model into its host buffers, leaving device placeholders."""
from __future__ import annotations

import threading
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
            _quantize(s, s.param.detach().to(torch.bfloat16), params, device)
        else:
            src = s.param.detach().reshape(-1)
            params.copy_(src)
            if master is not None:
                master.copy_(src)
        s.param.data = torch.empty(0, dtype=torch.bfloat16, device=device)
    if reads:
        run = pool.map if pool is not None and weights.thread_safe else map
        list(run(lambda r: _read(weights, *r, device), reads))
        for s, _, _ in reads:
            make_real(s.param, torch.empty(0, dtype=torch.bfloat16, device=device))
    host.mirror_frozen()
    return host


def _read(weights: WeightSource, span: Span, params: torch.Tensor, master: torch.Tensor | None,
          device: torch.device) -> None:
    if span.quant is not None:  # its values once, whole, then held in its format
        values = torch.empty(span.shape, dtype=torch.bfloat16)
        weights.fill(span.param, values)
        _quantize(span, values, params, device)
        return
    # Once, into the widest buffer that keeps it (an fp32 checkpoint's values into the master).
    weights.fill(span.param, master if master is not None else params)
    if master is not None:
        params.copy_(master)


# One weight on the GPU at a time: the readers' copies share the link anyway, and the transient stays one weight's
# (0.7 GB for the 70 B shape's largest) however many read at once.
_ON_DEVICE = threading.Lock()


def _quantize(span: Span, values: torch.Tensor, params: torch.Tensor, device: torch.device) -> None:
    """`values` (bf16, on the host) held in the span's format in its stored elements of `params`: quantized on the
    GPU where the engine has one (the host's torch ops took minutes for a 70 B base), the same bits: each format's
    rule is exact elementwise arithmetic (tests/models/test_quantized_base.py checks both devices alike)."""
    if device.type != "cuda":
        quantize_into(span.quant, values, params)
        return
    with _ON_DEVICE:
        stored = torch.empty(span.stored, dtype=torch.bfloat16, device=device)
        quantize_into(span.quant, values.to(device), stored)
        params.copy_(stored)
