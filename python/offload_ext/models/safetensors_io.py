"""Checkpoint: Hugging Face safetensors files read tensor by tensor straight into the buffers that will
hold the values (the engine's pinned spans, a device parameter), and written tensor by tensor from them,
so that no second copy of the weights is ever whole in memory.

The files are read with plain reads, not mapped: a mapped file's touched pages count in the process's
resident memory until it is unmapped, which would add the checkpoint's size to the loading peak.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
import torch

_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_BOUNCE_BYTES = 64 << 20  # a conversion's staging buffer: the most a read holds besides its destination


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies: file, dtype, shape and the byte range inside the file."""

    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _read_header(path: str) -> dict[str, TensorEntry]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (size,) = struct.unpack("<Q", raw)
        if size > 100 << 20:
            raise ValueError(f"{path}: not a safetensors file (header of {size} bytes)")
        header = json.loads(f.read(size))
        file_bytes = os.fstat(f.fileno()).st_size
    entries = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {meta['dtype']}; expected one of {', '.join(_DTYPES)}")
        entries[name] = _entry(path, name, meta, 8 + size, file_bytes)
    return entries


def _entry(path: str, name: str, meta: dict, data_start: int, file_bytes: int) -> TensorEntry:
    """A header's entry, its byte range checked against its shape and the file: a crafted or damaged header
    must not make a read land outside the tensor it names (or a buffer be sized from a lie)."""
    dtype = _DTYPES[meta["dtype"]]
    shape = meta["shape"]
    offsets = meta["data_offsets"]
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
            and isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise ValueError(f"{path}: tensor {name!r} has a malformed header entry (shape {shape!r}, data_offsets "
                         f"{offsets!r}); the file is damaged: write or download it again")
    begin, end = offsets
    nbytes = math.prod(shape) * dtype.itemsize
    if not 0 <= begin <= end or end - begin != nbytes or data_start + end > file_bytes:
        raise ValueError(f"{path}: tensor {name!r} claims bytes {begin}..{end} of the data ({nbytes} expected for "
                         f"{meta['dtype']} {shape}; the file holds {file_bytes - data_start}); the file is damaged "
                         "or truncated: write or download it again")
    return TensorEntry(path, dtype, tuple(shape), data_start + begin, nbytes)


def checkpoint_files(path: str, stem: str = "model") -> list[str]:
    """The safetensors files of a checkpoint: a file, or a directory with <stem>.safetensors or a sharded
    index (<stem>.safetensors.index.json)."""
    if os.path.isfile(path):
        return [path]
    index = os.path.join(path, f"{stem}.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, s) for s in shards]
    single = os.path.join(path, f"{stem}.safetensors")
    if os.path.isfile(single):
        return [single]
    raise FileNotFoundError(f"{path}: no {stem}.safetensors or {stem}.safetensors.index.json (only safetensors "
                            "checkpoints stream into the Offloader; convert others with save_pretrained(..., "
                            "safe_serialization=True))")


class SafetensorsCheckpoint:
    """The tensors of a safetensors checkpoint by name, each read on demand into a given buffer."""

    def __init__(self, path: str, stem: str = "model") -> None:
        self.path = path
        self.entries: dict[str, TensorEntry] = {}
        for file in checkpoint_files(path, stem):
            self.entries.update(_read_header(file))

    def entry_for(self, names: list[str], shape: torch.Size) -> TensorEntry:
        """The entry of the first of a parameter's names (a tied parameter has several) the checkpoint has;
        raises, naming them, when none is there or its shape differs."""
        for name in names:
            entry = self.entries.get(name)
            if entry is None:
                continue
            if entry.shape != tuple(shape):
                raise ValueError(f"{self.path}: tensor {name!r} has shape {list(entry.shape)}, the model's parameter "
                                 f"{list(shape)}: is the checkpoint for this config?")
            return entry
        raise KeyError(f"{self.path}: no tensor for the model's parameter {' / '.join(names)} (the checkpoint "
                       f"has {len(self.entries)} tensors, e.g. {', '.join(sorted(self.entries)[:3])})")

    def read_into(self, entry: TensorEntry, dst: torch.Tensor) -> None:
        """Fill a contiguous CPU tensor of the entry's size with its values, converted to dst's dtype
        (rounding as torch's .to() does)."""
        if not (dst.is_contiguous() and dst.device.type == "cpu" and dst.numel() == entry.numel):
            raise ValueError(f"read_into: expected a contiguous CPU tensor of {entry.numel} elements, got "
                             f"{dst.numel()} on {dst.device}")
        flat = dst.view(-1)
        with open(entry.path, "rb", buffering=0) as f:
            f.seek(entry.offset)
            if entry.dtype == dst.dtype:
                _read_exactly(f, flat.view(torch.uint8).numpy(), entry)
                return
            per = entry.nbytes // max(entry.numel, 1)
            step = max(1, _BOUNCE_BYTES // per)
            bounce = torch.empty(min(step, entry.numel), dtype=entry.dtype)
            for begin in range(0, entry.numel, step):
                part = bounce[: min(step, entry.numel - begin)]
                _read_exactly(f, part.view(torch.uint8).numpy(), entry)
                flat[begin:begin + part.numel()].copy_(part)


def _read_exactly(f: BinaryIO, view: np.ndarray, entry: TensorEntry) -> None:
    got = 0
    mv = memoryview(view)
    while got < len(mv):
        n = f.readinto(mv[got:])
        if not n:
            raise ValueError(f"{entry.path}: ends inside a tensor (truncated file?)")
        got += n


def _shards(tensors: list[tuple[str, TensorSource]], max_shard_bytes: int) -> list[list[tuple[str, TensorSource]]]:
    shards: list[list[tuple[str, TensorSource]]] = [[]]
    size = 0
    for name, src in tensors:
        if shards[-1] and size + src.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, src))
        size += src.nbytes
    return shards


@dataclass(frozen=True)
class TensorSource:
    """A tensor to write: its dtype and shape, and a function giving its values as a contiguous CPU
    tensor when its turn comes (a view of a host buffer, or one device tensor copied over)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    values: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.shape)


def write_safetensors(path: str, tensors: list[tuple[str, TensorSource]], max_shard_bytes: int = 5 << 30,
                      stem: str = "model") -> list[str]:
    """Write `tensors` as <stem>.safetensors, or as <stem>-0000k-of-0000n.safetensors shards of at most
    max_shard_bytes with a <stem>.safetensors.index.json, one tensor in memory at a time. Each file is
    written under a .partial name and renamed when complete, so a failure leaves no file half-written
    under its real name. Returns the files written."""
    for name, src in tensors:
        if src.dtype not in _NAMES:
            raise ValueError(f"write_safetensors: tensor {name!r} has dtype {src.dtype}; expected one of "
                             f"{', '.join(map(str, _NAMES))}")
    shards = _shards(tensors, max_shard_bytes)
    names = ([f"{stem}.safetensors"] if len(shards) == 1 else
             [f"{stem}-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    os.makedirs(path, exist_ok=True)
    done = []
    try:
        for file, shard in zip(names, shards):
            _write_file(os.path.join(path, file), shard)
            done.append(file)
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(src.nbytes for _, src in tensors)},
                     "weight_map": {name: file for file, shard in zip(names, shards) for name, _ in shard}}
            index_path = os.path.join(path, f"{stem}.safetensors.index.json")
            with open(index_path + ".partial", "w") as f:
                json.dump(index, f, indent=2)
            os.replace(index_path + ".partial", index_path)
    except BaseException:
        for file in names:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(path, file + ".partial"))
        raise
    return [os.path.join(path, f) for f in done]


def _write_file(path: str, shard: list[tuple[str, TensorSource]]) -> None:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, src in shard:
        header[name] = {"dtype": _NAMES[src.dtype], "shape": list(src.shape),
                        "data_offsets": [offset, offset + src.nbytes]}
        offset += src.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # the data starts 8-byte aligned
    with open(path + ".partial", "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, src in shard:
            t = src.values()
            if t.dtype != src.dtype or tuple(t.shape) != src.shape or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"write_safetensors: {name!r} gave {t.dtype} {list(t.shape)} on {t.device}, "
                                 f"expected a contiguous CPU {src.dtype} {list(src.shape)}")
            f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    os.replace(path + ".partial", path)
