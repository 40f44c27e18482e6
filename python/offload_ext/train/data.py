"""Training data for offload-train: the embedded default (Python's own standard library sources and a
BPE tokenizer trained on them in seconds) and real data through `datasets`, as one resumable token stream.
"""
from __future__ import annotations

import glob
import hashlib
import os
import sys
import sysconfig
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from offload_ext.models.durable import atomic_write

EMBEDDED = "stdlib"


def stdlib_corpus(max_bytes: int) -> list[str]:
    """Source files of the running Python's standard library (no third-party packages), sorted, capped."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(f for f in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
                   if "site-packages" not in f and "dist-packages" not in f)
    texts, total = [], 0
    for path in files:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError):
            continue
        texts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return texts


def cache_dir() -> str | None:
    """Where the embedded corpus's tokenizer and tokens are kept between runs: OFFLOAD_EXT_CACHE, else
    $XDG_CACHE_HOME/offload_ext, else ~/.cache/offload_ext; None when OFFLOAD_EXT_CACHE is empty or 0."""
    value = os.environ.get("OFFLOAD_EXT_CACHE")
    if value is not None:
        return None if value in ("", "0") else value
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "offload_ext")


def embedded_entry(max_bytes: int, vocab_size: int) -> str:
    """The cache entry's name for the embedded corpus: this Python's standard library, the byte cap, the
    vocabulary and the tokenizers version decide what training and tokenizing give."""
    import tokenizers

    what = "|".join((sysconfig.get_paths()["stdlib"], sys.version, str(max_bytes), str(vocab_size),
                     tokenizers.__version__))
    return "stdlib-" + hashlib.sha256(what.encode()).hexdigest()[:16]


END_OF_TEXT = "<|endoftext|>"  # the embedded tokenizer's one special token, id 0: its bos, eos, unk and pad


def hf_tokenizer(tok: Any) -> Any:
    """The embedded corpus's BPE as transformers' tokenizer, with its special tokens named as GPT-2's are
    (bos = eos = unk = <|endoftext|>) and pad set to it too, so that padding works as an HF user expects:
    save_pretrained writes them into tokenizer_config.json, and AutoTokenizer gives them back."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=END_OF_TEXT, eos_token=END_OF_TEXT,
                                   unk_token=END_OF_TEXT, pad_token=END_OF_TEXT)


def special_tokens_of(tokenizer_file: str) -> dict[str, str]:
    """The special-token arguments for a bare tokenizer.json (it names its special tokens but not their
    roles): <|endoftext|> in every role when the file has it (the embedded tokenizer's and GPT-2's
    convention), none otherwise."""
    import json

    with open(tokenizer_file, encoding="utf-8") as f:
        added = json.load(f).get("added_tokens") or []
    if any(t.get("content") == END_OF_TEXT and t.get("special") for t in added):
        return {"bos_token": END_OF_TEXT, "eos_token": END_OF_TEXT, "unk_token": END_OF_TEXT, "pad_token": END_OF_TEXT}
    return {}


def train_tokenizer(texts: list[str] | None, vocab_size: int, path: str):
    """A byte-level BPE trained on `texts`, saved to `path` (and reused from there when present: `texts` may
    be None then)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if os.path.exists(path):
        return Tokenizer.from_file(path)
    if texts is None:
        raise ValueError(f"train_tokenizer: no tokenizer at {path} and no texts to train one on")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    # whole or not there: the ranks of one run train and save it at once, and one may read it as another saves
    atomic_write(path, lambda f: f.write(tok.to_str(pretty=True).encode()))
    return tok


class TokenStream:
    """Fixed-size batches cut from a token sequence; its position is state that a checkpoint keeps.

    In-memory mode: the whole corpus is tokenized once; each epoch visits the windows in a seeded random
    order. Streaming mode (datasets, streaming=True): documents are tokenized as they come and packed.
    """

    def __init__(self, batch_size: int, seq_len: int, seed: int, tokens: np.ndarray | None = None,
                 documents: Any = None, encode: Any = None, eos_id: int = 0) -> None:
        """`tokens`: a whole tokenized corpus; or `documents`: a callable giving a fresh iterator of texts."""
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.tokens, self.documents, self.encode, self.eos_id = tokens, documents, encode, eos_id
        self.batches_done = 0
        if tokens is not None:
            self.windows = (len(tokens) - 1) // seq_len
            if self.windows < batch_size:
                raise ValueError(f"the corpus has {len(tokens)} tokens: too few for one batch of {batch_size} x "
                                 f"{seq_len}; lower --batch-size or --seq-len")

    def state(self) -> dict[str, int]:
        return {"batches_done": self.batches_done}

    def restore(self, state: dict[str, int]) -> None:
        self.batches_done = int(state["batches_done"])

    def _window_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng(self.seed + epoch).permutation(self.windows)

    def next_batch(self) -> torch.Tensor:
        k = self.batches_done
        self.batches_done += 1
        if self.tokens is not None:
            per_epoch = self.windows // self.batch_size
            order = self._window_order(k // per_epoch)
            picks = order[(k % per_epoch) * self.batch_size:][: self.batch_size]
            rows = [self.tokens[w * self.seq_len: w * self.seq_len + self.seq_len] for w in picks]
            return torch.from_numpy(np.stack(rows).astype(np.int64))
        return self._stream_batch(k)

    def _stream_batch(self, k: int) -> torch.Tensor:
        # Documents are packed in order; on resume the stream is replayed up to the saved position.
        if not hasattr(self, "_docs"):
            self._docs: Iterator[str] = self.documents()
            self._buffer: list[int] = []
            self._base = 0  # stream index of _buffer[0]
        per_batch = self.batch_size * self.seq_len
        start, end = k * per_batch, (k + 1) * per_batch
        while self._base + len(self._buffer) < end:
            try:
                doc = next(self._docs)
            except StopIteration:
                if self._base + len(self._buffer) == 0:
                    raise ValueError("the dataset yielded no text") from None
                self._docs = self.documents()  # next epoch
                continue
            self._buffer.extend(self.encode(doc) + [self.eos_id])
        flat = self._buffer[start - self._base: end - self._base]
        del self._buffer[: end - self._base]
        self._base = end
        return torch.tensor(flat, dtype=torch.int64).view(self.batch_size, self.seq_len)


def load_texts(dataset: str, split: str, text_field: str, streaming: bool) -> Any:
    """Texts of a `datasets` dataset (hub id, local directory, or data files by extension)."""
    try:
        import datasets
    except ImportError as exc:
        raise RuntimeError("--dataset needs the `datasets` package: pip install datasets") from exc
    try:
        ds, columns = _open_dataset(datasets, dataset, split, streaming)
    except (ConnectionError, FileNotFoundError, datasets.exceptions.DatasetGenerationError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"--dataset {dataset}: could not be read ({first}); pass a local data file or directory, "
                         "or a dataset id the hub (or its cache, with HF_HUB_OFFLINE=1) has") from exc
    if columns is None:
        raise ValueError(f"--dataset {dataset}: split {split!r} has no rows; pass a dataset with text in it")
    if text_field not in columns:
        raise ValueError(f"--text-field {text_field!r} is not a column of {dataset}; its columns are {columns}")
    return (row[text_field] for row in ds)


def load_rows(dataset: str, split: str) -> Any:
    """A `datasets` dataset's rows (hub id, local directory, or data files by extension), read whole."""
    try:
        import datasets
    except ImportError as exc:
        raise RuntimeError("--dataset needs the `datasets` package: pip install datasets") from exc
    ds, columns = _open_dataset(datasets, dataset, split, streaming=False)
    if columns is None:
        raise ValueError(f"--dataset {dataset}: split {split!r} has no rows")
    return ds


def _open_dataset(datasets: Any, dataset: str, split: str, streaming: bool) -> tuple[Any, list[str] | None]:
    """The dataset and its columns (None: it has no rows)."""
    if os.path.isfile(dataset):
        ext = os.path.splitext(dataset)[1].lstrip(".")
        kind = {"txt": "text", "jsonl": "json", "json": "json", "csv": "csv", "parquet": "parquet"}.get(ext)
        if kind is None:
            raise ValueError(f"--dataset {dataset}: unknown file type .{ext} (use .txt, .jsonl, .csv or .parquet)")
        ds = datasets.load_dataset(kind, data_files=dataset, split=split, streaming=streaming)
    else:
        ds = datasets.load_dataset(dataset, split=split, streaming=streaming)
    if not streaming:
        return ds, (ds.column_names if len(ds) else None)
    first = next(iter(ds), None)  # a stream says its columns only with its first row
    return ds, (list(first) if first is not None else None)
