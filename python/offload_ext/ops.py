"""Typed Python wrappers over the native ops (torch.ops.offload_ext.*) and settings."""
from __future__ import annotations

import torch

from ._ext import native


def adamw_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    param_out: torch.Tensor | None = None,
) -> None:
    """One fused AdamW step over a contiguous span, in place, with torch.optim.AdamW's semantics.

    Modes follow the dtypes: all bf16 (math in fp32); or fp32 param/exp_avg/exp_avg_sq with a bf16
    or fp32 grad, optionally writing the updated param rounded to bf16 into `param_out`.
    `step` is the 1-based step count used for bias correction.
    """
    native()
    torch.ops.offload_ext.adamw_step(
        param, grad, exp_avg, exp_avg_sq, param_out,
        float(lr), float(beta1), float(beta2), float(eps), float(weight_decay), int(step),
    )


def set_num_threads(num_threads: int, pin: bool = False) -> None:
    """Size the kernels' thread pool (the caller counts as one); `pin` keeps the lowest CPU free."""
    native().set_num_threads(int(num_threads), bool(pin))


def get_num_threads() -> int:
    return native().get_num_threads()


def set_simd_level(level: str) -> None:
    """Choose the kernels' ISA: "scalar", "avx2" or "avx512" (at most what this CPU supports)."""
    native().set_simd_level(level)


def supported_simd_level() -> str:
    return native().supported_simd_level()
