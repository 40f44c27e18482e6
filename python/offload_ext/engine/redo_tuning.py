"""Redo tuning: how many of each stack's top layers redo a clipped step on the device, chosen from the run's own
step times.

When clipping triggers, the device redoes the top layers while the host redoes the ones below, lowest first;
the next forward follows the host up the stack. Too few device layers and the forward chases the host; too
many and the device's copies of their state delay the forward's own weight copies. Where the balance lies
depends on the machine (host step per layer against copy bandwidth) and the precision (8-bit moments copy in
half the bytes), so it is measured: the first redone steps try each candidate count in turn, the time from a
redone step's clipped step to the next step's (the redo, the next forward and backward: all that the redo's
placement moves) is taken for that count, and the count with the least time is kept for the rest of the run.
Every candidate is exact (a device redo is bit for bit the host's), so trying them changes no value.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# Redone steps taken before timing starts: the first ones pay the allocator's growth and kernel warm-up.
WARMUP = 2
# Timed steps per candidate; the least of them is its time (a pause between steps, a checkpoint or a log
# write, only ever adds time).
SAMPLES = 3


@dataclass
class RedoTuning:
    """The candidates, `(layers per stack, units)` in the order they are tried (the first is the planned
    default, used until the measurement decides), and what was measured of them."""

    candidates: Sequence[tuple[int, frozenset[int]]]
    # layers per stack -> seconds of its samples
    times: dict[int, list[float]] = field(default_factory=dict, init=False)
    chosen: int | None = field(default=None, init=False)  # layers per stack, once measured
    _trying: int = field(default=0, init=False)  # index into candidates
    # when the last redone step's clipped step began, timed under _trying
    _pending: float | None = field(default=None, init=False)
    _skipped: int = field(default=0, init=False)  # redone steps of the warm-up so far
    _told: bool = field(default=False, init=False)  # news() has given the choice

    def __post_init__(self) -> None:
        distinct: dict[frozenset[int], int] = {}  # two candidates naming the same units are measured once
        for layers, units in self.candidates:
            distinct.setdefault(units, layers)
        self.candidates = tuple((layers, units) for units, layers in distinct.items())
        if len(self.candidates) < 2:  # nothing to choose between: the one count stands
            self.chosen = self.candidates[0][0] if self.candidates else 0

    @property
    def layers(self) -> int:
        """Layers per stack redone on the device now."""
        return self.chosen if self.chosen is not None else self.candidates[self._trying][0]

    @property
    def units(self) -> frozenset[int]:
        """The units redone on the device now."""
        return dict(self.candidates).get(self.layers, frozenset())

    def observe(self, now: float, redoing: bool) -> None:
        """A clipped step begins at `now` (time.perf_counter()); `redoing`: its speculative steps are redone.
        Closes the interval a redone step before it opened, then (while measuring) opens one for this step."""
        if self.chosen is not None:
            return
        if self._pending is not None:
            self.times.setdefault(self.layers, []).append(now - self._pending)
            self._pending = None
            if len(self.times[self.layers]) == SAMPLES:
                self._next()
        if not redoing or self.chosen is not None:
            return
        if self._skipped < WARMUP:
            self._skipped += 1
            return
        self._pending = now

    def _next(self) -> None:
        self._trying += 1
        if self._trying == len(self.candidates):
            self.chosen = min(self.times, key=lambda k: (min(self.times[k]), k))

    def news(self) -> str | None:
        """summary(), once: the first call after a measured choice gives it, every other call None (as does a
        run that had nothing to measure), so a log says the choice when it is made."""
        if self._told or self.chosen is None:
            return None
        self._told = True
        return self.summary() if self.times else None

    def summary(self) -> str:
        """The choice and its measurements, for a log line ('' before any)."""
        if not self.times:
            return ""
        measured = ", ".join(f"{k}: {min(t):.3f} s" for k, t in self.times.items())
        head = f"{self.chosen} layers a stack" if self.chosen is not None else "measuring"
        return f"{head} (least time from a redone step to the next clipped one, by device-redone layers: {measured})"
