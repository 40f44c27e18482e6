"""build_info(): what was built, against what, and what runs."""
from __future__ import annotations

from typing import Any

import torch

from offload_ext import _ext
from offload_ext._version import __version__


def build_info() -> dict[str, Any]:
    """Version, torch built against and running, CUDA compiled in or not, SIMD level, thread count."""
    info: dict[str, Any] = {
        "version": __version__,
        "torch_running": torch.__version__,
        "native": _ext.available(),
        "native_origin": _ext.origin(),
    }
    if _ext.available():
        info.update(_ext.native().native_info())
    else:
        info["native_error"] = _ext.error()
    return info
