"""offload-train's model: built with its parameters on the meta device and the weight source that fills
them in the engine (a checkpoint's, or drawn by the model's init rule), or whole by transformers without
offload. The rest of a run's set-up: the device and the defaults (machine.py), what --model names
(model_configs.py), the tokenizer and token stream (tokens.py)."""
from __future__ import annotations

import argparse
from typing import Any

import torch

from offload_ext.models.weight_source import WeightSource
from offload_ext.models.weights import dtype_keyword, from_config_empty, from_pretrained_empty
from offload_ext.train.errors import UsageError
from offload_ext.train.model_configs import BUILTIN, model_config, wants_pretrained


def bf16_llama(cfg: Any) -> torch.nn.Module:
    """A random-init LlamaForCausalLM whose parameters are born bf16, the dtype it trains in: no fp32
    copy of the model is ever made."""
    from transformers import LlamaForCausalLM

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)


def build_model(args: argparse.Namespace, vocab_size: int,
                device: torch.device) -> tuple[torch.nn.Module, WeightSource | None]:
    """The model, and with an offload backend the weights its meta parameters are filled from: the
    checkpoint's (--pretrained), or drawn by the model's init rule on the training `device`
    (--from-scratch), straight into the engine; without one, transformers builds or loads the whole model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    cfg = model_config(args, vocab_size)
    if args.model in BUILTIN:
        if args.backend != "none":  # built on the meta device, drawn layer by layer into the engine
            return from_config_empty(cfg, seed=args.seed, device=device)
        return bf16_llama(cfg), None
    if wants_pretrained(args):
        if args.backend != "none":
            try:
                return from_pretrained_empty(args.model)
            except (FileNotFoundError, KeyError, ValueError) as exc:
                raise UsageError(f"--pretrained {args.model}: {exc}") from exc
        return AutoModelForCausalLM.from_pretrained(args.model, **{dtype_keyword(): torch.bfloat16}), None
    if args.backend != "none":
        return from_config_empty(cfg, seed=args.seed, device=device)
    return AutoModelForCausalLM.from_config(cfg), None
