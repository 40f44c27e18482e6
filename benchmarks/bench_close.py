"""Host memory around Offloader.close(): RSS after one step, then after close() puts the model back on the CPU.

close() gives the optimizer state and gradient buffers back before copying the weights out; before that
change the copy came on top of the whole engine (qwen-14b: 84 GB through training, 113 GB at close(), run 66).
Runs on the simulated device, one process per precision.

    python benchmarks/bench_close.py --precision mixed
"""
from __future__ import annotations

import argparse
import gc

import torch
from transformers import LlamaConfig

import offload_ext
from offload_ext.planning.memory import process_rss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precision", default="bf16", choices=["bf16", "mixed", "bf16-sr"])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=1024)
    a = ap.parse_args()
    cfg = LlamaConfig(hidden_size=a.hidden, intermediate_size=4 * a.hidden, num_hidden_layers=a.layers,
                      num_attention_heads=16, num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=False)
    off = offload_ext.Offloader.from_config(cfg, device="cpu", precision=a.precision)
    model = off.model
    x = torch.randint(0, cfg.vocab_size, (1, 32))
    off.backward(model(input_ids=x, labels=x).loss)
    off.step()
    gc.collect()
    before = process_rss()
    off.close()
    after = process_rss()
    params = sum(p.numel() for p in model.parameters())
    print(f"bench_close: {a.precision}, {params / 1e9:.2f} B params: RSS {before / 1e9:.2f} GB after a step, "
          f"{after / 1e9:.2f} GB after close()")


if __name__ == "__main__":
    main()
