"""The tokens a run trains on: the tokenizer (--tokenizer, the model's own, or one trained on the embedded
corpus) and the token stream (the embedded corpus tokenized once, kept in --out and the machine's cache, or a
dataset's documents tokenized as they are read)."""
from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
from collections.abc import Callable
from typing import Any

import numpy as np

from offload_ext.models.durable import atomic_write
from offload_ext.train import chat
from offload_ext.train import data as data_mod
from offload_ext.train.errors import UsageError
from offload_ext.train.model_configs import BUILTIN, TOKENIZER_FILES, has_any, tokenizer_name


def _load_tokenizer(name: str, from_flag: str) -> Any:
    """AutoTokenizer.from_pretrained(name) (a tokenizer.json file through PreTrainedTokenizerFast), with the
    fix named when `name` holds no tokenizer."""
    if os.path.isdir(name) and not has_any(name, TOKENIZER_FILES):
        raise UsageError(f"{from_flag} {name}: the directory has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
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


def _hf_tokenizer(args: argparse.Namespace) -> Any | None:
    """The HF tokenizer the run uses, loaded (None: one trained on the embedded corpus)."""
    name = tokenizer_name(args)
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


def build_tokenizer(args: argparse.Namespace, texts: Callable[[], list[str]] | None
                    ) -> tuple[Callable[[list[str]], list[list[int]]], int, int, Any]:
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


def planned_vocab(args: argparse.Namespace) -> int:
    """The tokenizer's vocabulary size the run will have, without training one (what --dry-run builds the
    model with): the named tokenizer's, or the size the embedded one is trained to."""
    tok = _hf_tokenizer(args)
    if tok is not None:
        return len(tok)
    if args.dataset != data_mod.EMBEDDED:
        raise UsageError(_NEEDS_TOKENIZER)
    return _embedded_vocab(args)


def _machine_cache(args: argparse.Namespace, max_bytes: int, vocab: int) -> Callable[[str, str], None]:
    """The embedded corpus's tokenizer and tokens, copied into a fresh --out from the machine's cache
    (data.cache_dir) when it has them: a new run skips training the tokenizer and tokenizing (2.5 s of the 8 B
    start). Returns what puts the run's two files into the cache afterwards. Only the BPE trained on
    the corpus is the same for every run on this machine: with an HF tokenizer nothing is cached."""
    root = data_mod.cache_dir()
    if root is None or tokenizer_name(args) is not None:
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
    with open(src, "rb") as f:
        atomic_write(dst, functools.partial(shutil.copyfileobj, f))


def _corpus_path(args: argparse.Namespace, vocab: int) -> str:
    return os.path.join(args.out, f"corpus_{vocab}.npy")


def _corpus_tokens(path: str, texts: Callable[[], list[str]], encode_batch: Callable[[list[str]], list[list[int]]],
                   eos: int) -> np.ndarray:
    """The corpus's tokens, each document followed by eos: from `path` when there, else tokenized and saved."""
    if os.path.exists(path):
        return np.load(path)
    tokens = np.concatenate([np.asarray(ids + [eos], dtype=np.int32) for ids in encode_batch(texts())])
    atomic_write(path, functools.partial(np.save, arr=tokens))  # whole: another rank may load it at once
    return tokens


def build_stream(args: argparse.Namespace) -> tuple[data_mod.TokenStream | chat.ChatStream, Any, int]:
    if args.task == "sft":
        return _chat_stream(args)
    if args.dataset == data_mod.EMBEDDED:
        max_bytes, texts = _embedded_corpus(args)
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


def _chat_stream(args: argparse.Namespace) -> tuple[chat.ChatStream, Any, int]:
    """--task sft's packed conversations, encoded by the model's tokenizer (its chat template when it has one) or
    by the embedded corpus's BPE (trained as for --task lm) with the plain template."""
    if args.streaming:
        raise UsageError("--task sft reads its dataset whole (it packs and shuffles the conversations): drop "
                         "--streaming")
    embedded = args.dataset == data_mod.EMBEDDED
    texts = _embedded_corpus(args)[1] if embedded else None
    encode_batch, eos, vocab, tok = build_tokenizer(args, texts)
    template = getattr(tok, "chat_template", None) and (
        lambda messages: tok.apply_chat_template(messages, tokenize=False))
    try:
        chats = chat.embedded_chats() if embedded else chat.chats_from_rows(
            data_mod.load_rows(args.dataset, args.split), args.dataset)
        examples = [chat.encode_chat(m, encode_batch, eos, template) for m in chats]
        pad = tok.pad_token_id if getattr(tok, "pad_token_id", None) is not None else eos
        return chat.ChatStream(args.batch_size, args.seq_len, args.seed, examples, pad), tok, vocab
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


def _embedded_corpus(args: argparse.Namespace) -> tuple[int, Callable[[], list[str]]]:
    """The embedded corpus's size for this model, and its texts, read once and only if asked for."""
    max_bytes = (8 << 20) if args.model != "tiny" else (2 << 20)
    return max_bytes, functools.cache(lambda: data_mod.stdlib_corpus(max_bytes=max_bytes))
