"""Loads the native extension (the ahead-of-time build if present, else a cached just-in-time build) and says
what was built, against what, and what runs (build_info)."""
from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType
from typing import Any

import torch

from offload_ext import _build
from offload_ext._version import __version__

_native: ModuleType | None = None
_origin = "not loaded"
_error: str | None = None


def _say(msg: str) -> None:
    print(f"offload_ext: {msg}", file=sys.stderr, flush=True)


def _jit_build() -> ModuleType:
    plan = _build.plan_build(torch.version.cuda)
    archs = ""
    if plan.with_cuda:
        os.environ["CUDA_HOME"] = plan.cuda_home  # torch.utils.cpp_extension reads it at import
        archs = _build.choose_arch_list(torch.cuda.device_count() > 0, torch.cuda.get_arch_list(), plan.cuda_home)
    from torch.utils import cpp_extension

    if plan.with_cuda:
        cpp_extension.CUDA_HOME = plan.cuda_home
    kind = "with CUDA" if plan.with_cuda else "CPU-only"
    detail = f"{plan.reason}; {archs}" if plan.with_cuda else plan.reason
    _say(f"no ahead-of-time build found; building the extension just-in-time ({kind}: {detail}). "
         "This happens once; the result is cached (TORCH_EXTENSIONS_DIR).")
    return cpp_extension.load(
        name="offload_ext_C",
        sources=plan.sources,
        extra_cflags=plan.cxx_flags,
        with_cuda=plan.with_cuda,
        verbose=os.environ.get("OFFLOAD_EXT_VERBOSE_BUILD", "") == "1",
    )


def _load() -> None:
    global _native, _origin, _error
    prebuilt_error: str | None = None
    try:
        _native = importlib.import_module("offload_ext._C")
        _origin = "ahead-of-time"
        return
    except ImportError as exc:
        if getattr(exc, "name", None) != "offload_ext._C":
            prebuilt_error = f"{type(exc).__name__}: {exc}"
            _say(f"the prebuilt extension failed to load ({prebuilt_error}); rebuilding just-in-time")
    if os.environ.get("OFFLOAD_EXT_NO_JIT", "") == "1":
        _error = prebuilt_error or "no prebuilt extension and OFFLOAD_EXT_NO_JIT=1"
        return
    try:
        _native = _jit_build()
        _origin = "just-in-time"
    except Exception as exc:  # a failed build leaves the pure-Python paths usable
        _error = f"{type(exc).__name__}: {exc}"
        _say(f"the native extension could not be built: {_error}")


def native() -> ModuleType:
    """The native module; raises with the build failure and the fix when it is unavailable."""
    if _native is None:
        raise RuntimeError(
            f"offload_ext: the native extension is not available ({_error}). Install a C++ compiler "
            "(and, for the GPU parts, a CUDA toolkit matching torch), then reinstall with "
            "`pip install --no-build-isolation .`; or use backend='python'."
        )
    return _native


def available() -> bool:
    return _native is not None


def error() -> str | None:
    """Why the native extension is unavailable (None when it loaded)."""
    return _error


def origin() -> str:
    return _origin


_load()


def build_info() -> dict[str, Any]:
    """Version, torch built against and running, CUDA compiled in or not, SIMD level, thread count."""
    info: dict[str, Any] = {
        "version": __version__,
        "torch_running": torch.__version__,
        "native": available(),
        "native_origin": origin(),
    }
    if available():
        info.update(native().native_info())
    else:
        info["native_error"] = error()
    return info
