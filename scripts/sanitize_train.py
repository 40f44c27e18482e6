"""A few native-backend Offloader steps of a tiny Llama, small enough to run under compute-sanitizer."""
from __future__ import annotations

import argparse
import math

import torch
from torch import nn

import offload_ext

# name: (precision, grad_accum, max_grad_norm); 0.01 is far below a random init's gradient norm, so it clips.
CONFIGS: dict[str, tuple[str, int, float | None]] = {
    "bf16-clip-accum": ("bf16", 2, 0.01),
    "mixed-clip-accum": ("mixed", 2, 0.01),
    "bf16-plain": ("bf16", 1, None),
}
VOCAB, BATCH, SEQ = 256, 2, 32


def tiny_llama() -> nn.Module:
    """4 layers of hidden 64 (the Offloader's 2 device buffers are refilled), random init on the CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    cfg._attn_implementation = "eager"  # plain matmul + softmax: fewer large library kernels to instrument
    return LlamaForCausalLM(cfg)


def train(name: str, device: str, steps: int) -> list[float]:
    """`steps` optimizer steps of config `name`; the loss of every micro-batch."""
    precision, grad_accum, max_grad_norm = CONFIGS[name]
    model = tiny_llama()
    gen = torch.Generator().manual_seed(1)
    data = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(steps * grad_accum)]
    off = offload_ext.Offloader(model, lr=1e-3, precision=precision, backend="native", device=device,
                                grad_accum=grad_accum, max_grad_norm=max_grad_norm)
    losses: list[torch.Tensor] = []
    try:
        for k, x in enumerate(data):
            loss = offload_ext.causal_lm_loss(model, x.to(device))
            off.backward(loss)
            losses.append(loss.detach())  # read at the end: no sync per micro-batch
            if k % grad_accum == grad_accum - 1:
                off.step()
                off.zero_grad()
    finally:
        off.close()
    return torch.stack(losses).float().cpu().tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("configs", nargs="*", metavar="CONFIG", help=f"which to run (default all): {', '.join(CONFIGS)}")
    ap.add_argument("--device", default="cuda", help='"cuda", "cuda:N" or "cpu" (the simulated device)')
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per config")
    args = ap.parse_args()
    unknown = [name for name in args.configs if name not in CONFIGS]
    if unknown:
        ap.error(f"unknown config {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    bad = []
    for name in args.configs or list(CONFIGS):
        losses = train(name, args.device, args.steps)
        print(f"{name}: losses {' '.join(f'{v:.4f}' for v in losses)}", flush=True)
        if not all(math.isfinite(v) for v in losses):
            bad.append(name)
    if bad:
        raise SystemExit(f"sanitize_train: non-finite loss in {', '.join(bad)}")


if __name__ == "__main__":
    main()
