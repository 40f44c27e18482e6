"""Backends of the Offloader: the same small interface on torch (python) and on the C++ engine (native)."""
from __future__ import annotations

from offload_ext.engine.backends.base import Backend, Hyper, LayerBuffers


def make_backend(name: str, device: "torch.device", precision: str, **options) -> Backend:  # noqa: F821
    if name == "python":
        from offload_ext.engine.backends.python import PythonBackend

        return PythonBackend(device, precision, **options)
    if name == "native":
        from offload_ext.engine.backends.native import NativeBackend

        return NativeBackend(device, precision, **options)
    raise ValueError(f"Offloader: backend must be 'native' or 'python', got {name!r}")


__all__ = ["Backend", "Hyper", "LayerBuffers", "make_backend"]
