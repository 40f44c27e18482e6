"""What --model names: a built-in config (BUILTIN: a shape, made a transformers config sized for the
tokenizer), a model directory or a hub id; whether its weights are fine-tuned or drawn fresh, and the
tokenizer it comes with."""
from __future__ import annotations

import argparse
import os
from typing import Any

from offload_ext.train.errors import UsageError

BUILTIN = {
    # name: (hidden, layers, heads, kv heads, intermediate, tied, tokenizer vocab, model vocab or None)
    "tiny": (64, 4, 4, 2, 176, True, 1024, None),
    "small": (512, 8, 8, 4, 1408, True, 4096, None),
    # Llama-3.2-1B's shape, its 128256-entry embedding included (the embedded tokenizer uses 8192 of them).
    "llama-1b": (2048, 16, 32, 8, 8192, True, 8192, 128256),
    "llama-8b": (4096, 32, 32, 8, 14336, False, 8192, 128256),  # Llama-3.1-8B's shape
    "qwen-14b": (5120, 48, 40, 8, 13824, False, 8192, 152064),  # Qwen2.5-14B's shape (a Qwen2 model)
    "mistral-24b": (5120, 40, 32, 8, 32768, False, 8192, 131072),  # Mistral-Small-24B's shape
    "llama-70b": (8192, 80, 64, 8, 28672, False, 8192, 128256),  # Llama-3.1-70B's shape
}
# Config fields a built-in's shape has beyond the tuple: Mistral-Small's heads are 128 wide (not hidden / heads),
# its rope base 1e8; without a sliding window its layers are Llama's.
_EXTRA = {"mistral-24b": {"head_dim": 128, "rope_theta": 1e8}}
SMALL_BUILTINS = {"tiny", "small"}  # the built-ins whose default learning rate is 3e-3
_QWEN2 = {"qwen-14b"}  # built as Qwen2 (biased q/k/v projections, rope theta 1e6); the rest as Llama

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")


def has_any(directory: str, names: tuple[str, ...]) -> bool:
    return any(os.path.exists(os.path.join(directory, f)) for f in names)


def wants_pretrained(args: argparse.Namespace) -> bool:
    """--pretrained / --from-scratch as given; else what --model says: a built-in config is drawn fresh, a
    model directory with weights (or a hub id) is fine-tuned from them, a directory with a config alone is
    drawn fresh."""
    if args.pretrained is not None:
        return args.pretrained
    if args.model in BUILTIN or args.model == "auto":
        return False
    if os.path.isdir(args.model):
        return has_any(args.model, _WEIGHT_FILES)
    return True


def tokenizer_name(args: argparse.Namespace) -> str | None:
    """The HF tokenizer the run uses (None: one trained on the embedded corpus): --tokenizer, else the
    model's own (a pretrained one's always; one drawn fresh from a directory's config when it has one)."""
    if args.tokenizer or args.model in BUILTIN or args.model == "auto":
        return args.tokenizer
    if wants_pretrained(args) or (os.path.isdir(args.model) and has_any(args.model, TOKENIZER_FILES)):
        return args.model
    return None


def model_config(args: argparse.Namespace, vocab_size: int) -> Any:
    """The transformers config of --model: a built-in's (sized for the tokenizer), or the directory's or hub
    id's as it is, refused when the tokenizer has ids past its embedding. LoRA is refused on a base drawn
    at random."""
    from transformers import AutoConfig, LlamaConfig, Qwen2Config

    pretrained = wants_pretrained(args)
    if args.lora_r is not None and not pretrained:
        raise UsageError(f"--lora-r: the base model would be drawn at random ({_fresh(args)}) and is never saved, so "
                         "the adapters would be trained on noise and useless; fine-tune a model with weights (--model "
                         "DIR or a hub id, with --pretrained), or leave --lora-r out to train the whole model")
    if args.model in BUILTIN:
        if pretrained:
            raise UsageError(f"--pretrained: built-in config {args.model!r} has no weights; use --from-scratch")
        hidden, layers, heads, kv, inter, tied, _, model_vocab = BUILTIN[args.model]
        qwen = args.model in _QWEN2
        return (Qwen2Config if qwen else LlamaConfig)(
            vocab_size=max(vocab_size, model_vocab or 0), hidden_size=hidden, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=inter, tie_word_embeddings=tied,
            max_position_embeddings=max(2048, args.seq_len), **{"rope_theta": 1e6 if qwen else 500000.0,
                                                                  **_EXTRA.get(args.model, {})},
            use_cache=False, **_special_ids(args))
    try:
        cfg = AutoConfig.from_pretrained(args.model)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--model {args.model!r} is not a built-in config ({', '.join(BUILTIN)}), a local model "
                         f"directory, or a reachable hub id ({type(exc).__name__}: {str(exc).splitlines()[0]})"
                         ) from exc
    if cfg.vocab_size < vocab_size:  # never resized: the run would not be the model the directory describes
        raise UsageError(f"--model {args.model}: the tokenizer has {vocab_size} tokens, more than the model's "
                         f"embedding of {cfg.vocab_size} (vocab_size in its config.json); pass the model's own "
                         f"tokenizer or one of at most {cfg.vocab_size} tokens with --tokenizer, or raise vocab_size "
                         "in a copy of the config to train from scratch")
    return cfg


def _special_ids(args: argparse.Namespace) -> dict[str, int]:
    """A built-in model's bos/eos ids: the embedded tokenizer's <|endoftext|> (id 0, its first token), so
    that generate() stops where the tokenizer ends a text (the configs' defaults, 1 and 2, are ordinary
    tokens there). pad_token_id stays unset: as the embedding's padding_idx it would freeze that row."""
    if tokenizer_name(args) is not None:
        return {}
    return {"bos_token_id": 0, "eos_token_id": 0}


def _fresh(args: argparse.Namespace) -> str:
    if args.model in BUILTIN or args.model == "auto":
        return f"--model {args.model} is a built-in config"
    return "--from-scratch" if args.pretrained is False else f"--model {args.model} has no weights"
