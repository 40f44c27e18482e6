"""The resident peers of a LoRA run on a quantized base (bench_train's -baseint8/-basefp8/-basenf4 on resident
modes): NF4 is bitsandbytes' QLoRA as peft users run it (Linear4bit, NF4 with its absmax quantized again, bf16
compute); int8 and fp8 keep the engine's own storage on the GPU and, as bitsandbytes does for its formats, each
linear dequantizes its weight into one shared bf16 buffer in forward and again in backward (the 70 B shape's base
leaves no room on an 80 GB GPU for a layer's weights in bf16 at once)."""
from __future__ import annotations

import functools

import torch
from torch import nn

from offload_ext.models.quantized_base import dequantize, quantize_into, quantized_linears, stored_elements
from offload_ext.models.stacks import find_layer_stacks
from offload_ext.models.weight_source import WeightSource, make_real


def hold_base(model: nn.Module, fmt: str, device: str, weights: WeightSource) -> None:
    """The frozen linear weights of `model`'s layers held in `fmt` on `device`, as described above, each read from
    `weights` where it is still on the meta device: one matrix at a time in bf16 (the 70 B shape's base would not
    fit the host, nor the GPU, whole in bf16)."""
    linears = [m for _, stack in find_layer_stacks(model) for layer in stack for m in quantized_linears(layer, fmt)]

    def value(m: nn.Linear) -> torch.Tensor:
        p = m.weight
        return weights.value(p, device) if p.is_meta else p.detach().to(device)
    if fmt == "nf4":
        for m in linears:
            _to_linear4bit(model, m, value(m), device)
        return
    # Every weight's storage and the bf16 buffer they dequantize into, allocated before the first weight is read:
    # the reads' transients between persistent allocations left 30 GiB of the 70 B base's GPU reserved but unusable
    sizes = [stored_elements(fmt, m.weight.shape) for m in linears]
    held = torch.empty(sum(sizes), dtype=torch.bfloat16, device=device)
    scratch = torch.empty(max(m.weight.numel() for m in linears), dtype=torch.bfloat16, device=device)
    for m, storage in zip(linears, held.split(sizes)):
        shape = m.weight.shape
        quantize_into(fmt, value(m), storage)
        make_real(m.weight, scratch[:shape.numel()].view(shape))  # what peft reads: the dtype and device
        m.forward = functools.partial(_dequantized_linear, fmt=fmt, storage=storage, weight=m.weight.data,
                                      bias=m.bias)
    if held.is_cuda:
        torch.cuda.empty_cache()  # the reads' transients, handed back before the steps allocate


class _DequantizedLinear(torch.autograd.Function):
    """A frozen linear whose weight is dequantized where it is used, forward and backward, into `weight`: a buffer
    every linear shares, so nothing is saved for backward but the storage."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fmt: str, storage: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        ctx.fmt, ctx.storage, ctx.weight = fmt, storage, weight
        dequantize(fmt, weight.shape, storage, weight)
        return nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        dequantize(ctx.fmt, ctx.weight.shape, ctx.storage, ctx.weight)
        return (grad @ ctx.weight, None, None, None, None)


def _dequantized_linear(x: torch.Tensor, *, fmt: str, storage: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None) -> torch.Tensor:
    return _DequantizedLinear.apply(x, fmt, storage, weight, bias)


def _to_linear4bit(model: nn.Module, linear: nn.Linear, weight: torch.Tensor, device: str) -> None:
    import bitsandbytes as bnb

    if linear.bias is not None and linear.bias.is_meta:
        raise ValueError("the resident NF4 peer reads the base's weights only: its linears have no bias here")
    q = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                          compute_dtype=torch.bfloat16, quant_type="nf4", compress_statistics=True, device="meta")
    q.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4", compress_statistics=True)
    if linear.bias is not None:
        q.bias = nn.Parameter(linear.bias.detach().to(device), requires_grad=False)
    q = q.to(device)  # Params4bit quantizes as it moves
    for parent in model.modules():
        for name, child in parent.named_children():
            if child is linear:
                setattr(parent, name, q)
