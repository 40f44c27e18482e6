"""MemoryPlan: what a training run under the Offloader needs, as figures and as the text `print(plan)` shows
(host RAM pinned and pageable, GPU memory by phase, the largest batch, and the settings that need less)."""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

from offload_ext.planning.choices import Settings
from offload_ext.planning.gpu import GpuEstimate

_GB = 1e9


@dataclass(frozen=True)
class MemoryPlan:
    """What a training run of a model under the Offloader's settings needs, on this machine (or the one given).

    Host: `host_pinned` and `host_pageable` are the engine's buffers as it reserves them (`host_by_what`
    splits them), `host_available` what the Offloader's check allows them (MemAvailable less an eighth of
    MemTotal), `host_peak_rss` the process's expected peak (the buffers, the interpreter and libraries, the
    CUDA runtime, a checkpoint's copy of the device's parameters and optimizer state, activation_offload's slots:
    `host_activations`, pinned as they are first used; not in the buffers' check). GPU: `gpu_terms` itemises
    `gpu_needed`: `gpu_peak` (what torch.cuda.max_memory_allocated would read; `gpu_phases` has each phase of a step)
    and the margin, against
    `gpu_available`. `largest_batch` is the largest batch at `seq_len` that fits, `largest_seq` the longest
    sequence at batch 1 (None where the device's memory is unknown). `fits` and `reasons` say whether, and
    `options` what needs less, with its figures."""

    model: str
    settings: Settings
    device: str
    host_by_what: dict[tuple[str, bool], int]
    host_available: int | None
    host_process: int
    host_checkpoint: int
    speculating: tuple[int, int] | None
    gpu: GpuEstimate
    gpu_available: int | None
    gpu_total: int | None
    largest_batch: int | None
    largest_seq: int | None
    fits: bool
    reasons: tuple[str, ...]
    options: tuple[str, ...]
    host_activations: int = 0  # activation_offload's host slots: one input per checkpointed layer
    # computes host_per_param, when it is read: six more evaluations of the model, for the printed plan only
    per_param_of: Callable[[], tuple[tuple[str, float, float], ...]] | None = field(default=None, repr=False,
                                                                                   compare=False)

    @functools.cached_property
    def host_per_param(self) -> tuple[tuple[str, float, float], ...]:
        """(precision, without clipping, with clipping): the engine's host buffers per parameter, every unit
        speculating."""
        return self.per_param_of() if self.per_param_of is not None else ()

    @property
    def host_pinned(self) -> int:
        return sum(b for (_, pinned), b in self.host_by_what.items() if pinned)

    @property
    def host_pageable(self) -> int:
        return sum(b for (_, pinned), b in self.host_by_what.items() if not pinned)

    @property
    def host_total(self) -> int:
        return self.host_pinned + self.host_pageable

    @property
    def host_simulated(self) -> int:
        """The simulated device's own peak: host memory too, on top of the engine's buffers."""
        return self.gpu.peak if self.device == "cpu" else 0

    @property
    def host_peak_rss(self) -> int:
        return self.host_total + self.host_process + self.host_checkpoint + self.host_simulated + self.host_activations

    @property
    def gpu_terms(self) -> dict[str, int]:
        """`gpu_needed` term by term: what stays allocated, what the step's fullest phase adds (activations,
        the loss chunk, gradients), and the margin."""
        phase = self.gpu.peak_phase
        rows = [*self.gpu.static, *((f"{phase}: {what}", n) for what, n in self.gpu_phases.get(phase, ()))]
        return {**dict(rows), "margin": self.gpu.margin}

    @property
    def gpu_phases(self) -> dict[str, tuple[tuple[str, int], ...]]:
        return dict(self.gpu.phases)

    @property
    def gpu_peak(self) -> int:
        return self.gpu.peak

    @property
    def gpu_needed(self) -> int:
        return self.gpu.needed

    def refusal(self) -> str:
        """The error a run of this plan stops with: the numbers, and what would need less."""
        options = f" Options: {'; '.join(self.options)}" if self.options else ""
        return (f"offload_ext.plan: {self.model} does not fit {self.device}: {'; '.join(self.reasons)}; nothing was "
                f"allocated.{options}")

    def __str__(self) -> str:
        lines = [self._title(), *self._host_lines(), *self._gpu_lines(), *self._verdict_lines()]
        return "\n".join(line.rstrip() for line in lines)

    def _title(self) -> str:
        s, c = self.settings, self.settings.config
        parts = [self.model, c.precision, f"{c.tuning.backend} backend", self.device,
                 f"batch {s.batch_size} x {s.seq_len}" if s.batch_size and s.seq_len else "no batch given"]
        if c.grad_accum > 1:
            parts.append(f"grad_accum {c.grad_accum}")
        if c.max_grad_norm is not None:
            speculative = "" if c.tuning.speculative_clip else ", not speculative"
            parts.append(f"max_grad_norm {c.max_grad_norm}{speculative}")
        if c.tuning.resident_layers:
            parts.append(f"{c.tuning.resident_layers} resident layers")
        return "memory plan: " + ", ".join(parts)

    def _host_lines(self) -> list[str]:
        lines = [_row("host (GB)", "pinned", "pageable")]
        for (what, pinned), nbytes in sorted(self.host_by_what.items(), key=_host_order):
            lines.append(_row("  " + what, _gb(nbytes) if pinned else "", "" if pinned else _gb(nbytes)))
        lines.append(_row(f"  engine buffers, {_gb(self.host_total)} in all", _gb(self.host_pinned),
                          _gb(self.host_pageable)))
        if self.speculating:
            lines.append(f"  speculative clipping's second buffers for {self.speculating[0]} of "
                         f"{self.speculating[1]} units")
        cuda = " and the CUDA runtime" if self.device.startswith("cuda") else ""
        lines += [_row(f"  process: interpreter, libraries{cuda}", "", _gb(self.host_process)),
                  _row("  checkpoint: the largest device tensor, copied out alone", "", _gb(self.host_checkpoint)),
                  *([_row("  the simulated device's peak (below)", "", _gb(self.host_simulated))]
                    if self.host_simulated else []),
                  *([_row("  activation offload: checkpointed layers' inputs", "", _gb(self.host_activations))]
                    if self.host_activations else []),
                  _row("  expected peak RSS", "", _gb(self.host_peak_rss)),
                  _row("  available to the engine buffers", "", _gb(self.host_available))]
        if self.host_per_param:
            lines.append(_row("  engine buffers per parameter (bytes), by precision", "no clip", "clip"))
            lines += [_row(f"    {precision}", f"{plain:.1f}", f"{clip:.1f}")
                      for precision, plain, clip in self.host_per_param]
        return lines

    def _gpu_lines(self) -> list[str]:
        gpu = self.gpu
        title = "GPU (GB)" if self.device != "cpu" else "simulated device (GB; host memory, not checked)"
        lines = [_row(title, "", "")] + [_row("  " + what, "", _gb(n)) for what, n in gpu.static if n]
        lines.append(_row("  allocated throughout", "", _gb(gpu.static_bytes)))
        shown = gpu.peak_phase
        for what, n in self.gpu_phases.get(shown, ()):
            if n:
                lines.append(_row(f"  + {shown}: {what}", "", _gb(n)))
        lines += [_row(f"  allocated at the peak of: {name}", "", _gb(gpu.static_bytes + gpu.phase_bytes(name)))
                  for name in self.gpu_phases]
        lines.append(_row(f"  peak allocated ({gpu.peak_phase})", "", _gb(gpu.peak)))
        if gpu.cuda:
            lines += [_row("  margin (allocator, kernels outside it)", "", _gb(gpu.margin)),
                      _row("  needed", "", _gb(gpu.needed)),
                      _row("  available" + (f" (of {_gb(self.gpu_total)})" if self.gpu_total else ""), "",
                           _gb(self.gpu_available))]
        return lines

    def _verdict_lines(self) -> list[str]:
        lines = []
        if self.largest_seq is not None:
            at = (f"largest batch at seq_len {self.settings.seq_len}: {self.largest_batch}; "
                  if self.largest_batch is not None else "")
            lines.append(f"{at}longest seq_len at batch 1: {self.largest_seq} (by memory)")
        if self.fits:
            return lines + ["fits"]
        return lines + ["does not fit: " + "; ".join(self.reasons), "options:"] + [f"  {o}" for o in self.options]


_HOST_ORDER = ("params", "params and gradients", "gradient staging", "kept gradients", "moments", "fp32 master",
               "fp32 gradients", "gradient sums", "second buffers")


def _host_order(item: tuple[tuple[str, bool], int]) -> tuple[bool, int]:
    (what, pinned), _ = item
    return not pinned, _HOST_ORDER.index(what) if what in _HOST_ORDER else len(_HOST_ORDER)


def _row(label: str, left: str, right: str) -> str:
    return f"{label:<60}{left:>10}{right:>10}"


def _gb(nbytes: int | None) -> str:
    return "unknown" if nbytes is None else f"{nbytes / _GB:.2f}"
