"""In-backward steps for CPUAdamW(overlap=True): each parameter is stepped on a worker thread the moment
its gradient is final (its post-accumulate-grad hook), while backward goes on producing the others.

The fused kernel releases the GIL and runs on the library's thread pool, so the step of one layer's
parameters overlaps the autograd engine computing the layers below. Under FSDP2 the hook of a sharded
parameter fires once its reduce-scatter has produced the local shard's gradient; with CPUOffloadPolicy
torch (2.14) copies that gradient to the host synchronously when a parameter has such a hook. Releases
that copy it asynchronously hand the hook a gradient still in flight, on the stream that is current when
the hook runs (FSDP2 calls it under its post-reduce stream, after issuing the copy there), so where a host
gradient may come from a GPU (CUDA is in use) the hook records an event on that stream and the job waits
for it: for the copy, not for the backward kernels queued since (as a device-wide synchronize would). That
wait is the worker's, not the launching thread's. A parameter whose hook did not fire this
backward (no gradient, or a backward run under `no_overlap()`) is stepped by `step()` as without overlap.
A worker's failure is re-raised by the next `wait()` (step, zero_grad, state_dict), never dropped.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class InBackwardSteps:
    """The hooks, the worker and what was stepped since the last `step()`."""

    def __init__(self, step_param: Callable[[torch.Tensor], None]) -> None:
        # step_param looks the parameter's group up when it runs: a loaded state dict replaces the groups
        # (a resumed run's steps in backward once ran with the groups of before the load, their lr unscheduled)
        self._step_param = step_param
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="offload-ext-cpu-adamw")
        self._jobs: list[Future] = []
        self._stepped: set[int] = set()    # ids of the parameters stepped in this backward
        self._paused = 0

    def watch(self, p: torch.Tensor) -> None:
        """Step `p` as soon as its gradient is final."""
        p.register_post_accumulate_grad_hook(self._on_grad)

    def _on_grad(self, p: torch.Tensor) -> None:
        if self._paused:
            return
        if id(p) in self._stepped:
            raise RuntimeError("CPUAdamW(overlap=True): a parameter got a second gradient before step() and was "
                               "stepped on the first already; run every backward but a step's last inside "
                               "`with opt.no_overlap():` (or with FSDP2, set_requires_gradient_sync(False))")
        self._stepped.add(id(p))
        self._jobs.append(self._worker.submit(self._job, p, _queued_so_far(p)))

    def _job(self, p: torch.Tensor, landed: torch.cuda.Event | None) -> None:
        if landed is not None:
            landed.synchronize()  # a gradient copied from the device has landed (see the header)
        self._step_param(p)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def wait(self) -> None:
        """Block until every step queued so far is done; re-raise the first failure among them."""
        jobs, self._jobs = self._jobs, []
        errors = [e for e in (job.exception() for job in jobs) if e is not None]
        if errors:
            raise RuntimeError("CPUAdamW(overlap=True): a step in backward failed") from errors[0]

    def take_stepped(self) -> set[int]:
        """Wait, then the ids of the parameters stepped since the last call (forgotten here)."""
        self.wait()
        stepped, self._stepped = self._stepped, set()
        return stepped

    def close(self) -> None:
        self._worker.shutdown(wait=True)


def _queued_so_far(p: torch.Tensor) -> torch.cuda.Event | None:
    """For a host gradient while CUDA is in use: an event after the work queued on the current stream (the one
    a copy of the gradient from the device was issued on); None where nothing can be in flight."""
    if p.grad.device.type != "cpu" or not torch.cuda.is_initialized():
        return None
    event = torch.cuda.Event()
    event.record()
    return event
