"""AdamW with 8-bit moments (precision "bf16-8bit": bf16 params, a bf16 or fp32 gradient, exp_avg and exp_avg_sq
stored as one byte an element): the dynamic quantization maps, block-wise quantization, and the step's rule in
torch ops, which the native kernel (torch.ops.offload_ext.adamw8bit_step, csrc/kernels/adamw8bit_kernel.h)
equals bit for bit on every ISA and thread count.

The rule (the block-wise dynamic quantization of Dettmers et al., "8-bit Optimizers via Block-wise
Quantization", as bitsandbytes applies it to Adam):

- Maps. exp_avg uses `signed_dynamic_map()`, exp_avg_sq `unsigned_dynamic_map()`: 256 sorted fp32 codes each.
  A code is a decimal exponent and a linear fraction: for e = 0 .. 6 the fractions are the midpoints of k equal
  steps of [0.1, 1], scaled by 10^(e - 6), with k = 2^e (signed, each value with both signs) or 2^(e + 1)
  (unsigned); then 0 and 1. Each is computed in fp32 as bitsandbytes computes its maps (an fp32 linspace, fp32
  midpoints, the scale applied in fp32): the same codes, bit for bit. Small magnitudes get few codes and large
  ones many, each relative to its block's largest.
- Blocks. A span's elements are cut into blocks of BLOCK = 256 from its element 0 (the last one may be short);
  each moment keeps one fp32 absmax a block, and each element the uint8 index of its code.
- Decode: m = code[q] * absmax, in fp32.
- Update: AdamW on the decoded moments in fp32, operation for operation as the bf16 kernels' (`adamw_update`
  here: decoupled weight decay, exp_avg's lerp and exp_avg_sq's update each one fma, bias corrections); the
  param is stored to bf16 to nearest even, or with sr_seed by offload_ext.optim.stochastic_rounding's rule (param only:
  index sr_offset + i of stream (sr_seed, sr_stream) for element i, the r of its param).
- Encode, per block and moment: absmax = the largest |m| of the block, compared by bit pattern (so a NaN in the
  block makes it NaN); x = m * s with s = fp32(1 / absmax) (0 when absmax is 0); the stored index q is the number
  of midpoints mid[k] = (code[k] + code[k + 1]) * 0.5 (fp32, k = 0 .. 254) for which mid[k] >= x is false: the
  nearest code, a tie going to the lower one, and a NaN x to the last. torch finds it here by searchsorted; the
  AVX-512 kernel, for the dynamic maps, arithmetically (the decade by comparisons with the midpoints between
  decades, the rank within it from a linear formula, the rare x too near a midpoint to tell by a search:
  csrc/kernels/adamw8bit.h's LinearEncoder); the other kernels and maps from a table of the midpoints below
  each bucket of floats that share their top 16 bits and one comparison, or by a binary search over the
  midpoints for a map with two in one bucket.
"""
from __future__ import annotations

import functools
import math

import torch

from offload_ext import ops
from offload_ext.optim import stochastic_rounding
from offload_ext.planning.host_sizes import EIGHT_BIT_BLOCK

BLOCK = EIGHT_BIT_BLOCK
CODES = 256
_EXPONENTS = 7
_MASK32 = (1 << 32) - 1


def _dynamic_map(signed: bool) -> torch.Tensor:
    """The rule's map: its 256 codes, ascending, each computed in fp32 as bitsandbytes' create_dynamic_map does
    (the fractions from an fp32 linspace, their midpoints and the decimal scale in fp32), so that the codes are
    its codes bit for bit."""
    values = [0.0, 1.0]
    for e in range(_EXPONENTS):
        steps = 2 ** e if signed else 2 ** (e + 1)
        bounds = torch.linspace(0.1, 1, steps + 1, dtype=torch.float32)
        scaled = (10 ** (e - (_EXPONENTS - 1))) * ((bounds[:-1] + bounds[1:]) / 2.0)
        values += scaled.tolist() + ((-scaled).tolist() if signed else [])
    return torch.tensor(sorted(values), dtype=torch.float32)


@functools.cache
def _maps() -> tuple[torch.Tensor, torch.Tensor]:
    return _dynamic_map(signed=True), _dynamic_map(signed=False)


def signed_dynamic_map() -> torch.Tensor:
    """exp_avg's 256 codes, sorted, in [-1, 1] (a copy: the caller may keep it)."""
    return _maps()[0].clone()


def unsigned_dynamic_map() -> torch.Tensor:
    """exp_avg_sq's 256 codes, sorted, in [0, 1] (a copy)."""
    return _maps()[1].clone()


def num_blocks(numel: int) -> int:
    return -(-numel // BLOCK)


def eight_bit_codes() -> torch.Tensor:
    """Both maps in one fp32 tensor, exp_avg's 256 codes then exp_avg_sq's: what the engine's 8-bit units read."""
    return torch.cat(_maps())


def zero_code(which: int) -> int:
    """The index of code 0 in exp_avg's map (`which` 0) or exp_avg_sq's (1): a moment at zero."""
    return int(torch.nonzero(_maps()[which] == 0))


def zero_state(numel: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(exp_avg, exp_avg_sq, exp_avg_absmax, exp_avg_sq_absmax) of a span of `numel` elements whose moments are
    zero, as a first step expects them: each index that of code 0, each absmax 0."""
    exp_avg = torch.full((numel,), zero_code(0), dtype=torch.uint8)
    exp_avg_sq = torch.full((numel,), zero_code(1), dtype=torch.uint8)
    return exp_avg, exp_avg_sq, torch.zeros(num_blocks(numel)), torch.zeros(num_blocks(numel))


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """x (fp32, flat) as [blocks, BLOCK], the last block padded with zeros (which change no absmax)."""
    pad = num_blocks(x.numel()) * BLOCK - x.numel()
    return torch.nn.functional.pad(x, (0, pad)).view(-1, BLOCK)


def _absmax(blocks: torch.Tensor) -> torch.Tensor:
    """Each block's largest |x| by bit pattern: the integer order of the magnitudes' bits is their order, a NaN
    past every number."""
    return (blocks.view(torch.int32) & 0x7FFFFFFF).amax(dim=1).view(torch.float32)


def midpoints(code: torch.Tensor) -> torch.Tensor:
    """The 255 fp32 midpoints between neighbouring codes: the encoder's thresholds."""
    return (code[:-1] + code[1:]) * 0.5


def encode(x: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """The uint8 index of each x's nearest code by the rule's search (ties to the lower code, NaN to the last)."""
    index = torch.searchsorted(midpoints(code), x.contiguous())  # how many midpoints lie below x
    return torch.where(x.isnan(), CODES - 1, index).to(torch.uint8)


def quantize_blockwise(x: torch.Tensor, code: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices, absmax) of flat fp32 x under the rule's encoding: uint8 [numel], fp32 [blocks]."""
    blocks = _blocks(x)
    absmax = _absmax(blocks)
    scale = torch.where(absmax == 0, 0.0, absmax.reciprocal())
    return encode(blocks * scale[:, None], code).view(-1)[: x.numel()], absmax


def dequantize_blockwise(q: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """code[q] * absmax of its block, fp32, flat."""
    return code[q.view(-1).long()] * absmax.repeat_interleave(BLOCK)[: q.numel()]


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 a * b + c rounded once, as a hardware fma: in float64 the product is exact, and the sum rounded to
    odd (its rounding error, exact by TwoSum, decides) rounds to fp32 as the exact value would."""
    product, addend = a.double() * b.double(), c.double()
    total = product + addend
    virtual = total - product
    error = (product - (total - virtual)) + (addend - virtual)
    even = (total.view(torch.int64) & 1) == 0
    toward = torch.where(error > 0, torch.inf, -torch.inf).double()
    odd = torch.where((error != 0) & even & total.isfinite(), torch.nextafter(total, toward), total)
    return odd.float()


def sqrt(x: torch.Tensor) -> torch.Tensor:
    """fp32 sqrt(x) correctly rounded, as the kernels' sqrt instruction: torch's CPU sqrt is not always (an ulp off
    for about a sixth of random fp32 inputs, and for some float64 ones, in the MKL build this was written with).
    Its float64 root rounded to fp32 is the right float or a neighbour; the right one s is that whose
    midpoints with its neighbours bracket the root, i.e. whose squared midpoints (exact in float64: 25 bits
    squared) bracket x, which never equals one (x has 24 bits)."""
    s = x.double().sqrt().float()
    up, down = s.nextafter(_f32(torch.inf)), s.nextafter(_f32(0.0))
    above, below = (s.double() + up.double()) / 2, (s.double() + down.double()) / 2
    wide = x.double()
    return torch.where(wide > above * above, up, torch.where(wide < below * below, down, s))


def adamw_update(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, lr: float, beta1: float,
                 beta2: float, eps: float, weight_decay: float, step: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                    torch.Tensor]:
    """(p, m, v) after AdamW's fp32 update, operation for operation as the kernels' (csrc/kernels/adamw_update.h,
    torch's fused AdamW's), with their constants (make_coef: derived in float64, each rounded once to fp32)."""
    if weight_decay != 0:
        p = p * _f32(1 - lr * weight_decay)
    weight = _f32(1 - beta1)
    if abs(weight.item()) < 0.5:  # exp_avg.lerp_(grad, weight), from whichever end is nearer
        m = fma(weight, g - m, m)
    else:
        m = fma(weight - 1, g - m, g)
    v = fma(_f32(1 - beta2) * g, g, v * _f32(beta2))
    denom = sqrt(v) / _f32(math.sqrt(1 - beta2**step)) + _f32(eps)
    return p + (_f32(-(lr / (1 - beta1**step))) * m) / denom, m, v


def _param_words(seed: int, stream: int, step: int, offset: int, n: int) -> torch.Tensor:
    """The random words of stream indices offset .. offset + n - 1, cut where index >> 32 changes."""
    parts, b = [], 0
    while b < n:
        e = min(n, b + (1 << 32) - ((offset + b) & _MASK32))
        parts.append(stochastic_rounding.random_words(seed, stream, step, offset + b, e - b))
        b = e
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


@torch.no_grad()
def reference_adamw8bit_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                             exp_avg_sq: torch.Tensor, exp_avg_absmax: torch.Tensor, exp_avg_sq_absmax: torch.Tensor,
                             *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                             sr_seed: int | None = None, sr_stream: int = 0, sr_offset: int = 0,
                             maps: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """One bf16-8bit AdamW step by the module's rule, in place, in torch ops on the CPU: the kernel's reference.

    param bf16; grad bf16 or fp32; exp_avg, exp_avg_sq uint8 indices into `maps` (exp_avg's and exp_avg_sq's, each
    256 increasing fp32 codes; by default the signed and unsigned dynamic maps); their absmax fp32 of
    num_blocks(numel) elements; `step` 1-based.
    """
    signed, unsigned = maps or _maps()
    m = dequantize_blockwise(exp_avg, exp_avg_absmax, signed)
    v = dequantize_blockwise(exp_avg_sq, exp_avg_sq_absmax, unsigned)
    p, m, v = adamw_update(param.view(-1).float(), grad.view(-1).float(), m, v, lr=lr, beta1=beta1, beta2=beta2,
                           eps=eps, weight_decay=weight_decay, step=step)
    if sr_seed is None:
        rounded = stochastic_rounding.round_nearest(p)
    else:
        words = _param_words(sr_seed, sr_stream, step, sr_offset, p.numel())
        rounded = stochastic_rounding.round_sr(p, words & 0xFFFF)
    param.view(-1).copy_(rounded)
    for state, absmax, x, code in ((exp_avg, exp_avg_absmax, m, signed), (exp_avg_sq, exp_avg_sq_absmax, v, unsigned)):
        q, new_absmax = quantize_blockwise(x, code)
        state.view(-1).copy_(q)
        absmax.copy_(new_absmax)


def adamw8bit_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                   exp_avg_absmax: torch.Tensor, exp_avg_sq_absmax: torch.Tensor, *, lr: float, beta1: float,
                   beta2: float, eps: float, weight_decay: float, step: int, sr_seed: int | None = None,
                   sr_stream: int = 0, sr_offset: int = 0,
                   maps: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """reference_adamw8bit_step's step by the native kernel (`maps`, by default the dynamic ones, passed to it), in
    place."""
    signed, unsigned = maps or _maps()
    ops.adamw8bit_step(param, grad, exp_avg, exp_avg_sq, exp_avg_absmax, exp_avg_sq_absmax, signed, unsigned, lr=lr,
                       beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step, sr_seed=sr_seed,
                       sr_stream=sr_stream, sr_offset=sr_offset)
