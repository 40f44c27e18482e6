"""Warm a process's GPU libraries on a thread while offload-train builds its model.

A process's first CUDA context, cuBLAS handle and attention kernels cost ~0.6 s when the machine's libraries
are in the page cache and 2.4 s when they are not (benchmarks/bench_cuda_start.py). Building the 8 B
model on the meta device holds the GIL in Python for ~4.5 s, while the warm-up spends its time in the driver
and in torch's kernels with the GIL released: the overlapped probe hid all of it (wall 4.54 s against
5.10 s in turn). What a process loads once does not depend on the shapes, so a typical layer's are used.
"""
from __future__ import annotations

import contextlib
import threading

import torch

_HIDDEN, _HEADS, _HEAD_DIM = 4096, 32, 128
_MAX_TOKENS = 8192  # enough to pick the long-sequence kernels; the memory stays ~0.4 GB


def _warm(device: torch.device, seq_len: int) -> None:
    """A layer's kinds of work, forward and backward, on `device`: matmuls and causal attention in bf16.
    No random draws: the run's generators are left exactly as they were."""
    tokens = max(1, min(seq_len, _MAX_TOKENS))
    kw = {"device": device, "dtype": torch.bfloat16}
    x = torch.full((tokens, _HIDDEN), 0.01, requires_grad=True, **kw)
    w = torch.full((_HIDDEN, _HIDDEN), 0.01, requires_grad=True, **kw)
    q, k, v = ((x @ w).view(1, tokens, _HEADS, _HEAD_DIM).transpose(1, 2) for _ in range(3))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.nn.functional.silu(out).float().sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _failed(device: torch.device, exc: BaseException) -> RuntimeError:
    return RuntimeError(f"offload-train: warming the GPU libraries on {device} failed: {type(exc).__name__}: {exc}")


class GpuWarmup:
    """Runs the warm-up on its own thread from construction; `join()` waits for it, raises its error on the
    caller's thread and gives its memory back to the device before anything measures free memory."""

    def __init__(self, device: torch.device, seq_len: int) -> None:
        self.device = device
        if device.type == "cuda":
            # torch's lazy CUDA initialisation runs the calls queued before it (torch.manual_seed's among them) and
            # marks itself done in two separate moments: one made from another thread between them would be lost.
            # Initialised here, on the caller's thread, before the warm-up starts (0.1-0.25 s).
            try:
                torch.cuda.init()
            except Exception as exc:
                raise _failed(device, exc) from exc
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(seq_len,), name="offload_ext-gpu-warmup", daemon=True)
        self._thread.start()

    def _run(self, seq_len: int) -> None:
        # The current CUDA device is per thread.
        current = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        try:
            with current:
                _warm(self.device, seq_len)
        except BaseException as exc:  # handed to join(): a background thread never swallows an error
            self._error = exc

    def join(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise _failed(self.device, self._error) from self._error
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
