"""offload-train's inputs: the device, the built-in model configs, the model, tokenizer and token stream."""
from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from offload_ext.models.losses import resolve_loss_backend
from offload_ext.models.weights import WeightSource, dtype_keyword, from_config_empty, from_pretrained_empty
from offload_ext.train import data as data_mod

BUILTIN = {
    # name: (hidden, layers, heads, kv heads, intermediate, tied, tokenizer vocab, model vocab or None)
    "tiny": (64, 4, 4, 2, 176, True, 1024, None),
    "small": (512, 8, 8, 4, 1408, True, 4096, None),
    # Llama-3.2-1B's shape, its 128256-entry embedding included (the embedded tokenizer uses 8192 of them).
    "llama-1b": (2048, 16, 32, 8, 8192, True, 8192, 128256),
    "llama-8b": (4096, 32, 32, 8, 14336, False, 8192, 128256),  # Llama-3.1-8B's shape
    "qwen-14b": (5120, 48, 40, 8, 13824, False, 8192, 152064),  # Qwen2.5-14B's shape (a Qwen2 model)
}
_SMALL = {"tiny", "small"}  # the built-ins whose default learning rate is 3e-3
_QWEN2 = {"qwen-14b"}  # built as Qwen2 (biased q/k/v projections, rope theta 1e6); the rest as Llama


class UsageError(Exception):
    """Bad input: printed without a traceback, with the fix."""


_DEVICES = "cuda, cuda:N, cpu, cpu-sim (the offload engine on the simulated device) or auto"


def resolve_device(args: argparse.Namespace) -> tuple[torch.device, bool]:
    """(device, simulated), and args.backend resolved for it (see resolve_backend)."""
    device, simulated = _device(args.device)
    args.backend = resolve_backend(args, device, simulated)
    return device, simulated


def _device(name: str) -> tuple[torch.device, bool]:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu"), False
    if name == "cpu-sim":
        return torch.device("cpu"), True
    try:
        dev = torch.device(name)
    except RuntimeError as exc:
        raise UsageError(f"--device {name}: not a device; expected {_DEVICES}") from exc
    if dev.type not in ("cuda", "cpu"):
        raise UsageError(f"--device {name}: offload-train runs on CUDA or the CPU; expected {_DEVICES}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: CUDA is not available here; use --device cpu or cpu-sim")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UsageError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s); use "
                         f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return dev, False


def resolve_backend(args: argparse.Namespace, device: torch.device, simulated: bool) -> str:
    """--backend as given, or its default: native, except where the run is on the CPU and not simulated
    (--device cpu, or auto without CUDA), which trains without offload and says so. An explicit offload
    backend on the CPU is refused with the fix: offload there needs the simulated device."""
    on_cpu = device.type == "cpu" and not simulated
    if args.fsdp:  # FSDP2's own CPU offload; --device cpu runs gloo ranks
        return args.backend or "native"
    if args.backend is None:
        if not on_cpu:
            return "native"
        why = "--device cpu" if args.device != "auto" else "no CUDA device"
        print(f"offload-train: {why}: training on the CPU without offload (--backend none); --device cpu-sim runs "
              "the offload engine on the CPU", flush=True)
        return "none"
    if simulated and args.backend == "none":
        raise UsageError("--device cpu-sim runs the offload engine: pick --backend native or python, or --device cpu "
                         "to train on the CPU without offload")
    if on_cpu and args.backend != "none":
        given = f"--backend {args.backend}" + (f" --device {args.device}" if args.device != "auto" else "")
        where = "" if args.device != "auto" else "there is no CUDA device here, and "
        raise UsageError(f"{given}: {where}the offload engine needs a CUDA device or the simulated one; use "
                         "--device cpu-sim to run it on the CPU, or leave --backend out to train on the CPU "
                         "without offload")
    return args.backend


def apply_defaults(args: argparse.Namespace, on_gpu: bool) -> None:
    if args.model == "auto":
        args.model = "small" if on_gpu else "tiny"
    for name, gpu, cpu in (("batch_size", 8, 4), ("seq_len", 512, 64), ("steps", 200, 60)):
        if getattr(args, name) is None:
            setattr(args, name, gpu if on_gpu else cpu)
    if args.warmup_steps is None:
        args.warmup_steps = max(1, args.steps // 20)
    if args.lr is None:  # the small built-ins learn fast; 3e-3 made a random 8 B model diverge at once (run 35)
        args.lr = 3e-3 if args.model in _SMALL else 3e-4


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")


def _has_any(directory: str, names: tuple[str, ...]) -> bool:
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
        return _has_any(args.model, _WEIGHT_FILES)
    return True


def _load_tokenizer(name: str, from_flag: str) -> Any:
    """AutoTokenizer.from_pretrained(name) (a tokenizer.json file through PreTrainedTokenizerFast), with the
    fix named when `name` holds no tokenizer."""
    if os.path.isdir(name) and not _has_any(name, _TOKENIZER_FILES):
        raise UsageError(f"{from_flag} {name}: the directory has no tokenizer (none of {', '.join(_TOKENIZER_FILES)}); "
                         "pass one with --tokenizer NAME_OR_DIR")
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        if os.path.isfile(name):  # AutoTokenizer takes directories and hub ids only
            return PreTrainedTokenizerFast(tokenizer_file=name, **data_mod.special_tokens_of(name))
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"{from_flag} {name}: could not load a tokenizer from it ({first}); pass a working one with "
                         "--tokenizer NAME_OR_DIR") from exc


_NEEDS_TOKENIZER = "--dataset other than 'stdlib' needs --tokenizer (or a pretrained --model to take it from)"


def _tokenizer_name(args: argparse.Namespace) -> str | None:
    """The HF tokenizer the run uses (None: one trained on the embedded corpus): --tokenizer, else the
    model's own (a pretrained one's always; one drawn fresh from a directory's config when it has one)."""
    if args.tokenizer or args.model in BUILTIN or args.model == "auto":
        return args.tokenizer
    if wants_pretrained(args) or (os.path.isdir(args.model) and _has_any(args.model, _TOKENIZER_FILES)):
        return args.model
    return None


def _hf_tokenizer(args: argparse.Namespace) -> Any | None:
    """The HF tokenizer the run uses, loaded (None: one trained on the embedded corpus)."""
    name = _tokenizer_name(args)
    return _load_tokenizer(name, from_flag="--tokenizer" if args.tokenizer else "--model") if name else None


def _embedded_vocab(args: argparse.Namespace) -> int:
    """The size the embedded corpus's tokenizer is trained to: a built-in's, or at most a model directory's
    embedding (a smaller model is never resized to fit the tokenizer)."""
    if args.model in BUILTIN:
        return BUILTIN[args.model][6]
    vocab = BUILTIN["small"][6]
    config = os.path.join(args.model, "config.json")
    if os.path.isfile(config):
        with open(config) as f:
            vocab = min(vocab, int(json.load(f).get("vocab_size") or vocab))
    return vocab


def build_tokenizer(args: argparse.Namespace, texts: Callable[[], list[str]] | None):
    """(encode_batch: texts -> their ids, eos_id, vocab_size, tokenizer to save with checkpoints). `texts`
    gives the embedded corpus, read only if a tokenizer is to be trained on it (None: another dataset).
    Batches encode on the tokenizer's own threads: the embedded corpus one file at a time took 3.6 s of the
    8 B run's set-up on the GPU machine."""
    tok = _hf_tokenizer(args)
    if tok is not None:
        eos = tok.eos_token_id if tok.eos_token_id is not None else 0
        return (lambda ts: tok(ts, add_special_tokens=False)["input_ids"]), eos, len(tok), tok
    if texts is None:
        raise UsageError(_NEEDS_TOKENIZER)
    vocab = _embedded_vocab(args)
    path = os.path.join(args.out, "tokenizer.json")
    tok = data_mod.train_tokenizer(None if os.path.exists(path) else texts(), vocab, path)
    eos = tok.token_to_id(data_mod.END_OF_TEXT)
    # Encoded by the bare BPE (the same ids); saved as transformers' tokenizer, with its special tokens.
    return (lambda ts: [e.ids for e in tok.encode_batch(ts)]), eos, tok.get_vocab_size(), data_mod.hf_tokenizer(tok)


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


def planned_vocab(args: argparse.Namespace) -> int:
    """The tokenizer's vocabulary size the run will have, without training one (what --dry-run builds the
    model with): the named tokenizer's, or the size the embedded one is trained to."""
    tok = _hf_tokenizer(args)
    if tok is not None:
        return len(tok)
    if args.dataset != data_mod.EMBEDDED:
        raise UsageError(_NEEDS_TOKENIZER)
    return _embedded_vocab(args)


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
            max_position_embeddings=max(2048, args.seq_len), rope_theta=1e6 if qwen else 500000.0, use_cache=False,
            **_special_ids(args))
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
    if _tokenizer_name(args) is not None:
        return {}
    return {"bos_token_id": 0, "eos_token_id": 0}


def _fresh(args: argparse.Namespace) -> str:
    if args.model in BUILTIN or args.model == "auto":
        return f"--model {args.model} is a built-in config"
    return "--from-scratch" if args.pretrained is False else f"--model {args.model} has no weights"


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


def _machine_cache(args: argparse.Namespace, max_bytes: int, vocab: int) -> Callable[[str, str], None]:
    """The embedded corpus's tokenizer and tokens, copied into a fresh --out from the machine's cache
    (data.cache_dir) when it has them: a new run skips training the tokenizer and tokenizing (2.5 s of the 8 B
    start, run 66). Returns what puts the run's two files into the cache afterwards. Only the BPE trained on
    the corpus is the same for every run on this machine: with an HF tokenizer nothing is cached."""
    root = data_mod.cache_dir()
    if root is None or _tokenizer_name(args) is not None:
        return lambda tokenizer, corpus: None
    entry = os.path.join(root, data_mod.embedded_entry(max_bytes, vocab))
    cached = [os.path.join(entry, n) for n in ("tokenizer.json", "corpus.npy")]
    ours = (os.path.join(args.out, "tokenizer.json"), _corpus_path(args, vocab))
    if not any(map(os.path.exists, ours)) and all(map(os.path.exists, cached)):
        for src, path in zip(cached, ours):
            _copy_whole(src, path)

    def store(tokenizer: str, corpus: str) -> None:
        if all(map(os.path.exists, cached)):
            return
        try:
            os.makedirs(entry, exist_ok=True)
            for path, dst in zip((tokenizer, corpus), cached):
                _copy_whole(path, dst)
        except OSError as exc:  # a read-only home: this run goes on; the next tokenizes again
            print(f"offload-train: could not cache the tokenized corpus in {entry} ({exc}); set OFFLOAD_EXT_CACHE "
                  "to a writable directory, or to 0 to stop trying", flush=True)
    return store


def _copy_whole(src: str, dst: str) -> None:
    """dst whole under its name or not there (ranks of one run, or two runs, may copy at once)."""
    partial = f"{dst}.{os.getpid()}.partial"
    shutil.copyfile(src, partial)
    os.replace(partial, dst)


def _corpus_path(args: argparse.Namespace, vocab: int) -> str:
    return os.path.join(args.out, f"corpus_{vocab}.npy")


def _corpus_tokens(path: str, texts: Callable[[], list[str]], encode_batch: Callable[[list[str]], list[list[int]]],
                   eos: int) -> np.ndarray:
    """The corpus's tokens, each document followed by eos: from `path` when there, else tokenized and saved."""
    if os.path.exists(path):
        return np.load(path)
    tokens = np.concatenate([np.asarray(ids + [eos], dtype=np.int32) for ids in encode_batch(texts())])
    np.save(path, tokens)
    return tokens


def build_stream(args: argparse.Namespace) -> tuple[data_mod.TokenStream, Any, int]:
    if args.dataset == data_mod.EMBEDDED:
        max_bytes = (8 << 20) if args.model != "tiny" else (2 << 20)
        texts = functools.cache(lambda: data_mod.stdlib_corpus(max_bytes=max_bytes))  # read once, if at all
        store = _machine_cache(args, max_bytes, _embedded_vocab(args))
        encode_batch, eos, vocab, tok = build_tokenizer(args, texts)
        path = _corpus_path(args, vocab)
        tokens = _corpus_tokens(path, texts, encode_batch, eos)
        store(os.path.join(args.out, "tokenizer.json"), path)
        return data_mod.TokenStream(args.batch_size, args.seq_len, args.seed, tokens=tokens), tok, vocab
    encode_batch, eos, vocab, tok = build_tokenizer(args, None)
    data_mod.load_texts(args.dataset, args.split, args.text_field, args.streaming)  # validates the field now
    docs = lambda: data_mod.load_texts(args.dataset, args.split, args.text_field, args.streaming)  # noqa: E731
    return data_mod.TokenStream(args.batch_size, args.seq_len, args.seed, documents=docs,
                                encode=lambda t: encode_batch([t])[0], eos_id=eos), tok, vocab


def check_loss_chunk(args: argparse.Namespace) -> None:
    if args.loss_chunk_tokens < 1:
        raise UsageError(f"--loss-chunk-tokens must be at least 1, got {args.loss_chunk_tokens}")


def check_loss_args(args: argparse.Namespace, device: torch.device) -> None:
    check_loss_chunk(args)
    try:
        resolve_loss_backend(args.loss_backend, device)
    except RuntimeError as exc:
        raise UsageError(f"--loss-backend {args.loss_backend}: {exc}") from exc
