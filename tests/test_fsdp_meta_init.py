"""FSDP2 models built on the meta device and fully_shard'ed: materialize_shards gives each rank its shards
(two gloo processes on the CPU), and they train as the same model built whole and then sharded."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import offload_ext
from helpers import free_port


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(33, 64), nn.GELU(), nn.Linear(64, 17))


def _meta_worker(rank: int, world: int, port: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from offload_ext.fsdp import materialize_shards

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        source = dict(_model().named_parameters())  # the values a checkpoint would hold
        runs = {}
        for built in ("real", "meta"):
            if built == "real":
                model = _model()
            else:
                with torch.device("meta"):
                    model = _model()
            for layer in model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            if built == "meta":
                materialize_shards(model, lambda name, dst: dst.copy_(source[name]), "cpu")
            shards = [p.to_local().detach().clone() for p in model.parameters()]
            opt = offload_ext.CPUAdamW(model.parameters(), overlap=True)
            gen = torch.Generator().manual_seed(rank)
            losses = []
            for _ in range(3):
                loss = model(torch.randn(4, 33, generator=gen)).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            runs[built] = (shards, losses)
        torch.save(runs, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_a_model_built_on_meta_gets_each_ranks_shards_and_trains_as_one_built_whole(tmp_path) -> None:
    mp.spawn(_meta_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        runs = torch.load(os.path.join(tmp_path, f"rank{rank}.pt"))
        for a, b in zip(runs["meta"][0], runs["real"][0]):
            assert torch.equal(a, b), rank
        assert runs["meta"][1] == runs["real"][1], rank
