"""Typed Python wrappers over the native ops (torch.ops.offload_ext.*) and settings; the ops' fake
(meta) kernels and the cross-entropy's autograd formula, registered as soon as the extension has loaded.

The native classes are reached here too: `ops.Engine`, `ops.Event`, `ops.Direction`, `ops.Job` (the
Engine's copy streams and job kinds); reaching one without the extension raises the build failure and fix.
"""
from __future__ import annotations

import functools
from typing import Any

import torch

from offload_ext import _ext
from offload_ext._ext import native

_NATIVE_CLASSES = ("Engine", "Event", "Direction", "Job")


def __getattr__(name: str) -> Any:
    if name in _NATIVE_CLASSES:
        return getattr(native(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    sr_seed: int | None = None,
    sr_stream: int = 0,
    sr_offset: int = 0,
    grad_scale: float = 1.0,
) -> None:
    """One fused AdamW step over a contiguous span, in place, with torch.optim.AdamW's semantics, on CPU
    tensors or (without sr_seed) CUDA tensors: the CUDA kernel gives the CPU kernel's bits.

    Modes follow the dtypes: all bf16 (math in fp32); or fp32 param/exp_avg/exp_avg_sq with a bf16
    or fp32 grad, optionally writing the updated param rounded to bf16 into `param_out`.
    `step` is the 1-based step count used for bias correction.
    With `sr_seed` (bf16 mode only), param and exp_avg_sq are stored by stochastic rounding, the span's
    elements drawing indices sr_offset.. of stream (sr_seed, sr_stream): offload_ext.optim.stochastic_rounding
    gives the rule, and the same result in torch ops.
    `grad_scale` != 1: the step reads bf16(grad * grad_scale) for a bf16 grad, the fp32 product for an fp32 one
    on either device, as a .grad is after torch.nn.utils.clip_grad_norm_ scales it.
    """
    native()
    torch.ops.offload_ext.adamw_step(
        param, grad, exp_avg, exp_avg_sq, param_out,
        float(lr), float(beta1), float(beta2), float(eps), float(weight_decay), int(step),
        None if sr_seed is None else int(sr_seed), int(sr_stream), int(sr_offset), float(grad_scale),
    )


def adamw8bit_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    exp_avg_absmax: torch.Tensor,
    exp_avg_sq_absmax: torch.Tensor,
    exp_avg_code: torch.Tensor,
    exp_avg_sq_code: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    sr_seed: int | None = None,
    sr_stream: int = 0,
    sr_offset: int = 0,
) -> None:
    """One AdamW step with 8-bit moments ("bf16-8bit") over a contiguous span (CPU or CUDA), in place, by
    offload_ext.optim.eight_bit's rule (which states it and gives it in torch ops, bit for bit).

    param bf16; grad bf16 or fp32; exp_avg and exp_avg_sq uint8 indices into the maps exp_avg_code and
    exp_avg_sq_code (256 strictly increasing fp32 codes each: eight_bit's dynamic maps); exp_avg_absmax and
    exp_avg_sq_absmax fp32, one per block of 256 elements, all on param's device; the maps there or on the CPU
    (a CUDA step then takes them by value, with no read back to check them). `step` is 1-based. With `sr_seed`
    the param is stored by stochastic rounding, the span's elements drawing indices sr_offset.. of stream
    (sr_seed, sr_stream).
    """
    native()
    torch.ops.offload_ext.adamw8bit_step(
        param, grad, exp_avg, exp_avg_sq, exp_avg_absmax, exp_avg_sq_absmax, exp_avg_code, exp_avg_sq_code,
        float(lr), float(beta1), float(beta2), float(eps), float(weight_decay), int(step),
        None if sr_seed is None else int(sr_seed), int(sr_stream), int(sr_offset),
    )


def cross_entropy_rows(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100, overwrite: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row cross-entropy of [rows, vocab] logits (any float dtype, math in fp32): (loss, lse), both
    float32 [rows]; a row labelled ignore_index has loss 0. Differentiable in the logits (not via lse).

    With `overwrite`, the backward writes the logits' gradient over the logits instead of new memory and
    bumps their version, so anything else that saved them fails loudly: only for logits nothing else saved
    (the output of a plain nn.Linear).
    """
    native()
    return torch.ops.offload_ext.cross_entropy_rows(logits, labels, int(ignore_index), bool(overwrite))


def cross_entropy_rows_backward(
    logits: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor, grad: torch.Tensor, grad_logits: torch.Tensor,
    ignore_index: int = -100,
) -> None:
    """grad_logits = d(sum_r grad[r] * loss[r]) / d logits, in the logits' dtype; grad_logits may be logits."""
    native()
    torch.ops.offload_ext.cross_entropy_rows_backward(logits, lse, labels, grad, int(ignore_index), grad_logits)


def sum_squares(x: torch.Tensor) -> torch.Tensor:
    """The float64 sum of the squares of a contiguous bf16 tensor's elements (on the CPU also an fp32 one's; each
    square exact), as a 0-d float64 tensor on its device: one read of the data, no float64 copy of it. On the CPU
    the order is the engine's host norm pass; on CUDA a fixed grid, the same on every run."""
    native()
    return torch.ops.offload_ext.sum_squares(x)


def _int64(x: int) -> int:
    """x mod 2^64 as the int64 of the same bits: the ops take uint64 seeds and streams through int64."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >> 63 else x


def sr_round_bf16(param32: torch.Tensor, exp_avg32: torch.Tensor, exp_avg_sq32: torch.Tensor, param: torch.Tensor,
                  exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *, seed: int, stream: int, step: int,
                  offset: int) -> None:
    """The stores of a bf16-sr AdamW step from its fp32 results, in one pass on their device: param and
    exp_avg_sq by stochastic rounding with the words of stream (seed, stream) at `step` for indices
    offset .. offset + n - 1 (all in one block of 2^32), exp_avg to nearest. Bit for bit
    offload_ext.optim.stochastic_rounding's rule."""
    native()
    torch.ops.offload_ext.sr_round_bf16(param32, exp_avg32, exp_avg_sq32, param, exp_avg, exp_avg_sq, _int64(seed),
                                        _int64(stream), int(step), int(offset))


def dequantize_base(storage: torch.Tensor, fmt: str, shape: torch.Size, out: torch.Tensor) -> None:
    """`out` (bf16, contiguous, of `shape`'s elements) from a weight of `shape` held in `fmt` ("int8", "fp8" or
    "nf4") in `storage` (its bf16 span: the fp32 scales, then the codes), in one pass on their device: bit for bit
    offload_ext.models.quantized_base's rule."""
    native()
    rows, cols = shape
    torch.ops.offload_ext.dequantize_base(storage, fmt, int(rows), int(cols), out)


@functools.cache
def native_on(device_type: str) -> bool:
    """Whether the extension's ops are built for this kind of device (a CPU-only build has no CUDA kernels)."""
    if not _ext.available():
        return False
    return device_type == "cpu" or (device_type == "cuda" and bool(native().native_info()["cuda"]))


def set_num_threads(num_threads: int, pin: bool = False) -> None:
    """Size the kernels' thread pool (the caller counts as one); `pin` keeps the lowest CPU free."""
    native().set_num_threads(int(num_threads), bool(pin))


def get_num_threads() -> int:
    return native().get_num_threads()


def default_num_threads() -> int:
    """The kernel pool's size until set_num_threads: every usable CPU (a standalone optimizer drives no GPU;
    the Offloader's engine has its own pool and leaves cores for the threads that do)."""
    return native().default_num_threads()


# The kernels' ISAs, each a superset of the one before: "avx512vbmi" is AVX-512 with VBMI's byte permutes, which
# only the 8-bit kernel's decoder uses.
SIMD_LEVELS = ("scalar", "avx2", "avx512", "avx512vbmi")


def set_simd_level(level: str) -> None:
    """Choose the kernels' ISA, one of SIMD_LEVELS (at most what this CPU supports)."""
    native().set_simd_level(level)


def supported_simd_level() -> str:
    return native().supported_simd_level()


def supported_simd_levels() -> tuple[str, ...]:
    """Every ISA this CPU runs, from "scalar" up to supported_simd_level()."""
    return SIMD_LEVELS[: SIMD_LEVELS.index(supported_simd_level()) + 1]


def _same_numel(who: str, param: torch.Tensor, **others: torch.Tensor | None) -> None:
    for name, t in others.items():
        if t is not None:
            torch._check(t.numel() == param.numel(),
                         lambda: f"{who}: expected {name} to have as many elements as param")


def _register_fakes_and_autograd() -> None:
    """Fake kernels (shapes and dtypes only, for FakeTensor, torch.compile and export) and the autograd
    formula of cross_entropy_rows. Registered from this module: the C++ library names it (set_python_module)."""

    @torch.library.register_fake("offload_ext::adamw_step")
    def _adamw_step_fake(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                         param_out: torch.Tensor | None, lr: float, beta1: float, beta2: float, eps: float,
                         weight_decay: float, step: int, sr_seed: int | None = None, sr_stream: int = 0,
                         sr_offset: int = 0, grad_scale: float = 1.0) -> None:
        _same_numel("adamw_step", param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, param_out=param_out)

    @torch.library.register_fake("offload_ext::adamw8bit_step")
    def _adamw8bit_step_fake(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                             exp_avg_sq: torch.Tensor, exp_avg_absmax: torch.Tensor, exp_avg_sq_absmax: torch.Tensor,
                             exp_avg_code: torch.Tensor, exp_avg_sq_code: torch.Tensor, lr: float, beta1: float,
                             beta2: float, eps: float, weight_decay: float, step: int, sr_seed: int | None = None,
                             sr_stream: int = 0, sr_offset: int = 0) -> None:
        _same_numel("adamw8bit_step", param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
        blocks = (param.numel() + 255) // 256
        for name, t in (("exp_avg_absmax", exp_avg_absmax), ("exp_avg_sq_absmax", exp_avg_sq_absmax)):
            torch._check(t.numel() == blocks, lambda: f"adamw8bit_step: expected {name} to have one element a block")

    @torch.library.register_fake("offload_ext::cross_entropy_rows")
    def _cross_entropy_rows_fake(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int,
                                 overwrite: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        torch._check(logits.dim() == 2, lambda: "cross_entropy_rows: expected logits of shape [rows, vocab]")
        torch._check(labels.shape == logits.shape[:1], lambda: "cross_entropy_rows: expected one label per row")
        rows = logits.shape[0]
        return logits.new_empty(rows, dtype=torch.float32), logits.new_empty(rows, dtype=torch.float32)

    @torch.library.register_fake("offload_ext::cross_entropy_rows_backward")
    def _cross_entropy_rows_backward_fake(logits: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor,
                                          grad: torch.Tensor, ignore_index: int, grad_logits: torch.Tensor) -> None:
        torch._check(grad_logits.shape == logits.shape,
                     lambda: "cross_entropy_rows_backward: expected grad_logits shaped like logits")

    @torch.library.register_fake("offload_ext::sr_round_bf16")
    def _sr_round_bf16_fake(param32: torch.Tensor, exp_avg32: torch.Tensor, exp_avg_sq32: torch.Tensor,
                            param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, seed: int,
                            stream: int, step: int, offset: int) -> None:
        _same_numel("sr_round_bf16", param32, exp_avg32=exp_avg32, exp_avg_sq32=exp_avg_sq32, param_bf16=param,
                    exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)

    @torch.library.register_fake("offload_ext::dequantize_base")
    def _dequantize_base_fake(storage: torch.Tensor, fmt: str, rows: int, cols: int, out: torch.Tensor) -> None:
        torch._check(out.numel() == rows * cols, lambda: "dequantize_base: expected out to have rows * cols elements")

    @torch.library.register_fake("offload_ext::sum_squares")
    def _sum_squares_fake(x: torch.Tensor) -> torch.Tensor:
        torch._check(x.dtype == torch.bfloat16 or (x.dtype == torch.float32 and x.device.type == "cpu"),
                     lambda: "sum_squares: expected a bf16 tensor (or an fp32 one on the CPU)")
        return x.new_empty((), dtype=torch.float64)

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
        logits, labels, ignore_index, overwrite = inputs
        lse = output[1]
        ctx.mark_non_differentiable(lse)  # the backward kernel gives d loss / d logits only
        ctx.save_for_backward(logits, labels, lse)
        ctx.ignore_index, ctx.overwrite = ignore_index, overwrite

    def backward(ctx: Any, grad_loss: torch.Tensor, _grad_lse: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        logits, labels, lse = ctx.saved_tensors
        grad_logits = logits if ctx.overwrite else torch.empty_like(logits)
        torch.ops.offload_ext.cross_entropy_rows_backward(logits, lse, labels, grad_loss.float().contiguous(),
                                                          ctx.ignore_index, grad_logits)
        if ctx.overwrite:
            # A second backward through this graph must fail loudly, not read gradients as logits.
            torch.autograd.graph.increment_version(logits)
        return grad_logits, None, None, None

    torch.library.register_autograd("offload_ext::cross_entropy_rows", backward, setup_context=setup_context)


if _ext.available():
    _register_fakes_and_autograd()
