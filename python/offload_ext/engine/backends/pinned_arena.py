"""The python backend's pinned buffers: views into one host allocation, faulted in by torch's threads and
then page-locked with a single cudaHostRegister. torch's pin_memory would round each layer's buffer up to a
power of two and page-lock it in the driver page by page (2-3 s for B1's 4 GB)."""
from __future__ import annotations

import weakref

import torch

from offload_ext.planning.host_sizes import PYTHON_ALIGN, aligned


class PinnedArena:
    """Views into one host tensor, page-locked as a whole on CUDA (plain memory on the simulated device)."""

    ALIGN = PYTHON_ALIGN

    def __init__(self, numel: int, dtype: torch.dtype, lock: bool) -> None:
        self.tensor = torch.empty(numel + self.ALIGN, dtype=dtype)  # slack to start on a page
        self.tensor.zero_()  # faults the pages in on torch's threads, before the driver locks them
        self._used = (-self.tensor.data_ptr() % 4096) // self.tensor.element_size()
        self._unlock = None
        if lock:
            cudart = torch.cuda.cudart()
            ptr = self.tensor.data_ptr()
            err = cudart.cudaHostRegister(ptr, self.tensor.nbytes, 0)
            if err != cudart.cudaError.success:
                raise RuntimeError(f"Offloader (python backend): cudaHostRegister of {self.tensor.nbytes / 2**30:.2f} "
                                   f"GiB failed: {cudart.cudaGetErrorString(err)}; free host memory or raise the "
                                   "locked-memory limit (ulimit -l)")
            self._unlock = weakref.finalize(self, cudart.cudaHostUnregister, ptr)

    @classmethod
    def footprint(cls, numel: int) -> int:
        return aligned(numel, cls.ALIGN)

    def take(self, numel: int) -> torch.Tensor:
        """The next `numel` elements (the arena is sized in prepare() for every buffer to come)."""
        end = self._used + self.footprint(numel)
        if end > self.tensor.numel():
            raise RuntimeError(f"Offloader (python backend): the pinned arena has no room for {numel} more "
                               "elements; prepare() was told fewer or smaller layers than new_layer() asks for")
        view = self.tensor[self._used:self._used + numel]
        self._used = end
        return view

    def release(self) -> None:
        if self._unlock is not None:
            self._unlock()
