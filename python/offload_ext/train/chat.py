"""Chat fine-tuning data for offload-train --task sft: conversations rendered with the tokenizer's chat template
(or a plain "User: / Assistant:" one), the loss on the assistant turns only, and short examples packed into rows
whose position ids restart per example and whose attention stays within each example.

The embedded default needs no download: questions about the Python standard library's functions and classes,
answered by the first paragraph of their own docstrings.
"""
from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

IGNORE_INDEX = -100
Message = dict[str, str]
Example = tuple[np.ndarray, np.ndarray]  # token ids, and which of them carry loss (the assistant's)

_EMBEDDED_MODULES = ("builtins", "os", "os.path", "json", "re", "math", "itertools", "functools", "collections",
                     "pathlib", "string", "textwrap", "random", "statistics", "shutil", "heapq", "bisect", "difflib")


def embedded_chats() -> list[list[Message]]:
    """Two-turn conversations about the standard library, from its own docstrings, in a fixed order."""
    chats = []
    for module_name in _EMBEDDED_MODULES:
        module = importlib.import_module(module_name)
        for name in sorted(n for n in dir(module) if not n.startswith("_")):
            doc = inspect.getdoc(getattr(module, name, None))
            answer = doc.split("\n\n")[0].strip() if doc else ""
            if 20 <= len(answer) <= 600:
                chats.append([{"role": "user", "content": f"What does {module_name}.{name} do?"},
                              {"role": "assistant", "content": answer}])
    return chats


def chats_from_rows(rows: Sequence[dict[str, Any]], dataset: str) -> list[list[Message]]:
    """Conversations of a dataset with a `messages` column (role/content dicts) or `prompt` and `completion`."""
    first = rows[0] if len(rows) else {}
    if "messages" in first:
        return [list(r["messages"]) for r in rows]
    if "prompt" in first and "completion" in first:
        return [[{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["completion"]}]
                for r in rows]
    raise ValueError(f"--task sft --dataset {dataset}: expected a 'messages' column (a list of role/content "
                     f"turns) or 'prompt' and 'completion' columns; its columns are {sorted(first)}")


def encode_chat(messages: Sequence[Message], encode: Callable[[list[str]], list[list[int]]], eos: int,
                template: Callable[[Sequence[Message]], str] | None) -> Example:
    """The conversation's ids and loss mask. With a chat template, each turn is the text the template adds for
    it (rendering the turns so far, then one more); without, "Role: content" lines, an assistant turn closed by
    the end-of-text token. A turn's tokens carry loss when the turn is the assistant's."""
    pieces: list[tuple[str, bool]] = []
    if template is not None:
        done = ""
        for k in range(len(messages)):
            text = template(messages[: k + 1])
            if not text.startswith(done):
                raise ValueError("--task sft: the tokenizer's chat template renders earlier turns differently once "
                                 "a turn follows them; pass a --tokenizer whose template extends a conversation")
            pieces.append((text[len(done):], messages[k]["role"] == "assistant"))
            done = text
    else:
        for m in messages:
            if m["role"] == "assistant":
                pieces += [("Assistant: ", False), (m["content"], True)]
            else:
                pieces.append((f"{m['role'].capitalize()}: {m['content']}\n", False))
    encoded = encode([p for p, _ in pieces])
    ids = [i for piece in encoded for i in piece]
    mask = [trained for piece, (_, trained) in zip(encoded, pieces) for _ in piece]
    if template is None:
        ids.append(eos)
        mask.append(messages[-1]["role"] == "assistant")  # the turn ends: the model learns to stop
    return np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool)


@dataclass
class ChatBatch:
    """A batch of packed rows: what the model and the loss take."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor  # [batch, 1, seq, seq], True where a token may attend: its own example only

    def to(self, device: torch.device) -> ChatBatch:
        return ChatBatch(*(t.to(device) for t in (self.input_ids, self.labels, self.position_ids,
                                                  self.attention_mask)))


def pack(examples: Sequence[Example], order: Sequence[int], seq_len: int, pad: int) -> list[np.ndarray]:
    """Rows of [ids, labels, position ids, segment ids] (each seq_len long): the examples in `order`, each cut to
    seq_len, placed whole into the current row while they fit. A row's first token of an example carries no loss
    (the token before it is another example's), nor does padding (segment -1)."""
    rows, row = [], []
    for index in order:
        ids, mask = examples[index]
        ids, mask = ids[:seq_len], mask[:seq_len]
        if sum(len(i) for i, _ in row) + len(ids) > seq_len:
            rows.append(_row(row, seq_len, pad))
            row = []
        row.append((ids, mask))
    if row:
        rows.append(_row(row, seq_len, pad))
    return rows


def _row(parts: list[Example], seq_len: int, pad: int) -> np.ndarray:
    out = np.zeros((4, seq_len), dtype=np.int64)
    out[0], out[1], out[3] = pad, IGNORE_INDEX, -1
    at = 0
    for segment, (ids, mask) in enumerate(parts):
        n = len(ids)
        labels = np.where(mask, ids, IGNORE_INDEX)
        labels[0] = IGNORE_INDEX
        out[0, at:at + n], out[1, at:at + n], out[2, at:at + n], out[3, at:at + n] = ids, labels, np.arange(n), segment
        at += n
    return out


class ChatStream:
    """Batches of packed rows; each epoch packs the examples in a seeded random order. Its position is the
    batches done, which a checkpoint keeps (the packing of an epoch depends on the seed and the epoch alone)."""

    def __init__(self, batch_size: int, seq_len: int, seed: int, examples: Sequence[Example], pad: int) -> None:
        if not any(mask.any() for _, mask in examples):
            raise ValueError("--task sft: no assistant turn to train on in the dataset")
        self.batch_size, self.seq_len, self.seed, self.examples, self.pad = batch_size, seq_len, seed, examples, pad
        self.batches_done = 0
        self._epoch = (-1, 0, [])  # the epoch packed, the index of its first batch, its rows

    def state(self) -> dict[str, int]:
        return {"batches_done": self.batches_done}

    def restore(self, state: dict[str, int]) -> None:
        self.batches_done = int(state["batches_done"])
        self._epoch = (-1, 0, [])

    def _pack_epoch(self, epoch: int) -> list[np.ndarray]:
        order = np.random.default_rng(self.seed + epoch).permutation(len(self.examples))
        rows = pack(self.examples, order, self.seq_len, self.pad)
        if len(rows) < self.batch_size:
            raise ValueError(f"--task sft: the dataset packs into {len(rows)} rows of {self.seq_len} tokens, "
                             f"fewer than one batch of {self.batch_size}; lower --batch-size or --seq-len")
        return rows

    def _rows_for(self, k: int) -> tuple[list[np.ndarray], int]:
        """The rows of the epoch that batch k falls in (epochs pack differently: their batch counts differ), and
        k's index within it."""
        epoch, first, rows = self._epoch
        while epoch < 0 or k >= first + len(rows) // self.batch_size:
            first = first + len(rows) // self.batch_size if epoch >= 0 else 0
            epoch += 1
            rows = self._pack_epoch(epoch)
            self._epoch = (epoch, first, rows)
        return rows, k - first

    def next_batch(self) -> ChatBatch:
        rows, i = self._rows_for(self.batches_done)
        self.batches_done += 1
        block = np.stack(rows[i * self.batch_size:(i + 1) * self.batch_size])
        ids, labels, positions, segments = (torch.from_numpy(block[:, i]) for i in range(4))
        causal = torch.ones(self.seq_len, self.seq_len, dtype=torch.bool).tril()
        same = segments[:, :, None] == segments[:, None, :]
        return ChatBatch(ids, labels, positions, (same & causal)[:, None])
