"""Stochastic rounding to bf16 ("bf16-sr") in integer torch ops, on any device: the native kernel's rule
and random stream, bit for bit (both are defined in csrc/kernels/stochastic_rounding.h, which this follows
line for line), and the AdamW step that uses them.

The python backend steps its layers with `adamw_step_sr`, and the Offloader's device-kept parameters
(and offload-train without offload on a GPU) with offload_ext.optim.cpu_adamw.StochasticAdamW, the same function
under a torch.optim.Optimizer. Its stores go through the extension's sr_round_bf16 op (one pass) where it
is built for the tensors' device, else through `store_sr_torch`, the rule in torch ops: the same bits.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.optim.adamw import adamw as _fused_adamw

from offload_ext import ops

_MASK32 = (1 << 32) - 1
_MASK64 = (1 << 64) - 1
# Elements per piece of a step: bounds the int64 and fp32 temporaries (a few hundred MB at most) for
# large device-kept parameters such as embeddings.
_PIECE = 1 << 22
# Streams of the device-kept parameters start here, past any engine unit's (units count from 0).
DEVICE_STREAMS = 1 << 32


def _mix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def stream_key(seed: int, stream: int, step: int, high: int) -> int:
    """K of the rule for the elements whose index >> 32 is `high` (ints wrap as the C++ uint64 do)."""
    k = _mix64(seed & _MASK64)
    k = _mix64(k ^ (stream & _MASK64))
    k = _mix64(k ^ (step & _MASK64))
    return _mix64(k ^ high)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for x in [0, 2^32) held in int64, c taken in halves so that no product passes 2^63."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def random_words(seed: int, stream: int, step: int, index: int, n: int,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """The words A (an int64 tensor of values in [0, 2^32)) of elements index .. index + n - 1 of the
    stream at `step`; every element in one block of 2^32 indices (the caller cuts at their edges)."""
    high = index >> 32
    if n and (index + n - 1) >> 32 != high:
        raise ValueError("random_words: the elements cross a multiple of 2^32; cut the range there")
    key = stream_key(seed, stream, step, high) & _MASK32
    return _hash32((torch.arange(index, index + n, dtype=torch.int64, device=device) + key) & _MASK32)


def _to_bf16(x: torch.Tensor, increment: torch.Tensor) -> torch.Tensor:
    """x (float32) as bf16: (bits(x) + increment) >> 16, on the signed bits (the shift carries the sign
    bit down into the int16's). A NaN is made 0x7fc00000 first: stored as 0x7fc0, the kernel's NaN (torch's
    vectorised conversion writes 0xffff), and no sum passes 2^31."""
    bits = torch.where(torch.isnan(x), 0x7FC00000, x.view(torch.int32))
    return ((bits + increment) >> 16).to(torch.int16).view(torch.bfloat16)


def round_sr(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """x (float32) to bf16 by the rule: (bits(x) + r) >> 16, r in [0, 65536); NaN to 0x7fc0."""
    return _to_bf16(x, r)


def round_nearest(x: torch.Tensor) -> torch.Tensor:
    """x (float32) to bf16, to nearest even; NaN to 0x7fc0, as the kernel's "bf16" stores."""
    return _to_bf16(x, ((x.view(torch.int32) >> 16) & 1) + 0x7FFF)


def _pieces(index: int, n: int) -> Iterator[tuple[int, int]]:
    """[b, e) pieces of a span of n elements from stream index `index`: at most _PIECE long, none
    crossing a multiple of 2^32 of the stream's indices."""
    b = 0
    while b < n:
        room = (1 << 32) - ((index + b) & _MASK32)
        e = min(n, b + _PIECE, b + room)
        yield b, e
        b = e


def store_sr_torch(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, param: torch.Tensor, exp_avg: torch.Tensor,
                   exp_avg_sq: torch.Tensor, *, seed: int, stream: int, step: int, index: int) -> None:
    """The rule's stores of an AdamW step's fp32 results p, m, v into bf16 param, exp_avg, exp_avg_sq, for
    stream indices index .. index + n - 1 (all in one block of 2^32), in torch ops: the reference."""
    word = random_words(seed, stream, step, index, p.numel(), p.device)
    param.copy_(round_sr(p, word & 0xFFFF))
    exp_avg.copy_(round_nearest(m))
    exp_avg_sq.copy_(round_sr(v, word >> 16))


def store_sr(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, param: torch.Tensor, exp_avg: torch.Tensor,
             exp_avg_sq: torch.Tensor, *, seed: int, stream: int, step: int, index: int,
             native: bool | None = None) -> None:
    """store_sr_torch's stores, by the extension's one-pass op where it is built for the device (native=None),
    or by torch ops (native=False: the reference)."""
    if ops.native_on(p.device.type) if native is None else native:
        ops.sr_round_bf16(p, m, v, param, exp_avg, exp_avg_sq, seed=seed, stream=stream, step=step, offset=index)
    else:
        store_sr_torch(p, m, v, param, exp_avg, exp_avg_sq, seed=seed, stream=stream, step=step, index=index)


@torch.no_grad()
def adamw_step_sr(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                  lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                  sr_seed: int, sr_stream: int, sr_offset: int = 0, native: bool | None = None) -> None:
    """One AdamW step over contiguous bf16 tensors, in place, param and exp_avg_sq stored with stochastic
    rounding (exp_avg to nearest): what offload_ext.adamw_step(..., sr_seed=, sr_stream=, sr_offset=) does,
    in torch ops on any device. The fp32 update is torch's fused AdamW on fp32 copies (the native
    kernel's arithmetic); the stores are store_sr's (`native` chooses as there)."""
    flat = [t.view(-1) for t in (param, grad, exp_avg, exp_avg_sq)]
    for b, e in _pieces(sr_offset, param.numel()):
        p, g, m, v = (t[b:e].float() for t in flat)
        count = torch.tensor(float(step - 1), device=p.device)  # fused AdamW counts it up to `step`
        _fused_adamw([p], [g], [m], [v], [], [count], fused=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=lr,
                     weight_decay=weight_decay, eps=eps, maximize=False)
        store_sr(p, m, v, flat[0][b:e], flat[2][b:e], flat[3][b:e], seed=sr_seed, stream=sr_stream, step=step,
                 index=sr_offset + b, native=native)

