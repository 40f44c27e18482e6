"""FSDP2 with its CPU offload: torch.optim.AdamW stepping after backward against offload_ext.CPUAdamW(overlap=True)
stepping each shard in backward, beside GPU-resident FSDP2; per-step time, tok/s per GPU, memory per rank.

Run under torchrun (one process per GPU; `--device cpu` runs gloo processes on the CPU, a smoke run of the
script whose timings mean nothing). The model (Llama, B2 = Llama-3.1-8B's shape by default, random weights)
is built on the meta device, each decoder layer and the root fully_shard'ed, and each rank's shards are
filled by offload_ext.materialize_shards with bench_train's weights (pre-drawn random blocks, by
parameter name): no rank ever holds the unsharded model. Every mode: bf16 parameters, activation
checkpointing of every layer, HF's own loss (through the root module's forward, which FSDP2 hooks), AdamW
betas (0.9, 0.999), eps 1e-8, no weight decay; `-clip` adds clipping at max_grad_norm 1.0 (torch:
clip_grad_norm_ before the step; CPUAdamW: max_grad_norm=, its global norm).

Modes: resident (FSDP2 on the GPUs, torch's fused AdamW there), offload-torch (CPUOffloadPolicy,
torch.optim.AdamW on the CPU shards after backward: FSDP2's own path), offload-torchfused (the same with
fused=True, torch's fused CPU kernel), offload-cpuadamw (CPUAdamW after backward: the kernel without the overlap),
offload-overlap (CPUAdamW(overlap=True)); each with an optional -clip.

    torchrun --nproc-per-node 1 benchmarks/bench_fsdp.py --modes offload-torch,offload-overlap,resident
    torchrun --nproc-per-node 2 benchmarks/bench_fsdp.py --device cpu --layers 2 --hidden 64 --intermediate 128 \\
        --heads 4 --kv-heads 2 --vocab 256 --batch 2 --seq 32 --steps 2 --warmup 1     # smoke run
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

import offload_ext
from _common import HostMemoryLog, write_results
from bench_train import TiledWeights
from offload_ext import enable_activation_checkpointing, materialize_shards, parameters_on_meta

SHAPE = dict(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256, batch=2, seq=4096)
BETAS, EPS, MAX_NORM = (0.9, 0.999), 1e-8, 1.0


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, value in SHAPE.items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--modes", default="offload-torch,offload-overlap,resident")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--stem", default="fsdp_b2")
    return ap.parse_args()


def build(a: argparse.Namespace, offload: bool, mesh: Any) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                      num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                      max_position_embeddings=max(a.seq, 128), tie_word_embeddings=False, use_cache=False)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # bf16 parameters; the rotary frequencies are computed in fp32
    try:
        with parameters_on_meta():  # the rotary frequencies stay real
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    weights = TiledWeights(model, cfg.initializer_range)  # bench_train's values, by parameter name
    enable_activation_checkpointing(model)
    policy = dict(offload_policy=CPUOffloadPolicy()) if offload and a.device == "cuda" else {}
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, **policy)
    fully_shard(model, mesh=mesh, **policy)
    # CPU offload: the shards live on the host; resident: on this rank's GPU
    where = "cpu" if offload or a.device == "cpu" else torch.device("cuda", torch.cuda.current_device())
    materialize_shards(model, weights.fill_named, where)
    return model


def optimizer(mode: str, model: torch.nn.Module, a: argparse.Namespace) -> torch.optim.Optimizer:
    kw = dict(lr=a.lr, betas=BETAS, eps=EPS, weight_decay=0.0)
    base = mode.removesuffix("-clip")
    if base in ("offload-overlap", "offload-cpuadamw"):
        return offload_ext.CPUAdamW(model.parameters(), overlap=base == "offload-overlap",
                                    max_grad_norm=MAX_NORM if mode.endswith("-clip") else None, **kw)
    if base in ("offload-torch", "offload-torchfused"):  # torch's default (foreach) and its fused CPU kernel
        return torch.optim.AdamW(model.parameters(), fused=base == "offload-torchfused", **kw)
    return torch.optim.AdamW(model.parameters(), fused=a.device == "cuda", **kw)


def _sync(a: argparse.Namespace) -> None:
    if a.device == "cuda":
        torch.cuda.synchronize()


def _release(a: argparse.Namespace) -> None:
    """What a mode held, given back before the next one and before its row is gathered."""
    gc.collect()  # FSDP2's modules and hooks hold reference cycles
    if a.device == "cuda":
        torch.cuda.empty_cache()
        # and the page-locked blocks torch's host allocator keeps cached (CPUOffloadPolicy's), where it can
        getattr(torch._C, "_host_emptyCache", lambda: None)()
        torch.cuda.reset_peak_memory_stats()


def run_mode(mode: str, a: argparse.Namespace, mesh: Any, memory: HostMemoryLog) -> dict[str, Any]:
    _release(a)
    memory.label(mode)
    t0 = time.perf_counter()
    model = build(a, mode.startswith("offload"), mesh)
    opt = optimizer(mode, model, a)
    setup = time.perf_counter() - t0
    device = torch.device("cuda", torch.cuda.current_device()) if a.device == "cuda" else torch.device("cpu")
    gen = torch.Generator().manual_seed(1 + dist.get_rank())  # each rank its own data
    # Offloaded modes: the time after backward (clipping and the step) too, with the GPU synchronized between
    # (a resident step queues its optimizer behind backward: a sync there would change what is timed).
    offloaded = mode.startswith("offload")
    times, after, losses = [], [], []
    for k in range(a.warmup + a.steps):
        batch = torch.randint(0, a.vocab, (a.batch, a.seq), generator=gen).to(device)
        _sync(a)
        t0 = time.perf_counter()
        loss = model(input_ids=batch, labels=batch).loss  # through the root's forward: FSDP2 gathers its params
        loss.backward()
        if offloaded:
            _sync(a)
            t1 = time.perf_counter()
        if mode.endswith("-clip") and mode.removesuffix("-clip") not in ("offload-overlap", "offload-cpuadamw"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(a)
        if k >= a.warmup:
            times.append(time.perf_counter() - t0)
            if offloaded:
                after.append(time.perf_counter() - t1)
        losses.append(float(loss.detach()))
    step = statistics.median(times)
    row = {"mode": mode, "step_s": step, "step_times_s": times, "tokens_per_s_per_gpu": a.batch * a.seq / step,
           "after_backward_s": statistics.median(after) if after else None,
           "setup_s": setup, "losses": losses, "host_peak_rss_gb": memory.peak(),
           "gpu_peak_gb": torch.cuda.max_memory_allocated() / 1e9 if a.device == "cuda" else 0.0}
    del model, opt
    _release(a)
    return row


def main() -> None:
    a = parse()
    backend = "nccl" if a.device == "cuda" else "gloo"
    if a.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    # NCCL makes its communicator, with device memory of its own outside torch's allocator, at the first
    # collective: here, while the GPU is empty (made after a resident 8 B mode, it failed for want of memory)
    dist.barrier()
    mesh = init_device_mesh(a.device, (dist.get_world_size(),))
    memory = HostMemoryLog(os.devnull)
    rows = []
    for mode in a.modes.split(","):
        try:
            row = run_mode(mode, a, mesh, memory)
        except (torch.OutOfMemoryError, MemoryError) as e:  # MemoryError: CPUAdamW's host check, nothing allocated
            row = {"mode": mode, "error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, row)
        rows.append(per_rank)
        if dist.get_rank() == 0:
            r = per_rank[0]
            print(f"  {mode:20s} " + (f"step {r['step_s']:.4f} s  {r['tokens_per_s_per_gpu']:.0f} tok/s/GPU  "
                                      f"after backward {_s(r['after_backward_s'])} s  "
                                      f"GPU peak {r['gpu_peak_gb']:.2f} GB  RSS peak {r['host_peak_rss_gb']:.1f} GB  "
                                      f"losses {' '.join(f'{x:.4f}' for x in r['losses'])}"
                                      if "error" not in r else r["error"]), flush=True)
    memory.close()
    if dist.get_rank() == 0:
        _write(a, rows)
    dist.destroy_process_group()


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.4f}"


def _write(a: argparse.Namespace, rows: list[list[dict[str, Any]]]) -> None:
    world = len(rows[0])
    torch_time = {r[0]["mode"].replace("offload-torch", ""): r[0]["step_s"] for r in rows
                  if r[0]["mode"].removesuffix("-clip") == "offload-torch" and "error" not in r[0]}
    lines = [f"FSDP2, {world} rank(s) ({a.device}), Llama {a.layers} layers, hidden {a.hidden}, batch {a.batch} x "
             f"{a.seq} per rank, bf16, activation checkpointing.", "",
             "| mode | s/step (rank 0) | tok/s per GPU | after backward s (clip, step) | "
             "torch AdamW offload / this (time) | GPU peak GB per rank | host peak RSS GB per rank |",
             "|---|---:|---:|---:|---:|---|---|"]
    for per_rank in rows:
        r = per_rank[0]
        if "error" in r:
            lines.append(f"| {r['mode']} | {r['error']} | - | - | - | - | - |")
            continue
        peer = torch_time.get("-clip" if r["mode"].endswith("-clip") else "")
        ratio = f"{peer / r['step_s']:.3f}x" if peer and r["mode"].startswith("offload") else "-"
        gpu = ", ".join(f"{x['gpu_peak_gb']:.2f}" for x in per_rank if "error" not in x)
        rss = ", ".join(f"{x['host_peak_rss_gb']:.1f}" for x in per_rank if "error" not in x)
        lines.append(f"| {r['mode']} | {r['step_s']:.4f} | {r['tokens_per_s_per_gpu']:.0f} | "
                     f"{_s(r['after_backward_s'])} | {ratio} | {gpu} | {rss} |")
    payload = {"args": vars(a), "world_size": world, "rows": rows}
    for path in write_results(a.stem, payload, "\n".join(lines) + "\n"):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
