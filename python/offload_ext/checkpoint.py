"""Checkpoint: a Hugging Face safetensors checkpoint read tensor by tensor straight into the buffers
that will hold it (the engine's pinned spans, a device parameter), and written tensor by tensor from
them; fresh weights drawn module by module with the model's own init rule into the same buffers; and a
model built with its parameters on the meta device, so that no second copy of the weights is ever whole
in memory.

The files are read with plain reads, not mapped: a mapped file's touched pages count in the process's
resident memory until it is unmapped, which would add the checkpoint's size to the loading peak.
"""
from __future__ import annotations

import contextlib
import json
import os
import struct
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, Protocol

import numpy as np
import torch
from torch import nn

_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_BOUNCE_BYTES = 64 << 20  # a conversion's staging buffer: the most a read holds besides its destination
_META_LOCK = threading.Lock()  # parameters_on_meta patches nn.Module for the whole process


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
        n = 1
        for d in self.shape:
            n *= d
        return n


def _read_header(path: str) -> dict[str, TensorEntry]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (size,) = struct.unpack("<Q", raw)
        if size > 100 << 20:
            raise ValueError(f"{path}: not a safetensors file (header of {size} bytes)")
        header = json.loads(f.read(size))
    entries = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {meta['dtype']}; expected one of {', '.join(_DTYPES)}")
        begin, end = meta["data_offsets"]
        entries[name] = TensorEntry(path, _DTYPES[meta["dtype"]], tuple(meta["shape"]), 8 + size + begin, end - begin)
    return entries


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


class CheckpointWeights:
    """The values of a model's meta parameters, from a checkpoint: every one is looked up (by any of its
    names, for tied ones) and shape-checked when this is built, before anything is allocated."""

    thread_safe = True  # each read opens the file for itself

    def __init__(self, checkpoint: SafetensorsCheckpoint, model: nn.Module) -> None:
        self.checkpoint = checkpoint
        names: dict[int, list[str]] = defaultdict(list)
        params: dict[int, nn.Parameter] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            names[id(p)].append(name)
            params[id(p)] = p
        self._entries = {pid: checkpoint.entry_for(names[pid], p.shape) for pid, p in params.items() if p.is_meta}

    def fill(self, param: nn.Parameter, dst: torch.Tensor) -> None:
        """Write the parameter's values into a contiguous CPU tensor of its size, in dst's dtype."""
        self.checkpoint.read_into(self._entries[id(param)], dst)

    def materialize(self, param: nn.Parameter, device: torch.device) -> None:
        """Give a meta parameter its values on `device`, in its own dtype."""
        host = torch.empty(param.shape, dtype=param.dtype)
        self.fill(param, host)
        make_real(param, host.to(device))


class WeightSource(Protocol):
    """Values for a model's meta parameters, each given when the buffer that will hold it exists."""

    thread_safe: bool  # fill() may run on several threads at once (for different parameters)

    def fill(self, param: nn.Parameter, dst: torch.Tensor) -> None: ...

    def materialize(self, param: nn.Parameter, device: torch.device) -> None: ...


class InitWeights:
    """Fresh weights by the model's own rule (its `_init_weights`, as transformers applies it to every
    module), drawn module by module on the CPU in the model's dtype: a module's parameters are made
    real, initialised together, and handed out one by one, so at most one module's are held at once."""

    thread_safe = False  # a module is drawn whole, with the process's RNG

    def __init__(self, model: nn.Module, seed: int = 0) -> None:
        if not hasattr(model, "_init_weights"):
            raise ValueError(f"InitWeights: {type(model).__name__} has no _init_weights (a transformers model has)")
        self.model = model
        self.owner: dict[int, tuple[nn.Module, str]] = {}
        for module in model.modules():
            for name, p in module._parameters.items():
                if p is not None and p.is_meta:
                    self.owner.setdefault(id(p), (module, name))
        self._ready: dict[int, torch.Tensor] = {}  # drawn with their module, not handed out yet
        self._gen = torch.Generator().manual_seed(seed)

    def _draw(self, module: nn.Module) -> None:
        metas = {name: p for name, p in module._parameters.items() if p is not None and p.is_meta}
        real = {name: nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
                for name, p in metas.items()}
        module._parameters.update(real)
        state = torch.get_rng_state()
        torch.manual_seed(int(torch.randint(0, 1 << 62, (1,), generator=self._gen)))
        try:
            self.model._init_weights(module)
        finally:
            torch.set_rng_state(state)
            module._parameters.update(metas)  # the meta objects stay the model's until filled
        for name, p in metas.items():
            self._ready[id(p)] = real[name].data

    def fill(self, param: nn.Parameter, dst: torch.Tensor) -> None:
        if id(param) not in self._ready:
            self._draw(self.owner[id(param)][0])
        dst.view(-1).copy_(self._ready.pop(id(param)).reshape(-1))

    def materialize(self, param: nn.Parameter, device: torch.device) -> None:
        host = torch.empty(param.shape, dtype=param.dtype)
        self.fill(param, host)
        make_real(param, host.to(device))


def make_real(param: nn.Parameter, value: torch.Tensor) -> None:
    """Turn a meta parameter into one holding `value`, keeping the Parameter object (which layouts, tied
    modules and optimizers hold): `.data` cannot move a tensor off the meta device, a swap can."""
    torch.utils.swap_tensors(param, nn.Parameter(value, requires_grad=param.requires_grad))


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
        n = torch.tensor([], dtype=self.dtype).element_size()
        for d in self.shape:
            n *= d
        return n


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


def check_materialized(model: nn.Module, weights: WeightSource | None) -> None:
    """Refuse a model with parameters on the meta device unless `weights` hold their values."""
    if weights is not None:
        return
    meta = [name for name, p in model.named_parameters() if p.is_meta]
    if meta:
        raise ValueError(f"Offloader: {len(meta)} parameters are on the meta device (e.g. {meta[0]!r}) and no "
                         "weights= hold their values: build with Offloader.from_pretrained(path), or load the model "
                         "before offloading it")


def from_config_empty(config: Any, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> tuple[nn.Module, InitWeights]:
    """A causal LM of `config` with its parameters on the meta device, and fresh weights for them drawn
    by its own init rule."""
    from transformers import AutoModelForCausalLM

    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model, InitWeights(model, seed)


def from_pretrained_empty(name_or_path: str,
                          dtype: torch.dtype = torch.bfloat16) -> tuple[nn.Module, CheckpointWeights]:
    """A causal LM built from its config with its parameters on the meta device, and the checkpoint's
    weights for them: a local directory, or a hub id (only its config and safetensors are fetched)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = name_or_path
    if not os.path.isdir(path) and not os.path.isfile(path):
        from huggingface_hub import snapshot_download

        path = snapshot_download(name_or_path, allow_patterns=["*.json", "*.safetensors"])
    checkpoint = SafetensorsCheckpoint(path)  # raises first when there are no safetensors
    config = AutoConfig.from_pretrained(path)
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model, CheckpointWeights(checkpoint, model)


def tile_random(flat: torch.Tensor, block: torch.Tensor, gen: torch.Generator) -> None:
    """Fill `flat` with copies of `block` (pre-drawn random values), each starting at a random place in
    it: random-looking weights at memory-copy speed, where drawing every value (normal_) takes tens of
    seconds per billion parameters."""
    done = 0
    while done < flat.numel():
        start = int(torch.randint(0, block.numel(), (1,), generator=gen))
        n = min(block.numel() - start, flat.numel() - done)
        flat[done:done + n].copy_(block[start:start + n])
        done += n


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Inside, modules register their parameters on the meta device (shape, dtype and requires_grad
    kept, no memory); buffers stay real, so values computed at construction (rotary frequencies) hold."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)

    with _META_LOCK:
        nn.Module.register_parameter = register
        try:
            yield
        finally:
            nn.Module.register_parameter = original
