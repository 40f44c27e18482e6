"""The native backend's host memory: the plan it reserves, speculating as high up the stacks as host memory
holds second buffers, and the reservation (page-locked blocks first, then the pageable part checked against
what page-locking left, and faulted in)."""
from __future__ import annotations

import warnings
from typing import Any

from offload_ext.planning import host_sizes
from offload_ext.planning.host_sizes import HostNeed, NativeHostPlan


def fit(planned: NativeHostPlan, available: int | None, pinned: bool = True) -> NativeHostPlan:
    """The plan `available` host memory holds (`pinned`: counting the page-locked blocks, else they are reserved
    already); warns when it speculates on fewer units than `planned`."""
    fitted = planned.fitted(available, pinned)
    kept, asked = len(fitted.speculative_units), len(planned.speculative_units)
    if kept < asked:
        dropped = sorted(planned.speculative_units - fitted.speculative_units)
        # stacklevel: the caller of the Offloader when plan() fits, the Offloader itself when prepare() does
        warnings.warn(f"Offloader: host memory holds second buffers for {kept} of {asked} speculative units; "
                      f"units {dropped[0]}-{dropped[-1]} wait for the norm under clipping", stacklevel=4)
    return fitted


def reserve(engine: Any, plan: NativeHostPlan, before: int | None) -> NativeHostPlan:
    """Page-lock `plan`'s pinned blocks, then check its pageable part against what is left (`before`: the host
    memory available when it was planned) and fault that part in. Returns the plan refitted to what is left.
    Raises MemoryError, the pinned blocks reserved, when the pageable part does not fit."""
    pinned = plan.pinned_blocks()
    engine.reserve_pinned_blocks([b.nbytes for b in pinned])
    # Page-locking may take more of the machine than the bytes locked (a sandbox's own accounting): the
    # pageable part is checked again against what is left, before any of it is allocated. (A unit
    # trimmed here leaves its page-locked second params unused: they are reserved already.)
    after = host_sizes.available_host_bytes()
    if before is not None and after is not None:
        locked = sum(b.nbytes for b in pinned)
        cost = f"page-locking {locked / 1e9:.1f} GB took {(before - after) / 1e9:.1f} GB of available memory"
        plan = fit(plan, after, pinned=False)
        pageable = HostNeed(tuple(plan.pageable_blocks()))
        host_sizes.check_host_memory(pageable, after, pinning=f"{cost}, and the pinned memory is released again")
    # Faulted in now, on the set-up threads: a first write inside a host step costs several times the
    # step (B2 speculative steps whose second buffers were fresh: 150 ms against 30).
    engine.reserve_host_blocks([b.nbytes for b in plan.pageable_blocks()])
    return plan
