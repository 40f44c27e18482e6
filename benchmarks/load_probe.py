"""Load probe: how much host memory and time loading a checkpoint takes. A child process loads it
(streamed into the engine, or by transformers and then offloaded), optionally runs one training step,
and reports its peak resident memory, its resident memory before the load, the engine's own state and
the times; and a writer of random safetensors checkpoints of any config to load.

    python benchmarks/load_probe.py DIR [--via engine|scratch|transformers] [--precision bf16|bf16-sr|mixed]
        [--device cpu|cuda] [--step BATCHxSEQ]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import torch

from offload_ext.planning.host_sizes import proc_bytes

_BLOCK = 1 << 22  # pre-drawn N(0, 1) values every tensor is tiled from: writing stays at disk speed


def write_random_checkpoint(config: Any, path: str, std: float = 0.02, seed: int = 0) -> int:
    """Save a causal LM of `config` with N(0, std) weights (ones for norms) as one safetensors file plus
    config.json, without building the model's real parameters; returns the bytes of weights written."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from offload_ext import parameters_on_meta
    from offload_ext.models.init_weights import tile_random
    from offload_ext.models.weights import dtype_keyword

    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, **{dtype_keyword(): torch.bfloat16})
    gen = torch.Generator().manual_seed(seed)
    block = torch.randn(_BLOCK, generator=gen).mul_(std).bfloat16()
    tensors = {}
    for name, p in model.named_parameters():  # tied parameters once, under their first name
        t = torch.empty(p.shape, dtype=torch.bfloat16)
        t.fill_(1.0) if p.dim() == 1 else tile_random(t.view(-1), block, gen)
        tensors[name] = t
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(path)
    return sum(t.nbytes for t in tensors.values())


def probe(path: str, via: str = "engine", precision: str = "bf16", device: str = "cpu",
          step: str | None = None) -> dict[str, Any]:
    """Load `path` in a fresh interpreter and return what it measured (see _child), with the child's
    whole wall time (interpreter start to exit) as `wall_s`."""
    cmd = [sys.executable, os.path.abspath(__file__), path, "--via", via, "--precision", precision,
           "--device", device, *(["--step", step] if step else [])]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"load_probe child failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "wall_s": time.perf_counter() - t0}


def _status_bytes(key: str) -> int:
    value = proc_bytes("/proc/self/status", key).get(key)
    if value is None:
        raise RuntimeError(f"/proc/self/status has no {key}")
    return value


def _child(path: str, via: str, precision: str, device: str, step: str | None) -> dict[str, Any]:
    import transformers  # before the baseline: every load path needs it

    from offload_ext import Offloader, enable_activation_checkpointing
    from offload_ext.models.weights import dtype_keyword

    t0 = time.perf_counter()
    baseline = _status_bytes("VmRSS")
    if via == "engine":
        off = Offloader.from_pretrained(path, precision=precision, device=device)
        model = off.model
    elif via == "scratch":  # the same model drawn by its init rule: what the load is measured against
        off = Offloader.from_config(transformers.AutoConfig.from_pretrained(path), precision=precision, device=device)
        model = off.model
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, **{dtype_keyword(): torch.bfloat16})
        off = Offloader(model, precision=precision, device=device)
    load_s = time.perf_counter() - t0
    out = {"via": via, "precision": precision, "device": device, "baseline_rss": baseline, "load_s": load_s}
    if step:
        batch, seq = (int(x) for x in step.split("x"))
        enable_activation_checkpointing(model)
        ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=off.device)
        off.backward(model(input_ids=ids, labels=ids).loss)
        off.step()
        if off.device.type == "cuda":
            torch.cuda.synchronize()
        out["first_step_s"] = time.perf_counter() - t0
        out["gpu_peak"] = torch.cuda.max_memory_allocated() if off.device.type == "cuda" else 0
    stats = off.stats()
    # On the simulated device the device parameters are host memory too.
    device_bytes = sum(p.numel() * p.element_size() for p in off.layout.device_params) if device == "cpu" else 0
    state = stats["pinned_reserved"] + stats["host_reserved"] + device_bytes
    return {**out, "peak_rss": _status_bytes("VmHWM"), "state_bytes": state,
            "pinned_reserved": stats["pinned_reserved"], "host_reserved": stats["host_reserved"],
            "device_bytes": device_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("path")
    ap.add_argument("--via", choices=("engine", "scratch", "transformers"), default="engine",
                    help="engine: streamed from the checkpoint; scratch: its config drawn fresh; transformers: "
                         "from_pretrained, then offloaded")
    ap.add_argument("--precision", choices=("bf16", "bf16-sr", "mixed"), default="bf16")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu: the simulated device")
    ap.add_argument("--step", default=None, help="BATCHxSEQ: run one training step of that shape after the load")
    a = ap.parse_args()
    print(json.dumps(_child(a.path, a.via, a.precision, a.device, a.step)))


if __name__ == "__main__":
    main()
