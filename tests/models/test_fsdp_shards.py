"""FSDP2 shards on two gloo processes of the CPU: a model built on the meta device gets each rank's shards from
materialize_shards and trains as the same model built whole; CPUAdamW's sharded states go through
torch.distributed.checkpoint and a resumed run continues identically."""
from __future__ import annotations

import os

import torch
from torch import nn

import offload_ext
from helpers import gloo_mesh, shard_linears, spawn_ranks


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(33, 64), nn.GELU(), nn.Linear(64, 17))


def _train(model: nn.Module, opt: torch.optim.Optimizer, seed: int, steps: int) -> list[float]:
    gen, losses = torch.Generator().manual_seed(seed), []
    for _ in range(steps):
        loss = model(torch.randn(4, 33, generator=gen)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _meta_worker(rank: int, world: int, store: str, out: str) -> None:
    from offload_ext.models.fsdp_shards import materialize_shards

    with gloo_mesh(rank, world, store) as mesh:
        source = dict(_model().named_parameters())  # the values a checkpoint would hold
        runs = {}
        for built in ("real", "meta"):
            if built == "real":
                model = _model()
            else:
                with torch.device("meta"):
                    model = _model()
            shard_linears(model, mesh)
            if built == "meta":
                materialize_shards(model, lambda name, dst: dst.copy_(source[name]), "cpu")
            shards = [p.to_local().detach().clone() for p in model.parameters()]
            runs[built] = (shards, _train(model, offload_ext.CPUAdamW(model.parameters(), overlap=True), rank, 3))
        torch.save(runs, os.path.join(out, f"rank{rank}.pt"))


def _spawn(worker, out) -> list[dict]:
    """Run worker(rank, 2, store, out) on two processes; what each saved as out/rank<r>.pt."""
    spawn_ranks(worker, 2, str(out))
    return [torch.load(os.path.join(out, f"rank{rank}.pt")) for rank in range(2)]


def test_a_model_built_on_meta_gets_each_ranks_shards_and_trains_as_one_built_whole(tmp_path) -> None:
    for rank, runs in enumerate(_spawn(_meta_worker, tmp_path)):
        for a, b in zip(runs["meta"][0], runs["real"][0]):
            assert torch.equal(a, b), rank
        assert runs["meta"][1] == runs["real"][1], rank


def _dcp_worker(rank: int, world: int, store: str, out: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    with gloo_mesh(rank, world, store) as mesh:

        def sharded() -> tuple[nn.Module, offload_ext.CPUAdamW]:
            model = shard_linears(_model(), mesh)
            return model, offload_ext.CPUAdamW(model.parameters(), lr=1e-2, overlap=True, max_grad_norm=1.0)

        def train(model: nn.Module, opt: offload_ext.CPUAdamW, seed: int) -> list[float]:
            return _train(model, opt, seed + 10 * rank, 2)

        model, opt = sharded()
        train(model, opt, 0)
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(out, "ckpt"))
        continued = train(model, opt, 1)
        model, opt = sharded()  # a fresh run resumed from the checkpoint
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=os.path.join(out, "ckpt"))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        torch.save({"continued": continued, "resumed": train(model, opt, 1)}, os.path.join(out, f"rank{rank}.pt"))


def test_a_distributed_checkpoint_of_the_shards_and_their_states_resumes_identically(tmp_path) -> None:
    for rank, runs in enumerate(_spawn(_dcp_worker, tmp_path)):
        assert runs["resumed"] == runs["continued"], rank
