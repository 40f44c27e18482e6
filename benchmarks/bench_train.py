"""B1: training step time side by side — GPU-resident, python backend, native backend — in bf16 and mixed.

Random-init Llama from a config (no download; Llama-3.2-1B shape by default), bf16 compute, activation
checkpointing, batch 4 x 2048. Median step time over --steps after --warmup, tok/s, ratios to
GPU-resident, GPU peak memory, set-up time (and its parts), forward time, and the time the Python thread
waited on the host AdamW (native: in step(), forward hooks and gradient-slot reuse). Also times the
mixed AdamW kernel over the same 973 M parameters in the same run. The loss is
offload_ext.causal_lm_loss (chunked vocabulary projection; the native cross-entropy kernels when built) in every mode.

A mode is backend-precision[-tN][-gN][-dN][-whole][-sync]: tN engine threads, gN gradient slots, dN
device_layers, whole for host steps not sliced (one unit at a time, as before slicing), sync for
async_step=False (e.g. native-mixed-g6-sync). The host busy column is the engine's stepping time per
step; step minus busy is the time the host had nothing to step.

    python benchmarks/bench_train.py                       # B1
    python benchmarks/bench_train.py --compile             # per-layer torch.compile
    python benchmarks/bench_train.py --layers 2 --hidden 256 --intermediate 512 --seq 256  # smoke run
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time
from typing import Any, Iterator

import torch

import _common
import offload_ext
from offload_ext import testing

MODES = ["resident", "python-bf16", "native-bf16", "native-bf16-sync", "python-mixed", "native-mixed",
         "native-mixed-g6", "native-mixed-sync", "native-mixed-d16"]


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--compile", action="store_true", help="torch.compile each layer")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--stem", default=None)
    return ap.parse_args()


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Parameters created meanwhile live on the meta device (their init costs nothing); buffers, such as
    rotary tables computed at construction, stay real."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:  # a meta one is a tie being made: keep the object
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def build_model(a: argparse.Namespace) -> torch.nn.Module:
    """A random-init bf16 Llama built with its parameters on the meta device, then filled on the host:
    N(0, initializer_range) for matrices and embeddings, ones for the norms, as HF's Llama init, in
    seconds (HF's own init of the 1.24 B shape takes about a minute on the GPU machine's host). Tied
    weights stay tied: each shared Parameter is filled once."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                      num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                      max_position_embeddings=max(a.seq, 128), tie_word_embeddings=True, rope_theta=500000.0)
    with _parameters_on_meta():
        model = LlamaForCausalLM(cfg)
    torch.manual_seed(0)
    filled: dict[int, torch.nn.Parameter] = {}  # meta parameter -> its host one, so ties survive
    for module in model.modules():
        for name, meta in module._parameters.items():
            if meta is None:
                continue
            if id(meta) not in filled:
                host = torch.empty(meta.shape, dtype=torch.bfloat16)
                host.fill_(1.0) if meta.dim() == 1 else host.normal_(0.0, cfg.initializer_range)
                filled[id(meta)] = torch.nn.Parameter(host, requires_grad=meta.requires_grad)
            module._parameters[name] = filled[id(meta)]
    model.config.use_cache = False
    return model


def run_mode(mode: str, base: torch.nn.Module, a: argparse.Namespace, tokens: torch.Tensor) -> dict[str, Any]:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = copy.deepcopy(base)
    t0 = time.perf_counter()
    if mode == "resident":
        model.to("cuda")
        offload_ext.enable_activation_checkpointing(model)
        if a.compile:
            for layer in model.model.layers:
                layer.compile()
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, fused=True)
        off = None
    else:
        backend, precision, *options = mode.split("-")
        threads = [int(o[1:]) for o in options if o.startswith("t")]
        slots = [int(o[1:]) for o in options if o.startswith("g")]
        device_layers = [int(o[1:]) for o in options if o.startswith("d")]
        off = offload_ext.Offloader(model, lr=a.lr, precision=precision, backend=backend, device="cuda",
                                    compile_layers=a.compile, num_threads=threads[0] if threads else None,
                                    grad_slots=slots[0] if slots else None,
                                    device_layers=device_layers[0] if device_layers else 2,
                                    async_step=False if "sync" in options else None,
                                    slice_elements=1 << 62 if "whole" in options else None)
    torch.cuda.synchronize()
    setup = time.perf_counter() - t0
    model.train()
    steps, forwards, waits, losses, busy = [], [], [], [], []
    for k in range(a.warmup + a.steps):
        before = off.stats() if off is not None else {}
        t0 = time.perf_counter()
        loss = offload_ext.causal_lm_loss(model, tokens)
        torch.cuda.synchronize()
        t_fwd = time.perf_counter() - t0
        if off is None:
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            off.backward(loss)
            off.step()
            off.zero_grad()
        torch.cuda.synchronize()
        losses.append(loss.item())
        if k >= a.warmup:
            steps.append(time.perf_counter() - t0)
            forwards.append(t_fwd)
            # Time the Python thread was blocked on host work: in step() (python backend, native with
            # -sync) or, with the native async step, also in forward hooks and gradient-slot reuse.
            after = off.stats() if off is not None else {}
            waits.append(max(off.last_step_wait, after["host_wait_s"] - before["host_wait_s"]) if off is not None
                         else 0.0)
            busy.append(after.get("step_busy_seconds", 0.0) - before.get("step_busy_seconds", 0.0))
    peak = torch.cuda.max_memory_allocated() / 1e9
    row = {"mode": mode, "step_s": statistics.median(steps), "forward_s": statistics.median(forwards),
           "step_wait_s": statistics.median(waits), "host_busy_s": statistics.median(busy), "setup_s": setup,
           "gpu_peak_gb": peak, "losses": losses,
           "tokens_per_s": tokens.numel() / statistics.median(steps)}
    if mode.startswith("native-mixed"):
        row["a1_mixed_kernel_s"] = time_mixed_kernel(off)
    if off is not None:
        row["engine"] = {k: v for k, v in off.stats().items() if isinstance(v, (int, float, bool))}
        row["setup_parts_s"] = dict(off.setup_seconds)
        off.close()
    del model
    parts = " ".join(f"{k} {v:.2f}" for k, v in row.get("setup_parts_s", {}).items())
    print(f"  {mode:13s} step {row['step_s']:.4f} s  fwd {row['forward_s']:.4f} s  wait {row['step_wait_s']:.4f} s"
          f"  busy {row['host_busy_s']:.4f} s"
          f"  setup {setup:.2f} s ({parts})  peak {peak:.1f} GB  loss {losses[0]:.3f}->{losses[-1]:.3f}", flush=True)
    return row


def time_mixed_kernel(off) -> float:
    """The A1 mixed kernel over this model's streamed layers, on the same buffers and thread count."""
    from offload_ext.backends.native import default_engine_threads

    testing.settle(off)  # steps of the last backward may still run on these buffers
    layers = testing.host_buffers(off)
    offload_ext.set_num_threads(default_engine_threads(), pin=True)

    def once() -> None:
        for b in layers:
            offload_ext.adamw_step(b.master, b.grads, b.exp_avg, b.exp_avg_sq, lr=0.0, beta1=0.9, beta2=0.999,
                                   eps=1e-8, weight_decay=0.0, step=1000, param_out=b.trainable_params)
    return _common.median_seconds(once, steps=5, warmup=1)


def main() -> None:
    a = parse()
    modes = [m for m in a.modes.split(",") if m]
    base = build_model(a)
    n_params = sum(p.numel() for p in base.parameters())
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq), generator=torch.Generator().manual_seed(0)).cuda()
    print(f"B1: Llama {a.layers} layers, hidden {a.hidden}, {n_params / 1e6:.0f} M params, batch {a.batch} x {a.seq}, "
          f"compile={a.compile}", flush=True)
    rows = [run_mode(m, base, a, tokens) for m in modes]
    resident = next((r for r in rows if r["mode"] == "resident"), None)
    lines = ["| mode | s/step | tok/s | vs resident (time) | forward s | host wait s | host busy s | set-up s | "
             "GPU peak GB |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = r["step_s"] / resident["step_s"] if resident else float("nan")
        r["time_ratio_vs_resident"] = ratio
        lines.append(f"| {r['mode']} | {r['step_s']:.4f} | {r['tokens_per_s']:.0f} | {ratio:.3f}x | "
                     f"{r['forward_s']:.4f} | {r['step_wait_s']:.4f} | {r['host_busy_s']:.4f} | {r['setup_s']:.2f} | "
                     f"{r['gpu_peak_gb']:.2f} |")
    for mixed in (r for r in rows if "a1_mixed_kernel_s" in r):
        # The forward of the GPU-resident run when there is one: the offloaded forward can include
        # waiting for host steps left over from the previous backward.
        fwd, source = (resident["forward_s"], "resident") if resident else (mixed["forward_s"], mixed["mode"])
        bound = fwd + 1.1 * mixed["a1_mixed_kernel_s"]
        lines += ["", f"{mixed['mode']}: step {mixed['step_s']:.4f} s vs forward ({source}) + 1.1 x mixed kernel "
                      f"({fwd:.4f} + 1.1 x {mixed['a1_mixed_kernel_s']:.4f}) = {bound:.4f} s"]
    markdown = "\n".join(lines)
    print("\n" + markdown)
    stem = a.stem or ("train_b1_compile" if a.compile else "train_b1")
    for path in _common.write_results(stem, {"args": vars(a), "params": n_params, "rows": rows}, markdown):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
