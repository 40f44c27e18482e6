"""Host buffer sizes of both backends, from the units' sizes alone (no engine, nothing allocated): what
each backend reserves and what offload_ext.plan reports, by one computation; and the host memory check.

A unit is given as (numel, trainable numel). Each buffer is a HostBlock: what it holds, its bytes as
reserved (the native pools round every block up to a page), and whether it is page-locked.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass

from offload_ext.config import eight_bit, moment_dtype, parse_size

PAGE = 4096
# Room each native block leaves for its start past a page boundary (Engine.next_offset) and the rounding of
# its end to a page.
ALIGN = 2 << 12
_GB = 1e9
# What precision='bf16' (or 'bf16-sr', the same buffers) saves against "mixed", as a refusal names it.
BF16_STATES = "bf16 moments, no fp32 master; 'bf16-sr' too, whose stochastic rounding keeps updates below a bf16 ulp"
EIGHT_BIT_STATES = "moments in 8 bits (block-wise, as bitsandbytes' 8-bit Adam), params rounded stochastically"

Sizes = tuple[tuple[int, int], ...]


def page_round(nbytes: int) -> int:
    """What a native pool takes for a block of `nbytes` (PinnedPool::reserve_blocks)."""
    return aligned(max(nbytes, 1), PAGE)


def available_host_bytes(total: int | None = None) -> int | None:
    """What the host buffers may take: the kernel's MemAvailable less an eighth of MemTotal, None where
    unknown. The headroom is for what the check cannot see: CUDA's and torch's own host memory, and the
    estimate itself (B2 with speculative clipping, 96 GB of buffers planned against 105 GB available on
    the GPU machine, was killed for memory while filling). `total`, or else OFFLOAD_EXT_HOST_MEMORY=SIZE,
    stands in for both fields (a machine of that size with all of it available): a smaller or a larger
    host, planned for or simulated here."""
    given = os.environ.get("OFFLOAD_EXT_HOST_MEMORY")
    if total is None and given:
        total = parse_size(given)
    if total is not None:
        return total - total // 8
    fields = proc_bytes("/proc/meminfo", "MemTotal", "MemAvailable")
    if len(fields) < 2:
        return None
    return max(0, fields["MemAvailable"] - fields["MemTotal"] // 8)


def proc_bytes(path: str, *keys: str) -> dict[str, int]:
    """The fields `keys` of a /proc file of "Key:  N kB" lines (meminfo, self/status), in bytes: those it
    has, none where it cannot be read."""
    fields: dict[str, int] = {}
    try:
        with open(path) as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in keys:
                    fields[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return fields


@dataclass(frozen=True)
class HostBlock:
    what: str     # "params", "gradient staging", "moments", ...: the plan's rows
    nbytes: int   # as the backend reserves it
    pinned: bool  # page-locked (on a CUDA device)


@dataclass(frozen=True)
class HostNeed:
    """A backend's host buffers, block by block."""

    blocks: tuple[HostBlock, ...]

    @property
    def pinned(self) -> int:
        return sum(b.nbytes for b in self.blocks if b.pinned)

    @property
    def pageable(self) -> int:
        return sum(b.nbytes for b in self.blocks if not b.pinned)

    @property
    def total(self) -> int:
        return self.pinned + self.pageable

    def by_what(self) -> dict[tuple[str, bool], int]:
        """Bytes per (what, pinned), in the order the blocks first name them."""
        rows: dict[tuple[str, bool], int] = {}
        for b in self.blocks:
            rows[(b.what, b.pinned)] = rows.get((b.what, b.pinned), 0) + b.nbytes
        return rows


def frozen_units(sizes: Sizes) -> Sizes:
    """The same units with every parameter frozen: what LoRA needs of the base (its adapters not counted)."""
    return tuple((n, 0) for n, _ in sizes)


# Elements that share one fp32 absmax in the 8-bit precisions (offload_ext.optim.eight_bit's rule)
EIGHT_BIT_BLOCK = 256


def moment_bytes(precision: str) -> int:
    """Bytes of each moment's element: fp32 in "mixed", one in the 8-bit precisions, bf16 otherwise."""
    return moment_dtype(precision).itemsize


def absmax_slots(trainable: int) -> int:
    """The absmaxes each 8-bit moment of a unit is given: one a block, counted from the start of each of its
    group ranges; enough for two ranges (the trainable weights and those without weight decay). A unit with more
    takes what it needs, one slot more for each further range: 4 bytes more than planned."""
    return -(-trainable // EIGHT_BIT_BLOCK) + 1


def absmax_bytes(trainable: int) -> int:
    """Bytes of one 8-bit moment's absmaxes."""
    return 4 * absmax_slots(trainable)


_LORA = "the frozen base's bf16 params; adapters not counted"


def default_grad_slots(precision: str, layers: int, accumulate: bool = False, kept_layers: bool = False) -> int:
    # bf16: the host step of a layer is quicker than the GPU's backward of one with its recompute, so a
    # few slots never fill up. mixed, the last micro-batch of an accumulation (its backward on a smaller
    # batch is quicker) and layers kept without recompute: the step is slower than the backward, a backlog
    # builds up, and a full ring would stall backward: one slot per layer (2 more bytes per parameter of
    # pinned memory; pass grad_slots to trade it back when host memory is tight). With kept layers the
    # backlog is what lets the host's work reach into the next forward: the engine steps the lowest layer
    # first, so the top layers wait holding their slots while the layers below cycle (B1 without recompute
    # on 6 slots: the launching thread blocked 67 ms a step on slot reuse).
    return 6 if precision != "mixed" and not accumulate and not kept_layers else layers


@dataclass(frozen=True)
class NativeHostPlan:
    """The native engine's host buffers for these units: the gradient slots, which units get speculative
    clipping's second buffers, and every block in the order prepare() and new_layer() take them."""

    precision: str
    sizes: Sizes              # the stacks' units
    own_grads: Sizes          # units with a gradient buffer of their own (the part outside the stacks)
    accumulate: bool          # units sum gradients in host accumulators
    keep_grads: bool          # each unit's gradient lands in a pinned buffer of its own, kept for a redo
    grad_slots: int           # the shared staging ring (0 with kept gradients)
    speculative_units: frozenset[int]
    asked_slots: int | None = None  # grad_slots as given (None: chosen)
    grad_accum: int = 1             # micro-batches whose gradients reach the host per step
    kept_layers: bool = False       # some layers run without recompute (their backward is quicker)
    # Their clipped redos run on the device (offload_ext.engine.device_redo), which copies their state (moments,
    # mixed's master, and the second buffers) asynchronously: page-locked too. A subset of speculative_units.
    device_redo_units: frozenset[int] = frozenset()

    @classmethod
    def choose(cls, precision: str, sizes: Sizes, own_grads: Sizes = (), *, grad_slots: int | None = None,
               accumulate: bool = False, speculative_units: frozenset[int] = frozenset(),
               grad_accum: int = 1, kept_layers: bool = False,
               device_redo_units: frozenset[int] = frozenset()) -> NativeHostPlan:
        """The plan NativeBackend(precision, grad_slots=, accumulate=, speculative_units=, grad_accum=,
        kept_layers=, device_redo_units=) makes: speculative clipping of single micro-batches keeps each unit's
        gradient (no ring)."""
        keep = bool(speculative_units) and grad_accum == 1
        chosen = default_grad_slots(precision, len(sizes), accumulate, kept_layers)
        slots = 0 if keep else min(len(sizes), grad_slots or chosen)
        spec = frozenset(speculative_units)
        return cls(precision, tuple(sizes), tuple(own_grads), accumulate, keep, slots, spec,
                   grad_slots, grad_accum, kept_layers, frozenset(device_redo_units) & spec)

    def _again(self, **changes: object) -> NativeHostPlan:
        """The plan choose() makes with these of its arguments changed."""
        asked = dict(precision=self.precision, sizes=self.sizes, own_grads=self.own_grads, grad_slots=self.asked_slots,
                     accumulate=self.accumulate, speculative_units=self.speculative_units, grad_accum=self.grad_accum,
                     kept_layers=self.kept_layers, device_redo_units=self.device_redo_units)
        return NativeHostPlan.choose(**(asked | changes))

    def second_buffers(self, index: int, numel: int, trainable: int) -> list[tuple[int, bool]]:
        """(bytes, page-locked) of each second buffer new_layer gives unit `index` for speculative clipping,
        in its order: whole params (page-locked, "bf16": the next forward copies from them once swapped) or
        the fp32 master, then both moments (8-bit: and their absmaxes)."""
        if index not in self.speculative_units:
            return []
        redo = index in self.device_redo_units
        first = (2 * numel, True) if self.precision != "mixed" else (4 * trainable, redo)
        absmax = [(absmax_bytes(trainable), redo)] * 2 if eight_bit(self.precision) else []
        return [first] + [(moment_bytes(self.precision) * trainable, redo)] * 2 + absmax

    def state(self, index: int, trainable: int) -> list[HostBlock]:
        """In new_layer()'s order: both moments (8-bit: then their absmaxes), then ("mixed") the fp32 master;
        page-locked for a unit whose redos run on the device."""
        redo = index in self.device_redo_units
        tag = " (redone on the device)" if redo else ""
        blocks = [self._block("moments" + tag, moment_bytes(self.precision) * trainable, redo)] * 2
        if eight_bit(self.precision):
            blocks += [self._block("moments' absmaxes", absmax_bytes(trainable), redo)] * 2
        return blocks + ([self._block("fp32 master" + tag, 4 * trainable, redo)] if self.precision == "mixed" else [])

    def _block(self, what: str, raw: int, pinned: bool) -> HostBlock:
        return HostBlock(what, page_round(raw + ALIGN), pinned)

    def pinned_blocks(self) -> list[HostBlock]:
        """In prepare()'s and new_layer()'s order: the ring's slots, then per unit its params, (kept) its
        gradient, (device redos) its moments and master, and its page-locked second buffers ("bf16"
        speculation: the params; device redos: all); then the units with gradients of their own."""
        largest = max(t for _, t in self.sizes)
        blocks = [self._block("gradient staging", 2 * largest, True)] * self.grad_slots
        for i, (n, t) in enumerate(self.sizes):
            blocks.append(self._block("params", 2 * n, True))
            if self.keep_grads:
                blocks.append(self._block("kept gradients", 2 * t, True))
            blocks += [b for b in self.state(i, t) if b.pinned]
            blocks += [self._block("second buffers", b, True) for b, pinned in self.second_buffers(i, n, t) if pinned]
        for n, t in self.own_grads:
            blocks += [self._block("params", 2 * n, True), self._block("gradient staging", 2 * t, True)]
        return blocks

    def pageable_blocks(self) -> list[HostBlock]:
        """In new_layer()'s order, per unit: both moments, the fp32 master ("mixed"), the bf16 accumulator
        (accumulation without kept gradients), the pageable second buffers."""
        blocks = []
        for i, (n, t) in enumerate((*self.sizes, *self.own_grads)):
            blocks += [b for b in self.state(i, t) if not b.pinned]
            if self.accumulate and not self.keep_grads:
                blocks.append(self._block("gradient sums", 2 * t, False))
            blocks += [self._block("second buffers", b, False)
                       for b, pinned in self.second_buffers(i, n, t) if not pinned]
        return blocks

    def need(self) -> HostNeed:
        return HostNeed((*self.pinned_blocks(), *self.pageable_blocks()))

    def fitted(self, available: int | None, pinned: bool = True) -> NativeHostPlan:
        """Speculation only as high up the stacks as `available` host memory holds second buffers for
        (`pinned`: counting the page-locked blocks too, else they are reserved already): the lowest units
        go first (they land last, so speculating on them gains least). When none would be left the plan
        stays as it is, for check_host_memory to refuse with its full numbers."""
        spec = sorted(self.speculative_units)
        if available is None or not spec:
            return self
        plan = self
        while spec and self._bytes(plan, pinned) > available:
            spec.pop(0)
            plan = dataclasses.replace(self, speculative_units=frozenset(spec),
                                       device_redo_units=self.device_redo_units & frozenset(spec))
        return plan if spec else self

    @staticmethod
    def _bytes(plan: NativeHostPlan, pinned: bool) -> int:
        need = plan.need()
        return need.total if pinned else need.pageable

    def alternatives(self) -> list[Alternative]:
        """What would need less host memory, each with the bytes it would need (by the same rules)."""
        options = []
        if self.speculative_units:  # clipping without speculation: gradient sums, no kept gradients or second buffers
            plain = self._again(speculative_units=frozenset(), accumulate=True).need().total
            options.append(Alternative("speculative_clip=False", plain, "clipping then waits for backward"))
        if self.precision == "mixed":
            options.append(Alternative("precision='bf16'", self._again(precision="bf16").need().total, BF16_STATES))
        if not eight_bit(self.precision):
            options.append(Alternative("precision='bf16-8bit-sr'", self._again(precision="bf16-8bit-sr").need().total,
                                       EIGHT_BIT_STATES))
        base = self._again(sizes=frozen_units(self.sizes), own_grads=frozen_units(self.own_grads),
                           speculative_units=frozenset())
        options.append(Alternative("LoRA", base.need().total, _LORA))
        return options


@dataclass(frozen=True)
class Alternative:
    """An option that needs less memory, and what it would need."""

    option: str
    nbytes: int
    note: str = ""

    def describe(self, need: int, available: int | None) -> str:
        fits = available is not None and self.nbytes <= available
        note = f"; {self.note}" if self.note else ""
        return (f"{self.option} (saves {(need - self.nbytes) / _GB:.1f} GB: {self.nbytes / _GB:.1f} GB in all"
                f"{', which fits' if fits else ''}{note})")


def aligned(numel: int, align: int) -> int:
    """`numel` rounded up to a multiple of `align`."""
    return -(-numel // align) * align


PYTHON_ALIGN = 2048  # elements of 2 bytes: every view of the python backend's arena starts on a 4 KiB page


def python_arena_elements(sizes: Sizes, own_grads: Sizes) -> int:
    """Elements of the python backend's one pinned arena: every unit's params and grads, each view started
    on a page."""
    return sum(aligned(n, PYTHON_ALIGN) + aligned(t, PYTHON_ALIGN) for n, t in (*sizes, *own_grads))


def python_host_need(precision: str, sizes: Sizes, own_grads: Sizes, accumulate: bool) -> HostNeed:
    """The python backend's host buffers: the pinned arena (bf16, plus one page of slack), then per unit its
    moments, ("mixed") fp32 master and fp32 gradient copy, and (accumulation) its bf16 gradient sum."""
    blocks = [HostBlock("params and gradients", 2 * (python_arena_elements(sizes, own_grads) + PYTHON_ALIGN), True)]
    for _, t in (*sizes, *own_grads):
        blocks += [HostBlock("moments", moment_bytes(precision) * t, False)] * 2
        if eight_bit(precision):
            blocks += [HostBlock("moments' absmaxes", absmax_bytes(t), False)] * 2
        if precision == "mixed":
            blocks += [HostBlock("fp32 master", 4 * t, False), HostBlock("fp32 gradients", 4 * t, False)]
        if accumulate:
            blocks.append(HostBlock("gradient sums", 2 * t, False))
    return HostNeed(tuple(blocks))


def python_alternatives(precision: str, sizes: Sizes, own_grads: Sizes, accumulate: bool) -> list[Alternative]:
    """What would need less host memory with the python backend, by the same rules."""
    options = []
    if precision == "mixed":
        options.append(Alternative("precision='bf16'", python_host_need("bf16", sizes, own_grads, accumulate).total,
                                   BF16_STATES))
    if not eight_bit(precision):
        options.append(Alternative("precision='bf16-8bit-sr'",
                                   python_host_need("bf16-8bit-sr", sizes, own_grads, accumulate).total,
                                   EIGHT_BIT_STATES))
    base = python_host_need(precision, frozen_units(sizes), frozen_units(own_grads), accumulate)
    options.append(Alternative("LoRA", base.total, _LORA))
    return options


def check_host_memory(need: HostNeed, available: int | None, alternatives: Sequence[Alternative] = (),
                      pinning: str = "", who: str = "Offloader") -> None:
    """Refuse, before anything is allocated (or, `pinning` saying so, before the pageable part is), host
    buffers this machine cannot hold (the alternative is the kernel killing the process halfway through),
    naming the numbers and what would need less, with its figure and whether that fits."""
    if available is None or need.total <= available:
        return
    fixes = [a.describe(need.total, available) for a in alternatives] + ["a smaller model"]
    done = pinning or "nothing was allocated"
    raise MemoryError(f"{who}: the host buffers need {need.total / _GB:.1f} GB ({need.pinned / _GB:.1f} GB "
                      f"pinned, {need.pageable / _GB:.1f} GB pageable) but this machine has {available / _GB:.1f} GB "
                      f"available (MemAvailable less an eighth of MemTotal); {done}. Options: {'; '.join(fixes)}")
