"""Configuration: what a user decides (`OffloadConfig`) and the engine's expert switches (`EngineTuning`),
each field with its doc line and its range, validated once when the object is built.

Every field carries its documentation in its metadata: `doc` (one line), `valid` (the range, as the refusal
names it), and either `cli` (the offload-train flag that sets it) or `api_only` (why no flag does). The
Offloader, `plan()`, the trainers and offload-train all take these objects; the Offloader's and plan()'s
keyword arguments are a thin convenience that builds one (`OffloadConfig.from_options`).
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from offload_ext.models.quantized_base import BASE_DTYPES

# "bf16": bf16 params and moments, rounded to nearest; "bf16-sr": the same buffers, params and exp_avg_sq
# rounded stochastically (offload_ext.optim.stochastic_rounding); "mixed": fp32 master and moments, bf16 params
# for the device; "bf16-8bit" ("-sr": the params rounded stochastically): bf16 params, the host's moments in 8
# bits a value (offload_ext.optim.eight_bit's block-wise rule; what stays on the device steps as "bf16").
PRECISIONS = ("bf16", "bf16-sr", "mixed", "bf16-8bit", "bf16-8bit-sr")


def stochastic(precision: str) -> bool:
    """Whether the precision rounds the params stochastically (from sr_seed's streams)."""
    return precision.endswith("-sr")


def eight_bit(precision: str) -> bool:
    """Whether the precision keeps the host's moments in 8 bits."""
    return precision.startswith("bf16-8bit")


def moment_dtype(precision: str) -> torch.dtype:
    """The host's moments' dtype in `precision`: fp32 in "mixed", uint8 codes in the 8-bit ones, else bf16."""
    return torch.float32 if precision == "mixed" else torch.uint8 if eight_bit(precision) else torch.bfloat16


def device_precision(precision: str) -> str:
    """The precision of what steps on the device (its optimizer has no 8-bit moments)."""
    return precision.replace("-8bit", "")
ENGINES = ("native", "python")
CHECKPOINTING = ("all", "none", "auto")

_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b?|b)?\s*", re.IGNORECASE)
_UNITS = {"": 10**9, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_size(text: str) -> int:
    """Bytes of a size written as '125GB', '139GiB', '64 g' or a bare number of GB."""
    match = _SIZE.fullmatch(str(text))
    if not match:
        raise ValueError(f"expected a size such as 125GB, 139GiB or 80 (GB), got {text!r}")
    number, unit = float(match[1]), (match[2] or "").lower()
    base = 1 << 10 * " kmgt".index(unit[0]) if "i" in unit else _UNITS[unit[:1]]
    return int(number * base)


def _is_int(v: Any) -> bool:
    return type(v) is int


def _opt_int(low: int) -> Callable[[Any], bool]:
    return lambda v: v is None or (_is_int(v) and v >= low)


def _int(low: int, high: int | None = None) -> Callable[[Any], bool]:
    return lambda v: _is_int(v) and v >= low and (high is None or v <= high)


def _bool(v: Any) -> bool:
    return type(v) is bool


def _opt_bool(v: Any) -> bool:
    return v is None or type(v) is bool


def _device(v: Any) -> bool:
    if isinstance(v, torch.device):
        return v.type in ("cuda", "cpu")
    return isinstance(v, str) and re.fullmatch(r"cuda(:\d+)?|cpu", v) is not None


def _checkpointing(v: Any) -> bool:
    return v in CHECKPOINTING or (_is_int(v) and v >= 0)


def _max_grad_norm(v: Any) -> bool:
    return v is None or (type(v) in (int, float) and math.isfinite(v) and v > 0)


def _budget(v: Any) -> bool:
    return v is None or (_is_int(v) and v > 0)


def knob(default: Any, doc: str, valid: str, ok: Callable[[Any], bool], *, cli: str | None = None,
         api_only: str | None = None) -> Any:
    """A config field: its default, one-line doc, range (as text and as a check), and how it is reached."""
    assert (cli is None) != (api_only is None), "a field has a CLI flag or a reason to be API-only"
    return field(default=default, metadata=dict(doc=doc, valid=valid, ok=ok, cli=cli, api_only=api_only))


def _validate(obj: Any) -> None:
    """Every field against its range; the first bad one is refused with its name and range."""
    owner = type(obj).__name__
    for f in dataclasses.fields(obj):
        ok = f.metadata.get("ok")
        value = getattr(obj, f.name)
        if ok is not None and not ok(value):
            raise ValueError(f"{owner}.{f.name} must be {f.metadata['valid']}, got {value!r}")


@dataclass(frozen=True)
class EngineTuning:
    """The engine's expert switches. The defaults are the measured best; none is needed to train."""

    backend: str = knob("native", "the engine: the C++/CUDA one, or the pure-Python reference", "'native' or 'python'",
                        lambda v: v in ENGINES, cli="--backend")
    num_threads: int | None = knob(None, "host-step threads (None: the engine's choice for this machine)",
                                   "None or an int >= 1", _opt_int(1), cli="--tuning")
    pin_threads: bool = knob(True, "pin the host-step threads to cores", "True or False", _bool, cli="--tuning")
    host_nice: int = knob(0, "the host-step threads' niceness (0: the process's own priority; above 0 the threads "
                          "that launch GPU work win a contended core at once)", "an int in [0, 19]", _int(0, 19),
                          cli="--tuning")
    grad_slots: int | None = knob(None, "pinned gradient staging slots (None: from the plan)", "None or an int >= 1",
                                  _opt_int(1), cli="--tuning")
    slice_elements: int | None = knob(None, "elements a host step does before the engine chooses its next job "
                                      "(None: whole units)", "None or an int >= 1", _opt_int(1), cli="--tuning")
    async_step: bool | None = knob(None, "host steps run in the background past step() (None: on with 'native')",
                                   "None, True or False", _opt_bool, cli="--tuning")
    speculative_clip: bool = knob(True, "with clipping, step as gradients land and redo exactly if the norm clips "
                                  "(layers mostly trained: not a frozen base's)", "True or False", _bool,
                                  cli="--tuning")
    device_redo_layers: int | None = knob(None, "top layers of each stack whose clipped redo runs on the device "
                                          "(None: measured in the first clipped steps among a third, half, a "
                                          "sixth and none, in 8 bits two thirds too, where it applies)",
                                          "None or an int >= 0 (at most the shortest stack's layers)",
                                          _opt_int(0), cli="--tuning")
    eager_uploads: bool = knob(True, "copy a layer's new weights up as soon as its host step ends, when every layer "
                               "has a device buffer", "True or False", _bool, cli="--tuning")
    params_first: bool = knob(True, "a redo or clipped step writes the params, which the next forward waits for, "
                              "before the moments", "True or False", _bool, cli="--tuning")
    device_layers: int = knob(2, "device buffers per streamed stack (one layer computes while the next is copied)",
                              "an int >= 2", _int(2), cli="--device-layers")
    resident_layers: int = knob(0, "layers of each stack kept on the device, stepped there", "an int >= 0", _int(0),
                                cli="--resident-layers")
    accumulate_on_device: bool | None = knob(None, "where micro-batch gradient sums live (None: the device when it "
                                             "has room)", "None, True or False", _opt_bool, cli="--accumulate-on")

    def __post_init__(self) -> None:
        _validate(self)
        if self.backend == "python" and self.host_nice:
            raise ValueError("EngineTuning.host_nice needs backend='native': the python backend's host steps run "
                             "on the calling thread")
        if self.backend == "python" and (self.async_step or self.slice_elements is not None):
            what = "async_step=True" if self.async_step else "slice_elements"
            raise ValueError(f"EngineTuning.{what.split('=')[0]} needs backend='native' (got {what}): the python "
                             "backend steps every layer inside step(), after backward, by design")


@dataclass(frozen=True)
class OffloadConfig:
    """What a user decides about an offloaded run. `tuning` holds the engine's expert switches."""

    precision: str = knob("bf16", "parameter and optimizer-state precision on the host",
                          "'bf16', 'bf16-sr' (stochastic rounding), 'mixed' (fp32 masters and moments), "
                          "'bf16-8bit' or 'bf16-8bit-sr' (the host's moments in 8 bits)",
                          lambda v: v in PRECISIONS, cli="--precision")
    device: str | torch.device = knob("cuda", "where layers compute ('cpu': the simulated device, for tests)",
                                      "'cuda', 'cuda:N' or 'cpu'", _device, cli="--device")
    grad_accum: int = knob(1, "backward() calls summed per step()", "an int >= 1", _int(1), cli="--grad-accum")
    max_grad_norm: float | None = knob(None, "clip the global gradient norm to this (None: no clipping)",
                                       "None or a finite number > 0", _max_grad_norm, cli="--max-grad-norm")
    activation_checkpointing: str | int = knob("all", "which streamed layers recompute in backward: all, none, "
                                               "'auto' (as many kept as gpu_memory_budget allows) or the N lowest",
                                               "'all', 'none', 'auto' or an int >= 0", _checkpointing,
                                               cli="--activation-checkpointing")
    activation_offload: bool = knob(False, "a checkpointed layer's input waits in pinned host memory until its "
                                    "backward", "True or False", _bool, cli="--activation-offload")
    gpu_memory_budget: int | None = knob(None, "bytes activation_checkpointing='auto' may use (None: what the "
                                         "process may allocate, less a margin)", "None or an int > 0 (bytes)",
                                         _budget, cli="--gpu-memory-budget")
    offload_all: bool = knob(False, "stream the parts outside the layer stacks too (embeddings, head)",
                             "True or False", _bool, cli="--offload-all")
    base_dtype: str | None = knob(None, "hold the streamed layers' frozen linear weights (LoRA's base) in this format "
                                  "on the host and in the copies, dequantized to bf16 on the device before each "
                                  "layer runs (None: bf16)", "None, 'int8', 'fp8' or 'nf4'",
                                  lambda v: v is None or v in BASE_DTYPES, cli="--base-dtype")
    compile_layers: bool = knob(False, "torch.compile each streamed layer", "True or False", _bool, cli="--compile")
    sr_seed: int = knob(0, "the stochastic-rounding stream's seed (precisions ending in '-sr')", "an int >= 0", _int(0),
                        cli="--seed")
    tuning: EngineTuning = knob(EngineTuning(), "the engine's expert switches", "an EngineTuning",
                                lambda v: isinstance(v, EngineTuning), cli="--tuning")

    def __post_init__(self) -> None:
        if isinstance(self.gpu_memory_budget, str):  # "20GB": a size as the CLI takes it
            object.__setattr__(self, "gpu_memory_budget", parse_size(self.gpu_memory_budget))
        _validate(self)
        if self.base_dtype is not None and self.activation_checkpointing != "all":
            # a kept layer's saved weights would be the one dequantized copy the next layer overwrites
            raise ValueError(f"OffloadConfig.base_dtype={self.base_dtype!r} needs activation_checkpointing='all' "
                             f"(got {self.activation_checkpointing!r}): each layer's base is dequantized into one "
                             "buffer per stack as it runs, which a kept layer would need until its backward")

    @classmethod
    def from_options(cls, config: OffloadConfig | None = None, owner: str = "Offloader", **options: Any
                     ) -> OffloadConfig:
        """`config` (or the defaults) with `options` applied, each an OffloadConfig or an EngineTuning field by
        name: the keyword convenience of Offloader(...) and plan(...). An unknown name is refused."""
        base = config if config is not None else cls()
        if not isinstance(base, cls):
            raise TypeError(f"{owner}: config must be an OffloadConfig, got {type(base).__name__}")
        own, tuning = field_names(cls) - {"tuning"}, field_names(EngineTuning)
        unknown = sorted(set(options) - own - tuning)
        if unknown:
            raise TypeError(f"{owner}: unknown option {unknown[0]!r}; options are OffloadConfig's fields "
                            f"({', '.join(sorted(own))}) and EngineTuning's ({', '.join(sorted(tuning))})")
        tuned = {k: v for k, v in options.items() if k in tuning}
        return dataclasses.replace(base, tuning=dataclasses.replace(base.tuning, **tuned),
                                   **{k: v for k, v in options.items() if k in own})

    def replace(self, **options: Any) -> OffloadConfig:
        """This config with `options` changed (OffloadConfig or EngineTuning fields by name)."""
        return OffloadConfig.from_options(self, owner="OffloadConfig.replace", **options)


def field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def check_hyper(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """The optimizer's hyperparameters, refused as torch.optim.AdamW refuses them."""
    if not lr >= 0:
        raise ValueError(f"Offloader: lr must be >= 0, got {lr}")
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise ValueError(f"Offloader: betas must be two numbers in [0, 1), got {betas}")
    if not eps >= 0:
        raise ValueError(f"Offloader: eps must be >= 0, got {eps}")
    if not weight_decay >= 0:
        raise ValueError(f"Offloader: weight_decay must be >= 0, got {weight_decay}")


def resolve_device(device: str | torch.device) -> torch.device:
    """The torch.device the Offloader computes on: 'cuda' becomes the current CUDA device."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"Offloader: device={str(device)!r} but CUDA is not available here "
                               "(torch.cuda.is_available() is False); use device='cpu' for the simulated device")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ValueError(f"Offloader: device must be 'cuda', 'cuda:N' or 'cpu' (simulated), got {device!r}")
    return dev
