"""OffloadTrainer: transformers' Trainer with the model's layer stacks offloaded, one change for a user (the class);
OffloadTrainerMixin gives any Trainer subclass the same (`class SFT(OffloadTrainerMixin, trl.SFTTrainer)`).

The Offloader is the Trainer's optimizer: built from TrainingArguments (learning_rate, adam_beta1/2, adam_epsilon,
weight_decay with the usual no-decay names, gradient_accumulation_steps, max_grad_norm) and an optional
OffloadConfig. Trainer's own backward (`accelerator.backward(loss)`, a plain loss.backward()) drives it. Four of
Trainer's steps change, each for a reason the Offloader owns:
- clipping: the streamed layers' gradients are consumed in backward, so Trainer's clip_grad_norm_ would see a
  part of them; the Offloader clips by the global norm in step(), and that norm is what `grad_norm` logs;
- checkpoints: the weights are written from where they live (Offloader.save_pretrained), the optimizer state with
  save_state/load_state (the host buffers never copied whole into memory), and resume_from_checkpoint reads both;
- device placement: the Offloader placed the model; Trainer must not move it;
- resuming: only from a checkpoint whose save finished (a run killed mid-save leaves a directory Trainer would
  pick); `resume_from_checkpoint=True` takes the newest whole one.
On a GPU the layout (resident layers, device buffers) is chosen from the memory plan of a micro-batch, as
offload-train's default `auto` chooses it, unless offload_config names one.
"""
from __future__ import annotations

import logging
import os
import warnings
from typing import Any

import torch
from transformers import Trainer
from transformers.trainer import SCHEDULER_NAME, TRAINING_ARGS_NAME

from offload_ext.config import OffloadConfig
from offload_ext.engine.offloader import Offloader
from offload_ext.integrations.trainer_checkpoints import resume_target
from offload_ext.planning.auto_layout import LayoutChoice, leaves_layout, planned_layout
from offload_ext.planning.choices import Settings
from offload_ext.planning.memory import Machine
from offload_ext.planning.param_groups import build_groups
from offload_ext.planning.plan import machine as this_machine

_NO_DECAY = ("bias", "norm")  # Trainer's rule: biases and LayerNorm/RMSNorm weights take no weight decay
logger = logging.getLogger(__name__)


class OffloadTrainerMixin:
    """Put before a Trainer class: its optimizer becomes an Offloader. `offload_config` sets what
    TrainingArguments does not (precision, activation checkpointing, tuning); the device is TrainingArguments'
    (its `cpu` is the simulated device). `seq_len`: the longest sequence of a micro-batch, which the layout is
    planned for (default: TRL's `max_length` where the arguments have one); `layout_choice` says what was chosen."""

    def __init__(self, model: torch.nn.Module, args: Any, *trainer_args: Any,
                 offload_config: OffloadConfig | None = None, seq_len: int | None = None, **kwargs: Any) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError("OffloadTrainer: pass the model itself (e.g. AutoModelForCausalLM.from_pretrained(...) "
                            f"in bf16), not {type(model).__name__}: the Offloader takes it apart before training")
        if kwargs.get("optimizers", (None, None))[0] is not None or kwargs.get("optimizer_cls_and_kwargs"):
            raise ValueError("OffloadTrainer: the Offloader is the optimizer; pass no optimizers= or "
                             "optimizer_cls_and_kwargs= (its learning rate and betas come from TrainingArguments)")
        config = _device_config(args, offload_config)
        self.layout_choice = trainer_layout(model, args, config, seq_len, this_machine(config.device, model=model))
        if self.layout_choice is not None:
            logger.info("OffloadTrainer: layout resident_layers=%d, device_layers=%d (%s)",
                        self.layout_choice.resident_layers, self.layout_choice.device_layers, self.layout_choice.reason)
            config = config.replace(resident_layers=self.layout_choice.resident_layers,
                                    device_layers=self.layout_choice.device_layers)
        self.offloader = _offloader(model, args, config)
        kwargs["optimizers"] = (self.offloader, kwargs.get("optimizers", (None, None))[1])
        super().__init__(model, args, *trainer_args, **kwargs)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """Trainer.train, resuming only from a checkpoint whose save finished (trainer_checkpoints.resume_target)."""
        return super().train(resume_target(self.args.output_dir, resume_from_checkpoint), *args, **kwargs)

    def _move_model_to_device(self, model: torch.nn.Module, device: torch.device) -> None:
        pass  # the Offloader put each part where it lives

    def _clip_grad_norm(self, model: torch.nn.Module) -> None:
        return None  # clipped by the Offloader's step(), by the global norm

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> None:
        return None  # known after step(): _maybe_log_save_evaluate logs it

    def _maybe_log_save_evaluate(self, tr_loss: torch.Tensor, grad_norm: Any, *args: Any, **kwargs: Any) -> None:
        super()._maybe_log_save_evaluate(tr_loss, self.offloader.last_grad_norm, *args, **kwargs)
        tuning = self.offloader.redo_tuning
        news = tuning.news() if tuning is not None else None
        if news is not None:
            logger.info("OffloadTrainer: device redo of clipped steps: %s; offload_config=OffloadConfig."
                        "from_options(device_redo_layers=%d) fixes it", news, tuning.chosen)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        self.offloader.save_pretrained(output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self.offloader.save_state(output_dir)
        torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        pass  # the weights come back with the optimizer state (load_state), in _load_optimizer_and_scheduler

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        self.offloader.load_state(checkpoint)
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))


class OffloadTrainer(OffloadTrainerMixin, Trainer):
    """`Trainer` whose optimizer is an Offloader (see OffloadTrainerMixin)."""


def _device_config(args: Any, config: OffloadConfig | None) -> OffloadConfig:
    """`config` (or the defaults) with what TrainingArguments set: the device, accumulation and clipping."""
    if args.max_grad_norm is not None and args.max_grad_norm < 0:
        raise ValueError(f"OffloadTrainer: max_grad_norm={args.max_grad_norm}: use 0 (or None) for no clipping")
    if args.optim not in ("adamw_torch", "adamw_torch_fused"):
        raise ValueError(f"OffloadTrainer: optim={args.optim!r}: the Offloader steps AdamW on the host; use "
                         "optim='adamw_torch' (or 'adamw_torch_fused')")
    device = "cpu" if args.device.type == "cpu" else str(args.device)
    base = config if config is not None else OffloadConfig()
    return base.replace(device=device, grad_accum=args.gradient_accumulation_steps,
                        max_grad_norm=args.max_grad_norm or None)


def trainer_layout(model: torch.nn.Module, args: Any, config: OffloadConfig, seq_len: int | None,
                   machine: Machine) -> LayoutChoice | None:
    """The layout for Trainer's micro-batch (per_device_train_batch_size x `seq_len`, its loss over all logits at
    once as transformers computes it) on `machine`, as offload-train's `auto` plans it; None where `config` names a
    layout of its own or there is no GPU to plan for. Without a sequence length it warns and keeps the fixed one."""
    if not machine.cuda or not leaves_layout(config):
        return None
    seq_len = seq_len or getattr(args, "max_length", None) or getattr(args, "max_seq_length", None)
    if seq_len is None:
        warnings.warn("OffloadTrainer: no sequence length to plan the GPU layout with: pass seq_len= (the longest "
                      "sequence of a micro-batch); the fixed layout (no resident layers, 2 device buffers) is used",
                      stacklevel=3)
        return None
    settings = Settings(config, batch_size=args.per_device_train_batch_size, seq_len=seq_len,
                        loss_chunk_tokens=args.per_device_train_batch_size * seq_len, loss_kernel="torch")
    _, group_of = build_groups(model, None, _NO_DECAY)
    return planned_layout(model, settings, machine, group_of)


def _offloader(model: torch.nn.Module, args: Any, config: OffloadConfig) -> Offloader:
    """The Offloader TrainingArguments describe, on `config` (_device_config's)."""
    return Offloader(model, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                     weight_decay=args.weight_decay, no_decay=_NO_DECAY, config=config)
