"""Testing aids: the public surface tests and benchmarks use to stress an Offloader (slow copies, a slow
or failing host, failing copies) and to look at what it holds, without reaching into its parts.

Each aid acts on the Offloader's backend through the backend interface, so it works the same on both
backends where the backend can do it, and raises NotImplementedError naming the backend where not.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

from offload_ext._ext import native
from offload_ext.engine.backends import LayerBuffers
from offload_ext.engine.offloader import Offloader


def delayed_copies(off: Offloader, max_us: int) -> None:
    """From now on, stall each host<->device copy for a random 0..max_us microseconds first (0: off)."""
    off._backend.set_copy_delay(int(max_us))


def slow_host_steps(off: Offloader, us: int) -> None:
    """From now on, each host step (each slice of one, on the native engine) sleeps `us` first, as a slow
    host would (0: off)."""
    off._backend.set_step_delay(int(us))


def fail_next_host_step(off: Offloader) -> None:
    """The next host step fails as a real kernel failure would ("injected failure")."""
    off._backend.fail_next_step()


def fail_next_copy(off: Offloader) -> None:
    """The next copy to enqueue raises instead ("injected copy failure")."""
    off._backend.fail_next_copy()


def fault_next_copy(off: Offloader) -> None:
    """The next copy faults on its stream as a device error does on a GPU (an illegal address, a device-side
    assert): it never lands, no copy behind it does, and waits raise the fault ("simulated device faulted").
    Simulated device (device="cpu") only."""
    off._backend.fault_next_copy()


@contextlib.contextmanager
def failing_thread_starts(started: int = 1) -> Iterator[None]:
    """Inside the block, every native engine thread pool built fails to start its worker `started` (0-based) as
    under a container's thread limit."""
    native().set_thread_start_failure(int(started))
    try:
        yield
    finally:
        native().set_thread_start_failure(-1)


def pending_units(off: Offloader) -> list[int]:
    """Units (global index, forward order; see Offloader.layout) whose host step is not finished yet."""
    return off._backend.pending_units()


def host_buffers(off: Offloader) -> list[LayerBuffers]:
    """Every unit's host buffers, by unit index. Read them only between steps (after settle())."""
    return list(off._host)


def device_redo_units(off: Offloader) -> frozenset[int]:
    """Units (global index) whose redo, when clipping triggers, runs on the device (offload_ext.engine.device_redo)."""
    return off._backend.device_redo_units


def settle(off: Offloader) -> None:
    """Block until every host step has finished, as state_dict() does before reading the host buffers."""
    off._settle()


def pinned_arena_bounds(off: Offloader) -> tuple[int, int]:
    """Start and end address of the python backend's one pinned allocation."""
    if off.backend_name != "python":
        raise NotImplementedError(f"pinned_arena_bounds: the {off.backend_name} backend has no single arena")
    return off._backend.arena_bounds()
