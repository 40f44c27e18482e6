"""A device fault during training ends in an error naming it within seconds, and close() returns.

Trains a few steps of a small Llama through the native Offloader on CUDA, then feeds a label outside the
vocabulary to the loss (a device-side assert in the cross-entropy kernel: the native one with --loss native,
torch's with --loss torch) and keeps training. After a device fault CUDA runs no host callback again, so the
engine's copies never land: every wait must notice the fault on the copy streams instead of hanging.

Prints one JSON line: the steps trained, the seconds from the fault to the error and the error's first line,
the seconds close() took. Exits 1 when no error came within --bound seconds, when the error does not name the
device fault, or when close() raised or took longer than the bound.

    python scripts/gpu_fault_check.py [--loss torch|native] [--steps 3] [--bound 10]

--simulate runs the same check on the simulated device (device="cpu"), the fault injected by
offload_ext.testing.fault_next_copy: the harness itself, on a machine without a GPU.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import warnings

import torch
from torch import nn

import offload_ext
from offload_ext import testing

VOCAB = 512
DEVICE_ERROR_WORDS = ("device-side assert", "cudaErrorAssert", "device reported", "CUDA error",
                      "simulated device faulted")


def small_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128)
    return LlamaForCausalLM(cfg)


def loss_of(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor, how: str) -> torch.Tensor:
    if how == "native":
        return offload_ext.causal_lm_loss(model, ids, labels, kernel="native")
    return model(input_ids=ids, labels=labels).loss  # F.cross_entropy: torch's kernel asserts on the label


def train_step(off: offload_ext.Offloader, model: nn.Module, ids: torch.Tensor, labels: torch.Tensor,
               how: str) -> None:
    off.backward(loss_of(model, ids, labels, how))
    off.step()
    off.zero_grad()


def run_bounded(fn, bound: float) -> tuple[BaseException | None, float, bool]:
    """fn() on a daemon thread: (its exception, seconds taken, whether it ended within `bound`)."""
    box: list[BaseException | None] = [None]

    def target() -> None:
        try:
            fn()
        except BaseException as e:  # the error under test, whatever its type
            box[0] = e

    t0 = time.monotonic()
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(bound)
    return box[0], time.monotonic() - t0, not thread.is_alive()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loss", choices=("torch", "native"), default="torch")
    parser.add_argument("--steps", type=int, default=3, help="steps trained before the fault")
    parser.add_argument("--bound", type=float, default=10.0, help="seconds allowed for the error and for close()")
    parser.add_argument("--simulate", action="store_true", help="the simulated device and an injected copy fault")
    args = parser.parse_args()
    device = "cpu" if args.simulate else "cuda"
    if not args.simulate and not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": "no CUDA device visible (--simulate runs without one)"}))
        return 1

    model = small_llama()
    off = offload_ext.Offloader(model, lr=3e-3, backend="native", device=device)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (4, 64), generator=gen).to(device)
    for _ in range(args.steps):
        train_step(off, model, ids, ids, args.loss)
    if not args.simulate:
        torch.cuda.synchronize()

    bad = ids.clone()
    if args.simulate:
        testing.fault_next_copy(off)
    else:
        bad[0, 5] = VOCAB + 7  # out of range: the loss kernel's device-side assert

    def train_on_after_fault() -> None:
        train_step(off, model, ids, bad, args.loss)
        for _ in range(3):  # the fault is asynchronous: it may surface a step later
            train_step(off, model, ids, ids, args.loss)
        if not args.simulate:
            torch.cuda.synchronize()

    error, error_s, ended = run_bounded(train_on_after_fault, args.bound)
    message = str(error).strip().splitlines()[0] if error is not None else ""
    named = any(w in str(error) for w in DEVICE_ERROR_WORDS)

    def close() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # close() warns that training had failed: expected here
            off.close()

    close_error, close_s, closed = run_bounded(close, args.bound)
    ok = ended and error is not None and named and closed and close_error is None
    print(json.dumps({"ok": ok, "device": device, "loss": args.loss, "steps_before_fault": args.steps,
                      "error_within_bound": ended, "error_s": round(error_s, 3),
                      "error_type": type(error).__name__ if error is not None else None, "error": message,
                      "error_names_device_fault": named, "close_returned": closed, "close_s": round(close_s, 3),
                      "close_error": str(close_error) if close_error is not None else None,
                      "bound_s": args.bound}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
