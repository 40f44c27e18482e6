"""A quantized base weight dequantized to bf16, each way there is: the extension's op, the rule in torch ops, and
bitsandbytes' own kernels (NF4's dequantize_4bit, LLM.int8's int8_vectorwise_dequant) where bitsandbytes is
installed, on the same codes and scales. Median of the timed calls after warm-up; the bytes each element moves
(its code and its share of the scales read, a bf16 written); whether each way gives the op's bits.

A LoRA run on a quantized base dequantizes every streamed layer's base in forward and again in its recompute: at
70 B, 68 G elements twice a step, where a pass of 30 bytes an element costs seconds.

    python benchmarks/bench_dequant.py                       # the 70 B shape's largest weight, on the GPU
    python benchmarks/bench_dequant.py --device cpu --rows 64 --cols 256
"""
from __future__ import annotations

import argparse
from typing import Callable

import torch

import _common
from offload_ext.models import quantized_base
from offload_ext.models.quantized_base import BASE_DTYPES, NF4_BLOCK, dequantize, quantize_into, stored_elements


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8192, help="the weight's rows (default: Llama-3.1-70B's down_proj)")
    ap.add_argument("--cols", type=int, default=28672)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--steps", type=int, default=20, help="timed calls (median reported)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--stem", default=None, help="result file name stem (default dequant_<device>)")
    return ap.parse_args()


def code_bytes(fmt: str) -> float:
    """Bytes read an element: its code and its share of the fp32 scales (a row's, or NF4's block's)."""
    return 0.5 + 4 / NF4_BLOCK if fmt == "nf4" else 1.0


def bitsandbytes_way(fmt: str, shape: torch.Size, storage: torch.Tensor) -> Callable[[], torch.Tensor] | None:
    """bitsandbytes' dequantization of the same codes and scales (our layout is its), or None without it."""
    try:
        import bitsandbytes.functional as bnb
    except ImportError:
        return None
    scales, codes = quantized_base._parts(fmt, shape, storage)
    if fmt == "nf4":
        state = bnb.QuantState(absmax=scales, shape=shape, blocksize=NF4_BLOCK, quant_type="nf4",
                               dtype=torch.bfloat16, code=bnb.get_4bit_type("nf4", device=storage.device))
        return lambda: bnb.dequantize_4bit(codes.view(-1, 1), state)
    if fmt == "int8":
        return lambda: bnb.int8_vectorwise_dequant(codes.view(torch.int8).view(shape), scales).to(torch.bfloat16)
    return None  # bitsandbytes has no row-wise fp8


def rows_of(fmt: str, shape: torch.Size, device: torch.device, a: argparse.Namespace) -> list[dict]:
    weight = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16().to(device)
    storage = torch.empty(stored_elements(fmt, shape), dtype=torch.bfloat16, device=device)
    quantize_into(fmt, weight, storage)
    del weight
    out = torch.empty(shape, dtype=torch.bfloat16, device=device)
    dequantize(fmt, shape, storage, out, native=True)
    reference = out.clone()
    ways: list[tuple[str, Callable[[], torch.Tensor]]] = [
        ("offload_ext op", lambda: (dequantize(fmt, shape, storage, out, native=True), out)[1]),
        ("torch ops (the rule)", lambda: (dequantize(fmt, shape, storage, out, native=False), out)[1])]
    theirs = bitsandbytes_way(fmt, shape, storage)
    if theirs is not None:
        ways.append(("bitsandbytes", theirs))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = []
    for name, way in ways:
        same = bool(torch.equal(way().view(torch.int16), reference.view(torch.int16)))
        sec = _common.median_seconds(way, a.steps, a.warmup, sync)
        moved = shape.numel() * (code_bytes(fmt) + 2)
        rows.append({"format": fmt, "way": name, "seconds": sec, "gb_per_s": moved / sec / 1e9, "same_bits": same})
        print(f"  {fmt:5s} {name:22s} {sec * 1e3:9.3f} ms  {moved / sec / 1e9:8.1f} GB/s  same bits: {same}",
              flush=True)
    return rows


def main() -> None:
    a = parse()
    device = torch.device(a.device)
    shape = torch.Size((a.rows, a.cols))
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"a {a.rows} x {a.cols} weight ({shape.numel() / 1e6:.1f} M elements) on {where}", flush=True)
    rows = [r for fmt in BASE_DTYPES for r in rows_of(fmt, shape, device, a)]
    op = {r["format"]: r["seconds"] for r in rows if r["way"] == "offload_ext op"}
    lines = [f"a {a.rows} x {a.cols} weight ({shape.numel() / 1e6:.1f} M elements) on {where}", "",
             "| format | way | ms | GB/s | time / the op's | the op's bits |", "|---|---|---:|---:|---:|---|"]
    lines += [f"| {r['format']} | {r['way']} | {r['seconds'] * 1e3:.3f} | {r['gb_per_s']:.1f} | "
              f"{r['seconds'] / op[r['format']]:.2f}x | {'yes' if r['same_bits'] else 'no'} |" for r in rows]
    _common.publish(a.stem or f"dequant_{device.type}", {"workload": {"rows": a.rows, "cols": a.cols,
                                                                     "device": where}, "rows": rows}, lines)


if __name__ == "__main__":
    main()
