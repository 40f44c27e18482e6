"""Where the host has nothing to step in B1: the GPU work between the top layer's forward and its gradients.

With the native backend the host steps layer i after its gradients land and before its next forward, so
in every step it idles from the top layer's step (needed by that layer's forward) to the top layer's next
gradients. In between the GPU runs, GPU-resident and timed here one part at a time: the top layer's
forward, the loss head forward and backward (offload_ext.lm_head_loss; its native and torch
cross-entropy side by side), the top layer's recompute and backward, and two layer-sized copies (its H2D
and its gradients' D2H). This chain is compared with the whole forward, the `forward` of bench_train's
mixed bound.

    python benchmarks/bench_gap.py                # B1 shape
    python benchmarks/bench_gap.py --layers 2 --hidden 256 --intermediate 512 --seq 256 --vocab 1024
"""
from __future__ import annotations

import argparse
import statistics
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

import _common
import offload_ext
from bench_train import build_real_model


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("layers", 16), ("hidden", 2048), ("intermediate", 8192), ("heads", 32), ("kv-heads", 8),
                          ("vocab", 128256), ("batch", 4), ("seq", 2048), ("steps", 10), ("warmup", 3)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--stem", default="gap_b1")
    return ap.parse_args()


def gpu_seconds(fn: Callable[[], object], steps: int, warmup: int) -> float:
    """Median time of fn on the GPU, measured with CUDA events around each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main() -> None:
    a = parse()
    model = build_real_model(a).cuda()
    offload_ext.enable_activation_checkpointing(model)
    model.train()
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq), generator=torch.Generator().manual_seed(0)).cuda()
    decoder, head, top = model.get_decoder(), model.get_output_embeddings(), model.get_decoder().layers[-1]
    hidden = torch.randn(a.batch, a.seq, a.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(a.seq, device="cuda").unsqueeze(0)
    rope = decoder.rotary_emb(hidden, positions)

    def layer_out() -> torch.Tensor:
        return checkpoint(top, hidden, position_embeddings=rope, position_ids=positions, use_reentrant=False)

    def backward(t: torch.Tensor) -> None:
        t.float().pow(2).mean().backward() if t.dim() else t.backward()
        model.zero_grad(set_to_none=True)
        hidden.grad = None

    steps, warmup = a.steps, a.warmup
    parts: dict[str, float] = {}
    # The loss through its native row kernels (what training uses) and through F.cross_entropy on fp32
    # logits (the fallback), side by side; the chain uses the native one.
    for backend in ("native", "torch"):
        def loss(backend: str = backend) -> torch.Tensor:
            return offload_ext.causal_lm_loss(model, tokens, kernel=backend)

        def head_loss(backend: str = backend) -> torch.Tensor:
            return offload_ext.lm_head_loss(head, hidden, tokens, kernel=backend)

        parts[f"forward (whole model, with the loss), {backend} loss"] = gpu_seconds(loss, steps, warmup)
        parts[f"step (forward + backward, GPU-resident, no optimizer), {backend} loss"] = gpu_seconds(
            lambda: backward(loss()), steps, warmup)
        parts[f"loss head forward, {backend}"] = gpu_seconds(head_loss, steps, warmup)
        parts[f"loss head forward + backward, {backend}"] = gpu_seconds(lambda: backward(head_loss()), steps, warmup)
    parts["top layer forward"] = gpu_seconds(layer_out, steps, warmup)
    parts["top layer forward + recompute + backward"] = gpu_seconds(lambda: backward(layer_out()), steps, warmup)
    layer_bytes = sum(p.numel() * p.element_size() for p in top.parameters())
    host = torch.empty(layer_bytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(layer_bytes, dtype=torch.uint8, device="cuda")
    parts["one layer's H2D"] = gpu_seconds(lambda: dev.copy_(host, non_blocking=True), steps, warmup)
    parts["one layer's D2H"] = gpu_seconds(lambda: host.copy_(dev, non_blocking=True), steps, warmup)
    chain = (parts["one layer's H2D"] + parts["top layer forward + recompute + backward"]
             + parts["loss head forward + backward, native"] + parts["one layer's D2H"])
    forward = parts["forward (whole model, with the loss), native loss"]
    lines = ["| part | ms |", "|---|---:|"] + [f"| {k} | {v * 1e3:.2f} |" for k, v in parts.items()]
    lines += ["", f"Chain the host idles through (H2D + top layer fwd/recompute/bwd + head fwd/bwd + D2H): "
                  f"{chain * 1e3:.2f} ms; whole forward: {forward * 1e3:.2f} ms; chain - forward: "
                  f"{(chain - forward) * 1e3:+.2f} ms"]
    markdown = "\n".join(lines)
    print(markdown)
    for path in _common.write_results(a.stem, {"args": vars(a), "parts_s": parts, "chain_s": chain,
                                               "forward_s": forward}, markdown):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
