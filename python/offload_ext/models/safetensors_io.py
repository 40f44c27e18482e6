"""Checkpoint: Hugging Face safetensors files read tensor by tensor straight into the buffers that will
hold the values (the engine's pinned spans, a device parameter), and written tensor by tensor from them,
so that no second copy of the weights is ever whole in memory.

The files are read with plain reads, not mapped: a mapped file's touched pages count in the process's
resident memory until it is unmapped, which would add the checkpoint's size to the loading peak.
"""
from __future__ import annotations

import functools
import json
import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
import torch

from offload_ext.models.durable import atomic_write

_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
           "U8": torch.uint8}  # U8: the 8-bit precisions' moments (engine_state.safetensors)
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_BOUNCE_BYTES = 64 << 20  # a conversion's staging buffer: the most a read holds besides its destination
_FIX = "copy or download the checkpoint again"  # what a damaged or truncated file's error ends with


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


def checkpoint_entries(path: str, stem: str = "model") -> dict[str, TensorEntry]:
    """Every tensor of checkpoint `path` (see checkpoint_files) by name, each file's header checked before
    anything is read from it: whole, every entry's byte range that of its shape, and the file as long as its
    header says, so that a copy cut short is refused here, not halfway through filling a buffer. Errors name
    the file as it lies under `path` and the fix: FileNotFoundError when the checkpoint has no safetensors
    files, ValueError when one is missing, damaged or truncated."""
    entries = {}
    for file in checkpoint_files(path, stem):
        shown = os.path.relpath(file, path) if os.path.isdir(path) else os.path.basename(file)
        entries.update(_read_header(file, shown))
    return entries


def checkpoint_files(path: str, stem: str = "model") -> list[str]:
    """The safetensors files of a checkpoint: a file, or a directory with <stem>.safetensors or a sharded
    index (<stem>.safetensors.index.json) whose shards are all there."""
    if os.path.isfile(path):
        return [path]
    index = f"{stem}.safetensors.index.json"
    if os.path.isfile(os.path.join(path, index)):
        shards = _index_shards(os.path.join(path, index))
        missing = [s for s in shards if not os.path.isfile(os.path.join(path, s))]
        if missing:
            raise ValueError(f"{missing[0]}, named in {index}, is missing ({len(missing)} of {len(shards)} shards); "
                             "copy the whole checkpoint")
        return [os.path.join(path, s) for s in shards]
    single = os.path.join(path, f"{stem}.safetensors")
    if os.path.isfile(single):
        return [single]
    raise FileNotFoundError(f"{path}: no {stem}.safetensors or {index} (only safetensors checkpoints stream into "
                            "the Offloader; convert others with save_pretrained(..., safe_serialization=True))")


def _index_shards(index: str) -> list[str]:
    """The shard files a sharded checkpoint's index names, each once, sorted."""
    try:
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        if not all(isinstance(s, str) for s in shards):
            raise TypeError("a shard name is not a string")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{os.path.basename(index)} is not a safetensors index ({exc}); save the model again with "
                         "save_pretrained") from exc
    return shards


def _read_header(path: str, shown: str) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file, its header checked (see checkpoint_entries); `shown` names it."""
    file_bytes = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{shown} is not a safetensors file (shorter than its 8-byte header length); {_FIX}")
        (size,) = struct.unpack("<Q", raw)
        if size > 100 << 20:
            raise ValueError(f"{shown} is not a safetensors file (a header of {size} bytes); {_FIX}")
        if 8 + size > file_bytes:
            raise ValueError(f"{shown} is truncated ({file_bytes} bytes, shorter than its header of {8 + size}); "
                             f"{_FIX}")
        try:
            header = json.loads(f.read(size))
        except ValueError as exc:
            raise ValueError(f"{shown} is not a whole safetensors file (its header is not JSON: {exc}); "
                             f"{_FIX}") from exc
    if not isinstance(header, dict):
        raise ValueError(f"{shown} is not a whole safetensors file (its header is not a JSON object); {_FIX}")
    entries = {name: _entry(path, shown, name, meta, 8 + size) for name, meta in header.items()
               if name != "__metadata__"}
    claimed = max((e.offset + e.nbytes for e in entries.values()), default=8 + size)
    if claimed > file_bytes:
        raise ValueError(f"{shown} is truncated ({file_bytes} bytes, its header says {claimed}); {_FIX}")
    return entries


def _entry(path: str, shown: str, name: str, meta: object, data_start: int) -> TensorEntry:
    """A header's entry, its byte range checked against its shape: a crafted or damaged header must not make a
    read land outside the tensor it names (or a buffer be sized from a lie)."""
    if not isinstance(meta, dict):
        raise ValueError(f"{shown}: tensor {name!r} has a malformed header entry ({meta!r}); the file is damaged: "
                         f"{_FIX}")
    dtype_name = meta.get("dtype")
    if not isinstance(dtype_name, str) or dtype_name not in _DTYPES:
        raise ValueError(f"{shown}: tensor {name!r} has dtype {dtype_name}; expected one of {', '.join(_DTYPES)}")
    dtype = _DTYPES[dtype_name]
    shape = meta.get("shape")
    offsets = meta.get("data_offsets")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
            and isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        raise ValueError(f"{shown}: tensor {name!r} has a malformed header entry (shape {shape!r}, data_offsets "
                         f"{offsets!r}); the file is damaged: {_FIX}")
    begin, end = offsets
    nbytes = math.prod(shape) * dtype.itemsize
    if not 0 <= begin <= end or end - begin != nbytes:
        raise ValueError(f"{shown}: tensor {name!r} claims bytes {begin}..{end} of the data ({nbytes} expected for "
                         f"{dtype_name} {shape}); the file is damaged: {_FIX}")
    return TensorEntry(path, dtype, tuple(shape), data_start + begin, nbytes)


class SafetensorsCheckpoint:
    """The tensors of a safetensors checkpoint by name, each read on demand into a given buffer."""

    def __init__(self, path: str, stem: str = "model") -> None:
        self.path = path
        self.entries = checkpoint_entries(path, stem)

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

    def read(self, entry: TensorEntry, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The entry's values as a new CPU tensor of its shape, in `dtype` (default: the file's)."""
        out = torch.empty(entry.shape, dtype=dtype or entry.dtype)
        self.read_into(entry, out)
        return out

    def copy_into(self, entry: TensorEntry, dst: torch.Tensor) -> None:
        """Fill dst, on any device, with the entry's values: read straight in where dst is a contiguous CPU tensor,
        else through a CPU copy of this one tensor."""
        if dst.device.type == "cpu" and dst.is_contiguous():
            self.read_into(entry, dst)
        else:
            dst.copy_(self.read(entry, dst.dtype))

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
            if not entry.dtype.is_floating_point:  # codes (a quantized checkpoint's): their values are no weights
                raise ValueError(f"{entry.path}: a tensor holds {_NAMES[entry.dtype]} codes, not {dst.dtype} "
                                 "values: is it a quantized checkpoint? load one in bf16, fp16 or fp32")
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
    written whole or not at all (atomic_write), so a failure leaves no file half-written under its real
    name. Returns the files written."""
    for name, src in tensors:
        if src.dtype not in _NAMES:
            raise ValueError(f"write_safetensors: tensor {name!r} has dtype {src.dtype}; expected one of "
                             f"{', '.join(map(str, _NAMES))}")
    shards = _shards(tensors, max_shard_bytes)
    names = ([f"{stem}.safetensors"] if len(shards) == 1 else
             [f"{stem}-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    os.makedirs(path, exist_ok=True)
    for file, shard in zip(names, shards):
        atomic_write(os.path.join(path, file), functools.partial(_write_shard, shard))
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(src.nbytes for _, src in tensors)},
                 "weight_map": {name: file for file, shard in zip(names, shards) for name, _ in shard}}
        atomic_write(os.path.join(path, f"{stem}.safetensors.index.json"),
                     lambda f: f.write(json.dumps(index, indent=2).encode()))
    return [os.path.join(path, f) for f in names]


def _write_shard(shard: list[tuple[str, TensorSource]], f: BinaryIO) -> None:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, src in shard:
        header[name] = {"dtype": _NAMES[src.dtype], "shape": list(src.shape),
                        "data_offsets": [offset, offset + src.nbytes]}
        offset += src.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # the data starts 8-byte aligned
    f.write(struct.pack("<Q", len(raw)))
    f.write(raw)
    for name, src in shard:
        t = src.values()
        if t.dtype != src.dtype or tuple(t.shape) != src.shape or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"write_safetensors: {name!r} gave {t.dtype} {list(t.shape)} on {t.device}, "
                             f"expected a contiguous CPU {src.dtype} {list(src.shape)}")
        f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
