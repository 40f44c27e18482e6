"""Quantized frozen base weights: how a frozen linear weight (LoRA's base) is held on the host and streamed in
fewer bytes, and turned back into bf16 on the device before its layer computes.

Each format keeps bitsandbytes' rule where bitsandbytes has one, so that its quantized weights are ours bit for
bit and ours dequantize as its do:
- "int8": row-wise (one scale per output channel) absmax, LLM.int8's vector-wise rule: q = round(w * 127 / absmax)
  with absmax a row's largest |w| in fp32; w' = q * absmax * (1 / 127), in fp32.
- "fp8": the same rows, float8 e4m3: scale = absmax / 448 (e4m3's largest finite value); q = w / scale, rounded
  to e4m3 (clamped to +-448 first: no NaN from a rounding past it); w' = q * scale, in fp32.
- "nf4": bitsandbytes' NF4 layout: blocks of 64 consecutive elements, each scaled by its absmax (fp32) into
  [-1, 1] and rounded to the nearest of the 16 NormalFloat4 levels (ties to the lower one); two codes a byte,
  the first in the high nibble; w' = level * absmax, in fp32.
The dequantized value is rounded to bf16, the dtype the layers compute in. A format's bytes sit in the unit's
flat bf16 buffer as raw storage: the scales (fp32) first, then the codes; `stored_elements` is its length in
bf16 elements, even, so that each span, and the fp32 scales at its start, stay 4-byte aligned.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from offload_ext import ops

BASE_DTYPES = ("int8", "fp8", "nf4")
NF4_BLOCK = 64  # QLoRA's block size
# Elements dequantized at a time: the fp32 (and NF4's int32) temporaries stay ~200 MB however large the weight
# (a 70 B layer's largest is 235 M elements: ~2 GB of temporaries at once, under a 24 GB cap).
DEQUANT_CHUNK = 1 << 24
DEQUANT_TEMP_BYTES = 12 * DEQUANT_CHUNK  # the codes widened, the levels gathered, the product
# Elements quantized at a time: temporaries of a few MB that the allocator reuses, where a whole matrix at once
# faulted in fresh host pages for each of its ~2 GB temporaries (a 70 B base took minutes to fill on the host).
QUANT_CHUNK = 1 << 20
_FP8_MAX = 448.0
_INV_127 = 7.874015718698502e-3  # LLM.int8's 1 / 127, as its dequantization multiplies by it

# The 16 NormalFloat4 levels (the QLoRA paper's quantiles of N(0, 1), scaled into [-1, 1]), ascending.
NF4_LEVELS = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
              -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
              0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
              0.7229568362236023, 1.0)


def quantizable(fmt: str, shape: torch.Size) -> bool:
    """Whether a weight of `shape` can be held in `fmt` (a matrix; for nf4, whole blocks)."""
    if len(shape) != 2:
        return False
    return fmt != "nf4" or shape.numel() % NF4_BLOCK == 0


def quantized_linears(module: nn.Module, fmt: str) -> list[nn.Linear]:
    """The linear layers under `module` whose weight `fmt` holds: frozen (LoRA's base), of a shape it can."""
    return [m for m in module.modules()
            if isinstance(m, nn.Linear) and not m.weight.requires_grad and quantizable(fmt, m.weight.shape)]


def _scale_count(fmt: str, shape: torch.Size) -> int:
    return shape.numel() // NF4_BLOCK if fmt == "nf4" else shape[0]


def _code_bytes(fmt: str, shape: torch.Size) -> int:
    return shape.numel() // 2 if fmt == "nf4" else shape.numel()


def stored_elements(fmt: str, shape: torch.Size) -> int:
    """The bf16 elements a weight of `shape` takes in `fmt`: its fp32 scales and its codes, rounded up to even."""
    nbytes = 4 * _scale_count(fmt, shape) + _code_bytes(fmt, shape)
    return 2 * -(-nbytes // 4)


def _parts(fmt: str, shape: torch.Size, storage: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 scales, codes) as views of `storage`, a span of a unit's bf16 buffer."""
    raw = storage.view(torch.uint8)
    n_scales = _scale_count(fmt, shape)
    scales = raw[: 4 * n_scales].view(torch.float32)
    codes = raw[4 * n_scales: 4 * n_scales + _code_bytes(fmt, shape)]
    return scales, codes.view(torch.float8_e4m3fn) if fmt == "fp8" else codes


@functools.cache
def _nf4_bounds() -> tuple[float, ...]:
    """The midpoints of adjacent levels, in fp32 as the levels are held: compared with on any device, no tensor."""
    levels = torch.tensor(NF4_LEVELS, dtype=torch.float32)
    return tuple(((levels[1:] + levels[:-1]) / 2).tolist())


def quantize_into(fmt: str, weight: torch.Tensor, storage: torch.Tensor) -> None:
    """Write `weight` (a bf16 matrix) in `fmt` into `storage` (a bf16 span of stored_elements), QUANT_CHUNK
    elements at a time (whole rows; for nf4 whole blocks)."""
    scales, codes = _parts(fmt, weight.shape, storage)
    if fmt == "nf4":
        flat = weight.reshape(-1)
        for begin in range(0, flat.numel(), QUANT_CHUNK):  # QUANT_CHUNK is a multiple of the block
            blocks = flat[begin:begin + QUANT_CHUNK].float().view(-1, NF4_BLOCK)
            absmax = blocks.abs().amax(dim=1)
            scaled = torch.clamp(blocks * (1.0 / absmax.clamp(min=1e-38)).unsqueeze(1), -1, 1).view(-1)
            q = torch.zeros(scaled.numel(), dtype=torch.uint8, device=scaled.device)
            # the bounds below each: its nearest level, a tie to the lower (bucketize's answer, 3x slower)
            for bound in _nf4_bounds():
                q += scaled > bound
            codes[begin // 2:(begin + q.numel()) // 2].copy_((q[::2] << 4) | q[1::2])
            scales[begin // NF4_BLOCK:begin // NF4_BLOCK + absmax.numel()].copy_(absmax)
        return
    rows, cols = weight.shape
    step = max(1, QUANT_CHUNK // cols)
    for r in range(0, rows, step):
        part = weight[r:r + step]
        absmax = part.abs().amax(dim=1).float()
        span = slice(r * cols, (r + part.shape[0]) * cols)
        if fmt == "int8":
            # a row of zeros: codes 0 (its scale is 0), where 127 / 0 would make them NaN
            scaled = torch.round(part * (127.0 / absmax.clamp(min=1e-38).unsqueeze(1)))
            codes.view(torch.int8)[span].copy_(scaled.reshape(-1))
        else:
            # a tensor divisor: CUDA divides by a Python number as a product with its reciprocal, a bit off
            absmax = absmax / torch.full_like(absmax, _FP8_MAX)
            scaled = torch.clamp(part.float() / absmax.clamp(min=1e-38).unsqueeze(1), -_FP8_MAX, _FP8_MAX)
            codes[span].copy_(scaled.reshape(-1))
        scales[r:r + part.shape[0]].copy_(absmax)


@functools.cache
def _levels(device: torch.device) -> torch.Tensor:
    return torch.tensor(NF4_LEVELS, dtype=torch.float32, device=device)  # once a device: no copy up at each bind


def dequantize(fmt: str, shape: torch.Size, storage: torch.Tensor, out: torch.Tensor,
               native: bool | None = None) -> None:
    """`out` (bf16, of `shape`) from a weight held in `fmt` in `storage`, on the device both are on: by the
    extension's one-pass op where it is built for the device (native=None), or by torch ops (native=False: the
    reference rule, the same bits)."""
    if ops.native_on(storage.device.type) if native is None else native:
        ops.dequantize_base(storage, fmt, shape, out.view(-1))
    else:
        dequantize_torch(fmt, shape, storage, out)


def dequantize_temp_bytes(device_type: str = "cuda") -> int:
    """The device bytes a dequantization takes beyond its output: none by the op, one chunk's by torch ops."""
    return 0 if ops.native_on(device_type) else DEQUANT_TEMP_BYTES


def dequantize_torch(fmt: str, shape: torch.Size, storage: torch.Tensor, out: torch.Tensor) -> None:
    """dequantize's rule in torch ops, DEQUANT_CHUNK elements at a time (~30 bytes of memory traffic an element)."""
    scales, codes = _parts(fmt, shape, storage)
    flat = out.view(-1)
    if fmt == "nf4":
        levels = _levels(codes.device)
        for begin in range(0, shape.numel(), DEQUANT_CHUNK):  # whole blocks: DEQUANT_CHUNK is a multiple of 64
            end = min(begin + DEQUANT_CHUNK, shape.numel())
            packed = codes[begin // 2:end // 2]
            q = torch.empty(end - begin, dtype=torch.int32, device=codes.device)
            q[::2] = packed >> 4
            q[1::2] = packed & 0xF
            block = scales[begin // NF4_BLOCK:end // NF4_BLOCK].unsqueeze(1)
            flat[begin:end].copy_((levels[q].view(-1, NF4_BLOCK) * block).view(-1))
        return
    rows, cols = shape
    step = max(1, DEQUANT_CHUNK // cols)
    for r in range(0, rows, step):
        part = codes[r * cols:min(rows, r + step) * cols].view(-1, cols)
        scale = scales[r:r + step].unsqueeze(1)
        value = part.view(torch.int8) * scale * _INV_127 if fmt == "int8" else part.float() * scale
        out[r:r + step].copy_(value)
