"""Backends of the Offloader: the same small interface on torch (python) and on the C++ engine (native)."""
from __future__ import annotations

from typing import Any

import torch

from offload_ext.engine.backends.base import Backend, Hyper, LayerBuffers

# The native engine's keywords, which the python backend has no use for: the Offloader hands both backends one
# set, and the python backend is given it without these.
_NATIVE_ONLY = frozenset({"num_threads", "pin_threads", "slab_bytes", "host_nice", "params_first", "slice_elements",
                          "async_step", "grad_slots", "grad_accum", "speculative_units", "kept_layers",
                          "device_redo_units", "redo_candidates"})


def make_backend(name: str, device: torch.device, precision: str, **options: Any) -> Backend:
    """Backend `name` on `device`. Each backend takes the keywords it uses (an unknown one raises TypeError);
    the python backend is not given the native engine's (_NATIVE_ONLY)."""
    if name == "python":
        from offload_ext.engine.backends.python import PythonBackend

        return PythonBackend(device, precision, **{k: v for k, v in options.items() if k not in _NATIVE_ONLY})
    if name == "native":
        from offload_ext.engine.backends.native import NativeBackend

        return NativeBackend(device, precision, **options)
    raise ValueError(f"Offloader: backend must be 'native' or 'python', got {name!r}")


__all__ = ["Backend", "Hyper", "LayerBuffers", "make_backend"]
