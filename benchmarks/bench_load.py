"""Loading a checkpoint: host memory and time, streamed into the engine (Offloader.from_pretrained)
against transformers' own load followed by offloading, each in a fresh interpreter (benchmarks/load_probe.py).

A random bf16 safetensors checkpoint of the preset's shape is written first (once; --dir keeps it).
Each row: the load's time, the first training step's end (with --step) and the child's whole wall time;
its peak resident memory, its resident memory before the load, the engine's own state (pinned and
pageable pools; on the simulated device the device parameters too) and the peak's growth over it.

    python benchmarks/bench_load.py --preset 0.4b --train-steps 2      # the CI test's shape, simulated device
    python benchmarks/bench_load.py --preset b2 --device cuda --step 1x4096
"""
from __future__ import annotations

import argparse
import os
import subprocess

import torch
from transformers import LlamaConfig

import _common
import load_probe

PRESETS = {  # hidden, layers, heads, kv heads, intermediate, vocab, tied
    "0.4b": (1024, 24, 16, 8, 4096, 32000, True),
    "b1": (2048, 16, 32, 8, 8192, 128256, True),
    "b2": (4096, 32, 32, 8, 14336, 128256, False),
}


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="0.4b")
    ap.add_argument("--dir", default=None, help="where the checkpoint is (written there when absent)")
    ap.add_argument("--vias", default="engine,scratch,transformers",
                    help="engine: streamed; scratch: the same config drawn fresh; transformers: loaded, then offloaded")
    ap.add_argument("--precisions", default="bf16")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--step", default=None, help="BATCHxSEQ: one training step after each load")
    ap.add_argument("--train-steps", type=int, default=0,
                    help="also run offload-train --pretrained and --from-scratch for this many steps on the checkpoint "
                         "(batch 1 x 128) under /usr/bin/time -v: each whole run's peak RSS")
    ap.add_argument("--stem", default=None)
    return ap.parse_args()


def config(preset: str) -> LlamaConfig:

    hidden, layers, heads, kv, inter, vocab, tied = PRESETS[preset]
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv, intermediate_size=inter, tie_word_embeddings=tied,
                       max_position_embeddings=8192, rope_theta=500000.0, use_cache=False)


def offload_train_peak(path: str, device: str, steps: int, mode: str = "--pretrained") -> dict[str, float]:
    """offload-train `mode` (--pretrained or --from-scratch) on the checkpoint (a small tokenizer trained into
    it first, once): the whole run's wall time and peak RSS as /usr/bin/time -v reports them."""
    from offload_ext.train import data

    data.train_tokenizer(data.stdlib_corpus(max_bytes=1 << 20), 1024, os.path.join(path, "tokenizer.json"))
    out = os.path.join(path, "offload_train_run" + mode.replace("-", "_"))
    cmd = ["/usr/bin/time", "-v", "offload-train", "--out", out, "--overwrite", "--model", path, mode, "--device",
           "cpu-sim" if device == "cpu" else device, "--backend", "native", "--steps", str(steps), "--batch-size", "1",
           "--seq-len", "128"]
    run = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OFFLOAD_TRAIN_NO_BAR": "1"},
                         check=False)
    if run.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({run.returncode}):\n{run.stderr[-3000:]}")
    fields = dict(line.strip().rsplit(": ", 1) for line in run.stderr.splitlines() if ": " in line)
    wall = fields["Elapsed (wall clock) time (h:mm:ss or m:ss)"].split(":")
    return {"peak_rss": int(fields["Maximum resident set size (kbytes)"]) * 1024,
            "wall_s": sum(float(x) * 60 ** k for k, x in enumerate(reversed(wall)))}


def main() -> None:
    a = parse()
    path = a.dir or f"/tmp/offload_ext_ckpt_{a.preset}"
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        size = load_probe.write_random_checkpoint(config(a.preset), path)
        print(f"wrote {size / 1e9:.2f} GB to {path}", flush=True)
    gb = 1e9
    rows = []
    md = [f"Preset {a.preset}, checkpoint {path}, device {a.device}" + (f", one step of {a.step}" if a.step else ""),
          "", "| load | precision | load s | first step s | wall s | peak RSS GB | baseline GB | state GB | "
          "(peak - baseline) / state |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for via in a.vias.split(","):
        for precision in a.precisions.split(","):
            r = load_probe.probe(path, via=via, precision=precision, device=a.device, step=a.step)
            growth = (r["peak_rss"] - r["baseline_rss"]) / r["state_bytes"]
            rows.append({**r, "growth": growth})
            first = f"{r['first_step_s']:.1f}" if "first_step_s" in r else "-"
            line = (f"| {via} | {precision} | {r['load_s']:.1f} | {first} | {r['wall_s']:.1f} | "
                    f"{r['peak_rss'] / gb:.2f} | {r['baseline_rss'] / gb:.2f} | {r['state_bytes'] / gb:.2f} | "
                    f"{growth:.2f}x |")
            print(line, flush=True)
            md.append(line)
    for mode in ("--pretrained", "--from-scratch") if a.train_steps else ():
        r = offload_train_peak(path, a.device, a.train_steps, mode)
        rows.append({"via": f"offload-train {mode}", **r})
        line = (f"| offload-train {mode}, {a.train_steps} steps | bf16 | - | - | {r['wall_s']:.1f} | "
                f"{r['peak_rss'] / gb:.2f} | - | - | - |")
        print(line, flush=True)
        md.append(line)
    for p in _common.write_results(a.stem or f"load_{a.preset}", {"preset": a.preset, "rows": rows}, "\n".join(md)):
        print("wrote", p)


if __name__ == "__main__":
    main()
