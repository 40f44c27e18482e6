"""Build configuration shared by setup.py (ahead-of-time) and the just-in-time loader.

Imported by file path from setup.py, so it must not import torch or the package itself.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field

EXT_NAME = "offload_ext._C"
CSRC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")


_TRUE = {"1", "true", "yes", "on"}


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def _is_toolkit_root(path: str | None) -> bool:
    return bool(path) and os.path.isfile(os.path.join(path, "include", "cuda_runtime_api.h"))


def _root_from_nvcc_dryrun(nvcc: str) -> str | None:
    """The real toolkit root, even when `nvcc` on PATH is a wrapper script.

    nvcc's dry run prints the directory the real binary lives in (`_HERE_=...`).
    """
    try:
        out = subprocess.run(
            [nvcc, "--dryrun", "--version"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"_HERE_=(\S+)", out.stdout + out.stderr)
    if not match:
        return None
    return os.path.dirname(os.path.normpath(match.group(1)))


def find_cuda_home() -> str | None:
    """Locate the CUDA toolkit root: CUDA_HOME/CUDA_PATH, then nvcc's own report, then the default."""
    for var in ("OFFLOAD_EXT_CUDA_HOME", "CUDA_HOME", "CUDA_PATH"):
        if _is_toolkit_root(os.environ.get(var)):
            return os.environ[var]
    nvcc = shutil.which("nvcc")
    if nvcc:
        root = _root_from_nvcc_dryrun(nvcc)
        if _is_toolkit_root(root):
            return root
        root = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
        if _is_toolkit_root(root):
            return root
    for root in ["/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True)]:
        if _is_toolkit_root(root):
            return root
    return None


@dataclass
class BuildPlan:
    """What to compile and why; `reason` is printed by setup.py and the JIT loader."""

    with_cuda: bool
    reason: str
    cuda_home: str | None = None
    sources: list[str] = field(default_factory=list)
    cxx_flags: list[str] = field(default_factory=list)


def plan_build(torch_cuda_version: str | None) -> BuildPlan:
    """Decide CPU-only or CUDA from OFFLOAD_EXT_FORCE_CPU / OFFLOAD_EXT_FORCE_CUDA, torch and the toolkit."""
    force_cpu = _env_flag("OFFLOAD_EXT_FORCE_CPU")
    force_cuda = _env_flag("OFFLOAD_EXT_FORCE_CUDA")
    if force_cpu and force_cuda:
        raise RuntimeError("offload_ext: set only one of OFFLOAD_EXT_FORCE_CPU and OFFLOAD_EXT_FORCE_CUDA")
    cuda_home = find_cuda_home()
    if force_cpu:
        with_cuda, reason = False, "OFFLOAD_EXT_FORCE_CPU is set"
    elif torch_cuda_version is None:
        with_cuda, reason = False, "the installed torch is a CPU-only build (torch.version.cuda is None)"
    elif cuda_home is None:
        with_cuda, reason = False, (
            f"torch is built for CUDA {torch_cuda_version} but no CUDA toolkit was found "
            "(set CUDA_HOME to the toolkit root)"
        )
    else:
        with_cuda, reason = True, f"torch CUDA {torch_cuda_version}, toolkit at {cuda_home}"
    if force_cuda and not with_cuda:
        raise RuntimeError(f"offload_ext: OFFLOAD_EXT_FORCE_CUDA is set but the CUDA parts cannot be built: {reason}")
    # C++ sources always; CUDA kernels (*.cu) only into a CUDA build.
    sources = sorted(glob.glob(os.path.join(CSRC_DIR, "*.cpp")))
    if with_cuda:
        sources += sorted(glob.glob(os.path.join(CSRC_DIR, "*.cu")))
    # No -std: torch.utils.cpp_extension picks the standard its headers need (C++17 or C++20).
    flags = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-Wall", "-Wno-unused-function"]
    if with_cuda:
        flags.append("-DOFFLOAD_EXT_WITH_CUDA")
    return BuildPlan(with_cuda, reason, cuda_home if with_cuda else None, sources, flags)
