"""offload-train's training run: the offloaded step (Offloader) or the plain one (a device optimizer),
driven by one LR schedule, and checkpoints that resume exactly."""
from __future__ import annotations

import os
import random
import time
from collections.abc import Iterable
from typing import Any, Callable

import numpy as np
import torch

from offload_ext.config import eight_bit, stochastic
from offload_ext.engine.layers import enable_activation_checkpointing
from offload_ext.models.lora import is_adapter
from offload_ext.models.losses import causal_lm_loss
from offload_ext.models.weight_source import WeightSource
from offload_ext.planning.param_groups import build_groups
from offload_ext.train import checkpoint_manifest, interrupt, run_dir
from offload_ext.train import data as data_mod
from offload_ext.train.chat import ChatBatch
from offload_ext.train.config import TrainConfig
from offload_ext.train.errors import CheckpointWriteError, UsageError, write_refusal


def mark_phase(phases: dict[str, float] | None, device: torch.device, name: str, last: bool = False) -> None:
    """Adds the seconds since the previous mark to phases[name], the device synchronized first (nothing when
    `phases` is None); the first mark's name is only a start; `last` drops the running mark."""
    if phases is None:
        return
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    now = time.perf_counter()
    if "_mark" in phases:
        phases[name] = phases.get(name, 0.0) + now - phases["_mark"]
    phases["_mark"] = now
    if last:
        del phases["_mark"]


class Trainer:
    """One training run: the offloaded path (Offloader) or the plain one (device optimizer)."""

    def __init__(self, config: TrainConfig, model: torch.nn.Module, device: torch.device, simulated: bool,
                 weights: WeightSource | None = None):
        self.config, self.model, self.device = config, model, device
        self.off = None
        self.opt = None
        self.last_grad_norm: float | None = None
        self.last_clip_action: str | None = None  # the Offloader's: committed / redone (speculative), ...
        if config.offloaded:
            from offload_ext.engine.offloader import Offloader

            self.off = Offloader(model, lr=config.lr, weight_decay=config.weight_decay, no_decay=config.no_decay,
                                 config=config.offload.replace(device=device), weights=weights)
        else:
            self._plain_setup(simulated)
        self.optimizer: torch.optim.Optimizer = self.off if self.off is not None else self.opt
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, config.lr_factor)

    def _plain_setup(self, simulated: bool) -> None:
        c, o, model = self.config, self.config.offload, self.model
        if simulated:
            raise UsageError("--device cpu-sim runs the offload engine: pick --backend native or python")
        if o.offload_all:
            raise UsageError("--offload-all needs an offload backend (--backend native or python)")
        for p in model.parameters():
            p.data = p.data.to(self.device, torch.bfloat16)
        model.to(self.device)
        if o.activation_offload:
            raise UsageError("--activation-offload needs an offload backend (--backend native or python)")
        if o.activation_checkpointing not in ("all", "none"):
            raise UsageError(f"--activation-checkpointing {o.activation_checkpointing}: without offload, HF "
                             "checkpoints every layer or none: use all or none, or an offload backend (--backend "
                             "native)")
        if o.activation_checkpointing == "all":
            enable_activation_checkpointing(model)
        if o.compile_layers:
            for layer in model.model.layers:
                layer.compile()
        params, _ = build_groups(model, None, c.no_decay)  # the Offloader's groups, for torch's AdamW
        if self.device.type == "cuda" and (o.precision == "mixed" or eight_bit(o.precision)):
            where = "fp32 masters" if o.precision == "mixed" else "8-bit moments"
            raise UsageError(f"--precision {o.precision} needs an offload backend on a GPU ({where} live on the "
                             "host); use --backend native, or --precision bf16 with --backend none")
        if self.device.type == "cuda" and o.precision == "bf16-sr":
            from offload_ext.optim.cpu_adamw import StochasticAdamW

            self.opt = StochasticAdamW(params, seed=c.seed, lr=c.lr, weight_decay=c.weight_decay)
        elif self.device.type == "cuda":
            self.opt = torch.optim.AdamW(params, lr=c.lr, weight_decay=c.weight_decay, fused=True)
        else:
            from offload_ext.optim.cpu_adamw import (
                CPUAdamW,  # choose_device has said that this run trains on the CPU without offload
            )

            self.opt = CPUAdamW(params, lr=c.lr, weight_decay=c.weight_decay, master_weights=o.precision == "mixed",
                                stochastic_rounding=stochastic(o.precision), eight_bit=eight_bit(o.precision),
                                sr_seed=c.seed)

    def _micro_batches(self, stream: data_mod.TokenStream, backward: Callable[[torch.Tensor], None],
                       phases: dict[str, float] | None) -> float:
        """Forward and `backward` over --grad-accum micro-batches, each loss scaled by 1/N; their summed loss.
        `phases` gets the seconds of forwards and backwards, the device synchronized between them."""
        c, o = self.config, self.config.offload
        total = 0.0
        for _ in range(o.grad_accum):
            batch = stream.next_batch().to(self.device)
            loss = causal_lm_loss(self.model, *_inputs(batch), chunk_tokens=c.loss_chunk_tokens, kernel=c.loss_kernel,
                                  **_packing(batch))
            loss = loss / o.grad_accum
            mark_phase(phases, self.device, "forward")
            backward(loss)
            total += loss.item()
            mark_phase(phases, self.device, "backward")
        return total

    @property
    def lr(self) -> float:
        """The learning rate of the coming step (set by the schedule)."""
        return self.optimizer.param_groups[0]["lr"]

    def train_step(self, stream: data_mod.TokenStream, phases: dict[str, float] | None = None) -> float:
        """One optimizer step; its summed loss. With `phases` (a dict), the step is timed by phase
        (forward, backward, step, in seconds; the device synchronized at each boundary): offload-train does
        it for its first step, where the warm-up is."""
        o = self.config.offload
        mark_phase(phases, self.device, "_start")
        if self.off is not None:
            total = self._micro_batches(stream, self.off.backward, phases)
            self.off.step()
            self.last_grad_norm = self.off.last_grad_norm
            self.last_clip_action = self.off.last_clip_action
        else:
            total = self._micro_batches(stream, torch.Tensor.backward, phases)
            if o.max_grad_norm is not None:
                self.last_grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), o.max_grad_norm))
            self.opt.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.schedule.step()
        mark_phase(phases, self.device, "step", last=True)
        return total

    # ------------------------------------------------------------------ checkpoints

    def save(self, step: int, stream: data_mod.TokenStream, tokenizer: Any) -> str:
        """Checkpoint `step` as one unit (offload_ext.train.run_dir): written into a fresh step directory, sealed by
        its manifest; the path of the complete checkpoint. A write the system refuses (a full disk) raises
        CheckpointWriteError once the partial directory is removed: the complete checkpoints before it stand."""
        try:
            return self._save(step, stream, tokenizer)
        except Exception as exc:
            interrupt.raise_if_pressed()  # Ctrl-C inside torch.save's write comes out as torch's RuntimeError
            reason = write_refusal(exc)
            if reason is None:
                raise
            run_dir.abandon(self.config.out, step)
            raise CheckpointWriteError(step, reason) from exc

    def checkpoint_estimate(self) -> int:
        """About the bytes a checkpoint of this run takes (the tensors _save writes; its small files aside): known
        once the first step has made the optimizers' state."""
        if self.off is not None:
            return self.off.saved_nbytes(include=is_adapter if self.config.adapter_only else None)
        moments = (t for state in self.opt.state.values() for t in state.values() if isinstance(t, torch.Tensor))
        weights = _nbytes(self.model.state_dict().values())
        return 2 * weights + _nbytes(moments)  # the safetensors file; trainer_state.pt's copy and the moments

    def _save(self, step: int, stream: data_mod.TokenStream, tokenizer: Any) -> str:
        ckpt = run_dir.begin(self.config.out, step)
        weights = None
        if self.off is not None and self.config.adapter_only:  # the adapter alone, as peft saves it
            self.model.save_pretrained(ckpt, state_dict=self.off.model_state_dict(include=is_adapter))
        elif self.off is not None:
            self.off.save_pretrained(ckpt)  # from the host buffers, a tensor at a time
        else:
            weights = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
            # save_pretrained consumes the dict it is given; the trainer state keeps its own.
            self.model.save_pretrained(ckpt, state_dict=dict(weights), safe_serialization=True)
        run_dir.boundary("weights", step)
        if self.off is not None:
            self.off.save_state(ckpt)  # likewise: no copy of the engine's buffers in memory
        run_dir.boundary("engine", step)
        save_tokenizer(tokenizer, ckpt)
        run_dir.boundary("tokenizer", step)
        state = {
            "step": step,
            "data": stream.state(),
            "engine": None,  # the Offloader's: engine_state.* and engine_device.* beside this file (save_state)
            "optimizer": self.opt.state_dict() if self.opt is not None else None,
            "schedule": self.schedule.state_dict(),
            "model": weights,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
            "args": dict(self.config.flags),
        }
        save_trainer_state(state, ckpt)
        run_dir.boundary("trainer_state", step)
        return run_dir.commit(self.config.out, ckpt, step, dict(self.config.flags), self.config.keep_checkpoints)

    def load(self, stream: data_mod.TokenStream, ckpt: checkpoint_manifest.Checkpoint) -> int:
        """Continue from `ckpt` (verified by prior_run.find, its flags checked): the step it ends."""
        state = trainer_state(ckpt)
        if self.off is not None and state["engine"] is not None:  # made before save_state existed
            self.off.load_state_dict(state["engine"])
        elif self.off is not None:
            self.off.load_state(ckpt.path)
        else:
            self.model.load_state_dict({k: v.to(self.device) for k, v in state["model"].items()}, strict=False)
            self.opt.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        stream.restore(state["data"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        if state["rng"]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        return int(state["step"])


def _inputs(batch: torch.Tensor | ChatBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(input_ids, labels): a window of text is its own labels; packed chat has the assistant's tokens only."""
    return (batch.input_ids, batch.labels) if isinstance(batch, ChatBatch) else (batch, None)


def _packing(batch: torch.Tensor | ChatBatch) -> dict[str, torch.Tensor]:
    """Packed examples' position ids and block-diagonal attention (none for windows of text)."""
    if isinstance(batch, ChatBatch):
        return {"position_ids": batch.position_ids, "attention_mask": batch.attention_mask}
    return {}


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """Their bytes, a tensor met twice (tied weights under two names) once, as the files hold it."""
    unique = {(t.data_ptr(), t.dtype, tuple(t.shape)): t for t in tensors}
    return sum(t.numel() * t.element_size() for t in unique.values())


def save_trainer_state(state: dict[str, Any], directory: str) -> None:
    """`state` as the checkpoint's trainer_state.pt, through a Python file: a write the system refuses then raises
    torch.save's error from the OSError that names the reason (written to a path, torch's own writer drops it)."""
    with open(os.path.join(directory, "trainer_state.pt"), "wb") as f:
        torch.save(state, f)


def save_tokenizer(tokenizer: Any, directory: str) -> None:
    """A checkpoint's tokenizer: a transformers one as it saves itself, the run's own as tokenizer.json."""
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(directory)
    else:
        tokenizer.save(os.path.join(directory, "tokenizer.json"))


def trainer_state(ckpt: checkpoint_manifest.Checkpoint) -> dict[str, Any]:
    """`ckpt`'s trainer_state.pt, refused unless it names the manifest's step (every part of a checkpoint names
    one step)."""
    path = os.path.join(ckpt.path, "trainer_state.pt")
    state = torch.load(path, weights_only=False)
    if state["step"] != ckpt.step:
        raise UsageError(f"--resume: torn checkpoint: {path} is of step {state['step']}, its manifest of step "
                         f"{ckpt.step}")
    return state
