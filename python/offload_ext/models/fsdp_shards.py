"""FSDP2 models built on the meta device: each rank's shards materialized straight into host (or device)
memory, one parameter at a time, so the unsharded model never exists on any rank.

    with offload_ext.models.weights.parameters_on_meta():   # buffers (rotary frequencies) stay real
        model = AutoModelForCausalLM.from_config(cfg)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, offload_policy=CPUOffloadPolicy())
    fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy())
    materialize_shards(model, fill, "cpu")   # fill(name, full_tensor): the parameter's values
    opt = offload_ext.CPUAdamW(model.parameters(), overlap=True)

`fill` writes a parameter's full values into the tensor it is given (a checkpoint read, a random init); the
rank keeps its shard of it and frees the rest before the next parameter: the peak is the shards plus one
whole parameter. Buffers built real (offload_ext.models.weights.parameters_on_meta keeps them so) keep their values,
moved to `device`; a buffer on the meta device is refused unless `init_buffers` recomputes it (to_empty
would leave it uninitialized: rotary frequencies of garbage, silently).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

Fill = Callable[[str, torch.Tensor], None]


def materialize_shards(model: nn.Module, fill: Fill, device: torch.device | str,
                       init_buffers: Callable[[nn.Module], None] | None = None) -> None:
    """Give every meta parameter of `model` (fully_shard'ed or plain) its values from `fill` on `device`:
    a DTensor parameter its local shard only."""
    real = [name for name, p in model.named_parameters() if not p.is_meta]
    if real:
        raise ValueError(f"materialize_shards: {len(real)} parameters are not on the meta device (e.g. {real[0]!r});"
                         " build the model on the meta device and fully_shard it before materializing")
    meta_buffers = [name for name, b in model.named_buffers() if b.is_meta]
    if meta_buffers and init_buffers is None:
        raise ValueError(f"materialize_shards: buffer {meta_buffers[0]!r} is on the meta device and would be left "
                         "uninitialized; build the model under offload_ext.models.weights.parameters_on_meta() "
                         "(buffers stay real) or pass init_buffers= to compute them")
    kept = {name: b.detach().clone() for name, b in model.named_buffers() if not b.is_meta}
    model.to_empty(device=device)  # FSDP2 re-points its sharded parameters at the new local storage
    with torch.no_grad():
        for name, p in model.named_parameters(remove_duplicate=True):
            full = torch.empty(p.shape, dtype=p.dtype, device=device)
            fill(name, full)
            if isinstance(p, DTensor):
                # src_data_rank=None: each rank cuts its own shard out of the same values, no communication
                local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
                p.to_local().copy_(local)
            else:
                p.copy_(full)
            del full
        for name, value in kept.items():
            model.get_buffer(name).copy_(value)
    if init_buffers is not None:
        init_buffers(model)
