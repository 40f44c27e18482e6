"""The python backend's copies: on CUDA, a torch stream per direction with CUDA events; on the simulated
device, an in-order worker thread per direction, events being futures. Either may stall each copy first
(the testing aid set_copy_delay)."""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class CudaCopies:
    """On CUDA: a torch stream per direction; events are CUDA events."""

    _CYCLES_PER_US = 1000  # torch.cuda._sleep spins for GPU clock cycles: about one per ns

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.h2d = torch.cuda.Stream(device)
        self.d2h = torch.cuda.Stream(device)

    def copy(self, stream: torch.cuda.Stream, dst: torch.Tensor, src: torch.Tensor,
             stall_us: int = 0, after: torch.cuda.Event | None = None) -> torch.cuda.Event:
        if after is not None:
            stream.wait_event(after)
        else:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            if stall_us:
                torch.cuda._sleep(stall_us * self._CYCLES_PER_US)
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def compute_wait(self, event: torch.cuda.Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    @staticmethod
    def host_wait(event: torch.cuda.Event) -> None:
        event.synchronize()


class ThreadCopies:
    """Simulated device: compute is the calling thread; each direction is an in-order worker."""

    def __init__(self) -> None:
        self.h2d = ThreadPoolExecutor(1, thread_name_prefix="offload-h2d")
        self.d2h = ThreadPoolExecutor(1, thread_name_prefix="offload-d2h")

    def copy(self, stream: ThreadPoolExecutor, dst: torch.Tensor, src: torch.Tensor, stall_us: int = 0,
             after: None = None) -> Future:
        if not stall_us:
            return stream.submit(dst.copy_, src)

        def stalled() -> None:
            time.sleep(stall_us / 1e6)
            dst.copy_(src)

        return stream.submit(stalled)

    def compute_wait(self, event: Future) -> None:
        event.result()

    host_wait = compute_wait
