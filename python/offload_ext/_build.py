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


def _nvcc_archs(cuda_home: str) -> set[str]:
    """The compute capabilities this toolkit's nvcc compiles for, as "9.0"-style strings (empty if unknown)."""
    try:
        out = subprocess.run([os.path.join(cuda_home, "bin", "nvcc"), "--list-gpu-arch"], capture_output=True,
                             text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return set()
    return {f"{m[:-1]}.{m[-1]}" for m in re.findall(r"compute_(\d+)", out)}


def default_arch_list(torch_archs: list[str], cuda_home: str) -> tuple[str, str]:
    """(TORCH_CUDA_ARCH_LIST, why) for a build that sees no GPU and was given no list.

    torch asks the visible GPU for its architecture and fails with none (a Docker build, a CPU CI machine).
    The architectures the installed torch itself was built for are the ones the extension can run beside;
    those this nvcc can compile, with PTX of the newest so later GPUs JIT it.
    """
    wanted = [f"{a[3:-1]}.{a[-1]}" for a in torch_archs if re.fullmatch(r"sm_\d+", a)]
    known = _nvcc_archs(cuda_home)
    archs = [a for a in wanted if not known or a in known] or ["9.0"]
    why = "no GPU visible and TORCH_CUDA_ARCH_LIST unset: the architectures torch was built for"
    if not wanted:
        why = "no GPU visible and TORCH_CUDA_ARCH_LIST unset; torch names no architectures: Hopper"
    return ";".join(archs[:-1] + [archs[-1] + "+PTX"]), why


def choose_arch_list(gpu_visible: bool, torch_archs: list[str], cuda_home: str) -> str:
    """Sets TORCH_CUDA_ARCH_LIST for a CUDA build when it is unset and no GPU can be asked; returns the list and
    where it came from, for the build's one line."""
    given = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if given:
        return f"TORCH_CUDA_ARCH_LIST={given} (from the environment)"
    if gpu_visible:
        return "the visible GPU's architecture (TORCH_CUDA_ARCH_LIST unset)"
    archs, why = default_arch_list(torch_archs, cuda_home)
    os.environ["TORCH_CUDA_ARCH_LIST"] = archs
    return f"TORCH_CUDA_ARCH_LIST={archs} ({why}; set it to build for fewer)"


def source_files(with_cuda: bool) -> list[str]:
    """Every C++ source under csrc/, in its role's subfolder; the CUDA kernels (*.cu) only into a CUDA build.

    Includes are relative to the including file, so the build needs no include directory of its own.
    """
    patterns = ["*.cpp", "*.cu"] if with_cuda else ["*.cpp"]
    sources = [s for p in patterns for s in sorted(glob.glob(os.path.join(CSRC_DIR, "**", p), recursive=True))]
    _check_unique_names(sources)
    return sources


def _check_unique_names(sources: list[str]) -> None:
    """The just-in-time build names each object file after its source's base name (ops/x.cpp -> x.o)."""
    seen: dict[str, str] = {}
    for source in sources:
        stem = os.path.splitext(os.path.basename(source))[0]
        key = stem + (".cuda" if source.endswith(".cu") else "")
        if key in seen:
            raise RuntimeError(f"offload_ext: {seen[key]} and {source} would build the same object file {key}.o; "
                               "rename one")
        seen[key] = source


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
    sources = source_files(with_cuda)
    # No -std: torch.utils.cpp_extension picks the standard its headers need (C++17 or C++20).
    flags = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-Wall", "-Wno-unused-function"]
    if with_cuda:
        flags.append("-DOFFLOAD_EXT_WITH_CUDA")
    return BuildPlan(with_cuda, reason, cuda_home if with_cuda else None, sources, flags)
