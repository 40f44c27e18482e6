"""offload-train --fsdp under torchrun: FSDP2 (fully_shard per decoder layer and the root; CPUOffloadPolicy on
GPUs) with CPUAdamW stepping each rank's shards (in backward without clipping, after it with), the model built
on the meta device and each rank's shards filled from the run's weights (offload_ext.models.fsdp_shards), each
rank its own batches, and checkpoints committed as the single-GPU trainer's are (offload_ext.train.run_dir: a
step directory sealed by its manifest): the gathered weights as HF safetensors, written by rank 0, beside a
distributed checkpoint to resume from, written by every rank."""
from __future__ import annotations

import argparse
import copy
import os
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from offload_ext.config import eight_bit, stochastic
from offload_ext.engine.layers import enable_activation_checkpointing
from offload_ext.models.fsdp_shards import materialize_shards
from offload_ext.models.weight_source import WeightSource
from offload_ext.optim.cpu_adamw import CPUAdamW
from offload_ext.planning.param_groups import build_groups
from offload_ext.train import data as data_mod
from offload_ext.train import interrupt, run_dir
from offload_ext.train.checkpoint_manifest import Checkpoint
from offload_ext.train.config import TrainConfig
from offload_ext.train.errors import CheckpointWriteError, UsageError, write_refusal
from offload_ext.train.trainer import mark_phase, save_tokenizer, save_trainer_state, trainer_state

# Flags of the single-GPU engine that have no meaning here: refused, naming the flag.
_ENGINE_ONLY = {"offload_all": "--offload-all", "resident_layers": "--resident-layers",
                "activation_offload": "--activation-offload", "compile": "--compile", "trace": "--trace",
                "lora_r": "--lora-r", "gpu_memory_budget": "--gpu-memory-budget"}


def check_fsdp_args(args: argparse.Namespace) -> None:
    if args.task != "lm":
        raise UsageError("--fsdp trains --task lm (windows of text); --task sft runs on one device")
    for key, flag in _ENGINE_ONLY.items():
        if getattr(args, key):
            raise UsageError(f"{flag} is an option of the single-GPU engine; --fsdp shards with FSDP2 instead: "
                             f"drop {flag}")
    if args.activation_checkpointing not in ("all", "none"):
        raise UsageError(f"--fsdp: --activation-checkpointing {args.activation_checkpointing}: FSDP2's layers "
                         "recompute all or none (use all or none)")
    if eight_bit(args.precision):
        raise UsageError(f"--fsdp: --precision {args.precision}: CPUAdamW keeps 8-bit moments for plain tensors, "
                         "not FSDP2's sharded ones; use --precision bf16, bf16-sr or mixed with --fsdp")
    if args.device_layers not in (None, 2):
        raise UsageError("--device-layers is an option of the single-GPU engine; drop it with --fsdp")


def init_process_group(device: torch.device) -> None:
    """The process group torchrun describes (nccl on GPUs, gloo on the CPU)."""
    if "RANK" not in os.environ:
        raise UsageError("--fsdp runs under torchrun: torchrun --nproc-per-node N -m offload_ext.train.cli --fsdp ...")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def rank_device(device: torch.device) -> torch.device:
    """This rank's device: cuda:LOCAL_RANK on a GPU box."""
    if device.type != "cuda":
        return device
    index = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


class RankBatches:
    """Every rank reads the same stream and keeps every world-th batch, its own: ranks see disjoint data, and
    the stream's state (saved on rank 0) is the same on all."""

    def __init__(self, stream: data_mod.TokenStream) -> None:
        self.stream, self.rank, self.world = stream, dist.get_rank(), dist.get_world_size()

    def next_batch(self) -> torch.Tensor:
        batches = [self.stream.next_batch() for _ in range(self.world)]
        return batches[self.rank]


class FsdpTrainer:
    """The Trainer interface (lr, train_step, save, load) over an FSDP2 model and CPUAdamW."""

    off = None  # no Offloader: the loop's engine-only columns stay out of the metrics

    def __init__(self, config: TrainConfig, model: torch.nn.Module, weights: WeightSource | None,
                 device: torch.device) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        self.config, self.device = config, device
        o = config.offload
        self.last_grad_norm: float | None = None
        self.last_clip_action: str | None = None
        # The weights know the meta model's parameters (and draw by its modules): a copy of it is sharded,
        # the meta model itself stays as the weights' key, costing no memory.
        originals = dict(model.named_parameters())
        model = copy.deepcopy(model)
        if o.activation_checkpointing == "all":
            enable_activation_checkpointing(model)
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        policy = dict(offload_policy=CPUOffloadPolicy()) if device.type == "cuda" else {}
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, **policy)
        fully_shard(model, mesh=mesh, **policy)
        if weights is not None:
            materialize_shards(model, lambda name, dst: weights.fill(originals[name], dst), "cpu")
        self.model = model
        groups, _ = build_groups(model, None, config.no_decay)
        # Without clipping each shard steps in backward once its gradient is on the host (the step waits for that
        # copy alone), hidden under the layers' backward below it. Clipping needs every rank's gradients for the
        # norm first, and steps taken before it would keep a second copy of the state on the host to be redone
        # whenever a step clips: after backward then (docs/performance.md, FSDP2 with CPUAdamW).
        self.opt = CPUAdamW(groups, lr=config.lr, weight_decay=config.weight_decay,
                            max_grad_norm=o.max_grad_norm, master_weights=o.precision == "mixed",
                            stochastic_rounding=stochastic(o.precision), sr_seed=config.seed,
                            overlap=o.max_grad_norm is None)
        self.optimizer = self.opt
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.opt, config.lr_factor)

    def describe(self) -> str:
        """How the run steps, as offload-train prints it."""
        when = "in backward, each once its gradient is on the host" if self.opt.overlap is not None else \
            "after backward (--max-grad-norm needs the global norm first)"
        return f"FSDP2 over {dist.get_world_size()} ranks, CPUAdamW stepping the shards {when}"

    @property
    def lr(self) -> float:
        return self.opt.param_groups[0]["lr"]

    def train_step(self, stream: data_mod.TokenStream, phases: dict[str, float] | None = None) -> float:
        """One step over the ranks; the mean loss. `phases`: as Trainer.train_step's."""
        accum, batches = self.config.offload.grad_accum, RankBatches(stream)
        total = 0.0
        mark_phase(phases, self.device, "_start")
        for k in range(accum):
            last = k == accum - 1
            self.model.set_requires_gradient_sync(last)  # earlier micro-batches: no reduce-scatter, no step
            batch = batches.next_batch().to(self.device)
            loss = self.model(input_ids=batch, labels=batch).loss / accum  # through the root: FSDP2's hooks
            mark_phase(phases, self.device, "forward")
            loss.backward()
            total += loss.item()
            mark_phase(phases, self.device, "backward")
        self.opt.step()
        self.last_grad_norm, self.last_clip_action = self.opt.last_grad_norm, self.opt.last_clip_action
        self.opt.zero_grad(set_to_none=True)
        self.schedule.step()
        mark_phase(phases, self.device, "step", last=True)
        # the mean over the ranks' losses, as one model's loss over the whole batch
        mean = torch.tensor([total], dtype=torch.float64, device=self.device)  # NCCL reduces device tensors only
        dist.all_reduce(mean)
        return float(mean[0]) / dist.get_world_size()

    def save(self, step: int, stream: data_mod.TokenStream, tokenizer: Any) -> str:
        """Checkpoint `step` as one unit (run_dir): rank 0 makes the fresh step directory, every rank writes its
        shards into it, rank 0 the gathered weights, the tokenizer and the trainer state, then seals it once every
        rank is done; the path of the complete checkpoint. A write the system refuses on any rank raises
        CheckpointWriteError on every rank once the partial directory is removed: the complete checkpoints stand."""
        out, lead = self.config.out, dist.get_rank() == 0
        partial = run_dir.partial_path(out, step)
        # Each phase ends with the ranks agreeing (a collective, so also the barrier between the phases): the
        # directory is fresh before any rank writes into it, every rank's files are written before it is sealed.
        self._agreed(step, lambda: run_dir.begin(out, step) if lead else None)
        self._agreed(step, lambda: self._write(partial, step, stream, tokenizer, lead))
        self._agreed(step, lambda: run_dir.commit(out, partial, step, dict(self.config.flags),
                                                  self.config.keep_checkpoints) if lead else None)
        return run_dir.final_path(out, step)

    def _write(self, partial: str, step: int, stream: data_mod.TokenStream, tokenizer: Any, lead: bool) -> None:
        """This rank's files of checkpoint `step`: its shards; rank 0 also the gathered weights, the tokenizer and
        the trainer state."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(partial, "distributed"))
        run_dir.boundary("engine", step)
        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if lead:  # the gathered weights, as transformers' from_pretrained reads them
            self.model.save_pretrained(partial, state_dict=full, safe_serialization=True)
            run_dir.boundary("weights", step)
            save_tokenizer(tokenizer, partial)
            run_dir.boundary("tokenizer", step)
            state = {"step": step, "data": stream.state(), "schedule": self.schedule.state_dict(),
                     "rng": {"python": random.getstate(), "numpy": np.random.get_state()},
                     "args": dict(self.config.flags), "world_size": dist.get_world_size()}
            save_trainer_state(state, partial)
            run_dir.boundary("trainer_state", step)

    def _agreed(self, step: int, write: Callable[[], object]) -> None:
        """This rank's part of a save, then every rank told whether any rank's write was refused by the system (a
        full disk): if one was, rank 0 removes the partial directory and every rank raises CheckpointWriteError
        with the first refusal, so that no rank waits in a collective the others have left."""
        from torch.distributed.checkpoint.api import CheckpointException

        refused = None
        try:
            write()
        except (Exception, CheckpointException) as exc:  # the distributed save's is raised on every rank
            # Ctrl-C (on this rank, or on one whose failure came in the distributed save's): the interrupt's line
            interrupt.raise_if_pressed()
            if any(isinstance(f, KeyboardInterrupt) for f, _ in getattr(exc, "failures", {}).values()):
                raise KeyboardInterrupt from exc
            refused = write_refusal(exc)
            if refused is None:
                raise
        reasons: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(reasons, refused)
        first = next((r for r in reasons if r is not None), None)
        if first is not None:
            if dist.get_rank() == 0:
                run_dir.abandon(self.config.out, step)
            raise CheckpointWriteError(step, first)

    def load(self, stream: data_mod.TokenStream, ckpt: Checkpoint) -> int:
        """Continue from `ckpt` (verified by prior_run.find, its flags checked): the step it ends."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        state = trainer_state(ckpt)
        if state.get("world_size") != dist.get_world_size():
            raise UsageError(f"--resume: the checkpoint was made by {state.get('world_size')} ranks, this run has "
                             f"{dist.get_world_size()}: resume with --nproc-per-node {state.get('world_size')}")
        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        loaded = {"model": model_sd, "optim": optim_sd}
        dcp.load(loaded, checkpoint_id=os.path.join(ckpt.path, "distributed"))
        set_state_dict(self.model, self.opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
        self.schedule.load_state_dict(state["schedule"])
        stream.restore(state["data"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        return int(state["step"])
