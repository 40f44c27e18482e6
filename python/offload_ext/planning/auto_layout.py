"""Auto layout: how many of each stack's layers a run keeps resident on the GPU, and how many device buffers
the streamed ones get, chosen from the memory plan of the run's batch on this GPU.

A resident layer is stepped on the GPU and never copied: it saves its two copies and its host step every step,
at 8 bytes a parameter in bf16 (weights, gradients, two moments; 16 in "mixed"). A device buffer per streamed
layer lets each layer's new weights go up as soon as its host step ends (eager uploads), at 2 bytes a
parameter. So resident layers come first, as many as the plan fits, then one buffer per streamed layer when
those fit too.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from offload_ext.config import OffloadConfig
from offload_ext.models.stacks import find_layer_stacks
from offload_ext.planning.choices import Settings
from offload_ext.planning.layout import GroupOf
from offload_ext.planning.memory import Machine, evaluate

# The share of the GPU's available memory the chosen layout leaves unplanned, beside the plan's own margin: the
# plan's peaks have come within 1 % of the GPU machine's measured ones (8 B and 14 B shapes; B2 with 3 to 6 resident
# layers under a 24 GB cap), and the allocator's reserve ran up to 5.6 % over its allocations there, against the 5 %
# the margin counts. Each resident layer the headroom gives up is one layer's host step off the critical path of a
# clipped step.
HEADROOM = 0.03
_GB = 1e9


@dataclass(frozen=True)
class LayoutChoice:
    resident_layers: int
    device_layers: int
    reason: str

    @property
    def flags(self) -> str:
        """The offload-train flags that reproduce this layout."""
        return f"--resident-layers {self.resident_layers} --device-layers {self.device_layers}"


def choose_layout(model: nn.Module, settings: Settings, machine: Machine, group_of: GroupOf = lambda p: 0,
                  resident: int | None = None) -> LayoutChoice:
    """The most resident layers whose plan fits the GPU with HEADROOM to spare (or `resident`, when given), then a
    buffer per streamed layer if that fits too; none resident and two buffers where the plan cannot tell (no GPU
    figure, no batch)."""
    if not machine.cuda or machine.gpu_available is None or settings.batch_size is None:
        return LayoutChoice(resident or 0, 2, "no GPU memory figure or batch to plan with: two device buffers"
                            + ("" if resident is not None else ", none resident"))
    budget = int(machine.gpu_available * (1 - HEADROOM))
    shortest = min(len(stack) for _, stack in find_layer_stacks(model))

    def need(resident: int, buffers: int) -> int:
        changed = settings.with_changes(resident_layers=resident, device_layers=buffers)
        return evaluate(model, changed, machine, group_of).gpu.needed

    batch = f"batch {settings.batch_size} x {settings.seq_len}"
    floor = resident or 0
    if need(floor, 2) > budget:
        return LayoutChoice(floor, 2, f"the run needs {need(floor, 2) / _GB:.1f} GB at {batch} with {floor} resident "
                                      f"layers, over {budget / _GB:.1f} GB: two device buffers")
    # need(low) fits; resident layers leave each stack at least one streamed layer
    low, high = (floor, floor + 1) if resident is not None else (0, shortest)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if need(mid, 2) <= budget else (low, mid)
    streamed = shortest - low
    buffers = streamed if streamed > 2 and need(low, streamed) <= budget else 2
    used = need(low, buffers)
    return LayoutChoice(low, buffers, f"the plan at {batch}: {used / _GB:.1f} GB of the {budget / _GB:.1f} GB "
                                      f"it may use ({HEADROOM:.0%} of the GPU's {machine.gpu_available / _GB:.1f} GB "
                                      "available kept free)")


def leaves_layout(config: OffloadConfig) -> bool:
    """Whether `config` leaves the layout to the engine: resident layers and device buffers at the Offloader's
    own values (a config naming others is taken as given)."""
    t, fixed = config.tuning, OffloadConfig().tuning
    return (t.resident_layers, t.device_layers) == (fixed.resident_layers, fixed.device_layers)


def planned_layout(model: nn.Module, settings: Settings, machine: Machine,
                   group_of: GroupOf = lambda p: 0) -> LayoutChoice | None:
    """choose_layout for a run whose config leaves the layout to the engine, on a GPU; None where the config
    names one or there is no GPU to plan for (the simulated device keeps the fixed layout)."""
    if not machine.cuda or not leaves_layout(settings.config):
        return None
    return choose_layout(model, settings, machine, group_of)
