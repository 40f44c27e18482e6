"""offload-train: train a causal LM with CPU offload (or without, for comparison) on one device.

With no arguments it runs an embedded default that needs no download: a small Llama config (tiny on a
CPU), the Python standard library's own sources as text, and a BPE tokenizer trained on them in seconds.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from typing import Any, Callable

import numpy as np
import torch

from . import data as data_mod
from .losses import BACKENDS, causal_lm_loss, resolve_loss_backend

BUILTIN = {
    # name: (hidden, layers, heads, kv heads, intermediate, tied, tokenizer vocab, model vocab or None)
    "tiny": (64, 4, 4, 2, 176, True, 1024, None),
    "small": (512, 8, 8, 4, 1408, True, 4096, None),
    # Llama-3.2-1B's shape, its 128256-entry embedding included (the embedded tokenizer uses 8192 of them).
    "llama-1b": (2048, 16, 32, 8, 8192, True, 8192, 128256),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="offload-train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="auto",
                    help=f"built-in config ({', '.join(BUILTIN)}; auto = small on a GPU, tiny on a CPU), "
                         "a local directory, or a hub id")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--from-scratch", dest="pretrained", action="store_false",
                   help="random init from the model's config (default for built-in configs)")
    g.add_argument("--pretrained", dest="pretrained", action="store_true", help="load the model's weights")
    ap.set_defaults(pretrained=None)
    ap.add_argument("--dataset", default=data_mod.EMBEDDED,
                    help="'stdlib' (embedded), a datasets hub id, a local dataset directory or a data file")
    ap.add_argument("--text-field", default="text")
    ap.add_argument("--split", default="train")
    ap.add_argument("--streaming", action="store_true")
    ap.add_argument("--tokenizer", default=None, help="HF tokenizer (hub id or directory); default: the model's, "
                                                      "or one trained on the embedded corpus")
    ap.add_argument("--batch-size", type=int, default=None, help="default 8 on a GPU, 4 on a CPU")
    ap.add_argument("--seq-len", type=int, default=None, help="default 512 on a GPU, 64 on a CPU")
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--steps", type=int, default=None, help="default 200 on a GPU, 60 on a CPU")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup-steps", type=int, default=None, help="linear warm-up, then cosine decay to 10%%")
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--max-grad-norm", type=float, default=None,
                    help="clip by the global gradient norm (with offload, the host steps then wait for backward)")
    ap.add_argument("--backend", choices=["none", "python", "native"], default="native",
                    help="none = no offload (the model and optimizer on the device)")
    ap.add_argument("--precision", choices=["bf16", "mixed"], default="bf16")
    ap.add_argument("--offload-all", action="store_true",
                    help="also keep the embeddings, final norm and head's grads and optimizer state on the host")
    ap.add_argument("--device", default="auto", help="cuda, cuda:N, cpu, or cpu-sim (offload engine on the "
                                                     "simulated device); auto = cuda if available, else cpu")
    ap.add_argument("--no-activation-checkpointing", dest="checkpointing", action="store_false")
    ap.add_argument("--compile", action="store_true", help="torch.compile each layer")
    ap.add_argument("--loss-backend", choices=BACKENDS, default="auto",
                    help="cross-entropy of the loss: the extension's kernels (native), torch's, or auto "
                         "(native on CUDA)")
    ap.add_argument("--loss-chunk-tokens", type=int, default=4096,
                    help="tokens per chunk of the vocabulary projection (GPU memory for logits vs speed)")
    ap.add_argument("--out", default="runs/offload-train")
    ap.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    ap.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (always at the end)")
    ap.add_argument("--stop-after", type=int, default=None,
                    help="stop (with a checkpoint) after this many steps of this invocation; the lr schedule "
                         "still spans --steps, and --resume continues (for preemptible jobs)")
    ap.add_argument("--log-every", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace", action="store_true", help="write a torch.profiler trace of steps 3-5 to --out")
    return ap.parse_args(argv)


class UsageError(Exception):
    """Bad input: printed without a traceback, with the fix."""


# ---------------------------------------------------------------------------------------------- setup

def resolve_device(args: argparse.Namespace) -> tuple[torch.device, bool]:
    """(device, simulated)."""
    if args.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu"), False
    if args.device == "cpu-sim":
        return torch.device("cpu"), True
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {args.device}: CUDA is not available here; use --device cpu or cpu-sim")
    return dev, False


def apply_defaults(args: argparse.Namespace, on_gpu: bool) -> None:
    if args.model == "auto":
        args.model = "small" if on_gpu else "tiny"
    for name, gpu, cpu in (("batch_size", 8, 4), ("seq_len", 512, 64), ("steps", 200, 60)):
        if getattr(args, name) is None:
            setattr(args, name, gpu if on_gpu else cpu)
    if args.warmup_steps is None:
        args.warmup_steps = max(1, args.steps // 20)


def build_tokenizer(args: argparse.Namespace, texts: list[str] | None):
    """(encode, eos_id, vocab_size, tokenizer to save with checkpoints)."""
    name = args.tokenizer or (args.model if args.model not in BUILTIN and args.pretrained else None)
    if name:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(name)
        eos = tok.eos_token_id if tok.eos_token_id is not None else 0
        return (lambda t: tok(t, add_special_tokens=False)["input_ids"]), eos, len(tok), tok
    if texts is None:
        raise UsageError("--dataset other than 'stdlib' needs --tokenizer (or a pretrained --model to take it from)")
    vocab = BUILTIN.get(args.model, BUILTIN["small"])[6]
    tok = data_mod.train_tokenizer(texts, vocab, os.path.join(args.out, "tokenizer.json"))
    return (lambda t: tok.encode(t).ids), tok.token_to_id("<|endoftext|>"), tok.get_vocab_size(), tok


def bf16_llama(cfg: Any) -> torch.nn.Module:
    """A random-init LlamaForCausalLM whose parameters are born bf16, the dtype it trains in: no fp32
    copy of the model is ever made."""
    from transformers import LlamaForCausalLM

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)


def build_model(args: argparse.Namespace, vocab_size: int) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(args.seed)
    if args.model in BUILTIN:
        if args.pretrained:
            raise UsageError(f"--pretrained: built-in config {args.model!r} has no weights; use --from-scratch")
        hidden, layers, heads, kv, inter, tied, _, model_vocab = BUILTIN[args.model]
        cfg = LlamaConfig(vocab_size=max(vocab_size, model_vocab or 0), hidden_size=hidden, num_hidden_layers=layers,
                          num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=inter,
                          tie_word_embeddings=tied, max_position_embeddings=max(2048, args.seq_len),
                          rope_theta=500000.0, use_cache=False)
        return bf16_llama(cfg)
    try:
        cfg = AutoConfig.from_pretrained(args.model)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--model {args.model!r} is not a built-in config ({', '.join(BUILTIN)}), a local model "
                         f"directory, or a reachable hub id ({type(exc).__name__}: {str(exc).splitlines()[0]})") from exc
    if args.pretrained:
        model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
        if model.config.vocab_size < vocab_size:
            raise UsageError(f"the tokenizer has {vocab_size} tokens but {args.model} only {model.config.vocab_size}; "
                             "use the model's own tokenizer (--tokenizer)")
        return model
    cfg.vocab_size = max(cfg.vocab_size, vocab_size)  # from scratch: make room for the tokenizer's ids
    return AutoModelForCausalLM.from_config(cfg)


def build_stream(args: argparse.Namespace) -> tuple[data_mod.TokenStream, Any, int]:
    texts = None
    if args.dataset == data_mod.EMBEDDED:
        texts = data_mod.stdlib_corpus(max_bytes=(8 << 20) if args.model != "tiny" else (2 << 20))
    encode, eos, vocab, tok = build_tokenizer(args, texts)
    if texts is not None:
        cache = os.path.join(args.out, f"corpus_{vocab}.npy")
        if os.path.exists(cache):
            tokens = np.load(cache)
        else:
            tokens = np.concatenate([np.asarray(encode(t) + [eos], dtype=np.int32) for t in texts])
            np.save(cache, tokens)
        return data_mod.TokenStream(args.batch_size, args.seq_len, args.seed, tokens=tokens), tok, vocab
    data_mod.load_texts(args.dataset, args.split, args.text_field, args.streaming)  # validates the field now
    docs = lambda: data_mod.load_texts(args.dataset, args.split, args.text_field, args.streaming)  # noqa: E731
    return data_mod.TokenStream(args.batch_size, args.seq_len, args.seed, documents=docs, encode=encode,
                                eos_id=eos), tok, vocab


def lr_at(args: argparse.Namespace, step: int) -> float:
    """Linear warm-up to --lr, then cosine decay to 10 % of it at --steps."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


# --------------------------------------------------------------------------------------------- trainer

class Trainer:
    """One training run: the offloaded path (Offloader) or the plain one (device optimizer)."""

    def __init__(self, args: argparse.Namespace, model: torch.nn.Module, device: torch.device, simulated: bool):
        self.args, self.model, self.device = args, model, device
        self.off = None
        self.opt = None
        self.last_grad_norm: float | None = None
        if args.backend != "none":
            self._check_offload_supported()
            from .offloader import Offloader

            self.off = Offloader(model, lr=args.lr, weight_decay=args.weight_decay, precision=args.precision,
                                 backend=args.backend, device=device, compile_layers=args.compile,
                                 offload_all=args.offload_all, grad_accum=args.grad_accum,
                                 max_grad_norm=args.max_grad_norm)
        else:
            self._plain_setup(simulated)

    def _check_offload_supported(self) -> None:
        a = self.args
        if a.device == "cpu":
            raise UsageError("--device cpu trains without offload (--backend none); use --device cpu-sim to run the "
                             "offload engine on the simulated device")
        if not a.checkpointing:
            raise UsageError("--no-activation-checkpointing: the offload engine needs activation checkpointing "
                             "(saved activations would point at refilled layer buffers); use --backend none")

    def _plain_setup(self, simulated: bool) -> None:
        a, model = self.args, self.model
        if simulated:
            raise UsageError("--device cpu-sim runs the offload engine: pick --backend native or python")
        if a.offload_all:
            raise UsageError("--offload-all needs an offload backend (--backend native or python)")
        for p in model.parameters():
            p.data = p.data.to(self.device, torch.bfloat16)
        model.to(self.device)
        if a.checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if a.compile:
            for layer in model.model.layers:
                layer.compile()
        params = [p for p in model.parameters() if p.requires_grad]
        if self.device.type == "cuda" and a.precision == "mixed":
            raise UsageError("--precision mixed needs an offload backend on a GPU (fp32 masters live on the host); "
                             "use --backend native, or --precision bf16 with --backend none")
        if self.device.type == "cuda":
            self.opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=a.weight_decay, fused=True)
        else:
            from .optim import CPUAdamW

            print("offload-train: no CUDA device: training on the CPU without offload, with CPUAdamW", flush=True)
            self.opt = CPUAdamW(params, lr=a.lr, weight_decay=a.weight_decay, master_weights=a.precision == "mixed")

    def _micro_batches(self, stream: data_mod.TokenStream, backward: Callable[[torch.Tensor], None]) -> float:
        """Forward and `backward` over --grad-accum micro-batches, each loss scaled by 1/N; their summed loss."""
        a = self.args
        total = 0.0
        for _ in range(a.grad_accum):
            batch = stream.next_batch().to(self.device)
            loss = causal_lm_loss(self.model, batch, chunk_tokens=a.loss_chunk_tokens, backend=a.loss_backend)
            loss = loss / a.grad_accum
            backward(loss)
            total += loss.item()
        return total

    def train_step(self, stream: data_mod.TokenStream, lr: float) -> float:
        a = self.args
        if self.off is not None:
            self.off.lr = lr
            total = self._micro_batches(stream, self.off.backward)
            self.off.step()
            self.off.zero_grad()
            self.last_grad_norm = self.off.last_grad_norm
            return total
        for group in self.opt.param_groups:
            group["lr"] = lr
        total = self._micro_batches(stream, torch.Tensor.backward)
        if a.max_grad_norm is not None:
            self.last_grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), a.max_grad_norm))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return total

    # ------------------------------------------------------------------ checkpoints

    def weights(self) -> dict[str, torch.Tensor]:
        if self.off is not None:
            return self.off.model_state_dict()
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}

    def save(self, step: int, stream: data_mod.TokenStream, tokenizer: Any) -> None:
        ckpt = os.path.join(self.args.out, "checkpoint")
        os.makedirs(ckpt, exist_ok=True)
        weights = self.weights()
        # save_pretrained consumes the dict it is given; the trainer state keeps its own.
        self.model.save_pretrained(ckpt, state_dict=dict(weights), safe_serialization=True)
        if hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(ckpt)
        else:
            tokenizer.save(os.path.join(ckpt, "tokenizer.json"))
        state = {
            "step": step,
            "data": stream.state(),
            "engine": self.off.state_dict() if self.off is not None else None,
            "optimizer": self.opt.state_dict() if self.opt is not None else None,
            "model": weights if self.off is None else None,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
            "args": vars(self.args),
        }
        tmp = os.path.join(ckpt, "trainer_state.pt.tmp")
        torch.save(state, tmp)
        os.replace(tmp, os.path.join(ckpt, "trainer_state.pt"))  # a crash mid-save keeps the old state

    def load(self, stream: data_mod.TokenStream) -> int:
        path = os.path.join(self.args.out, "checkpoint", "trainer_state.pt")
        if not os.path.exists(path):
            raise UsageError(f"--resume: no checkpoint at {path}; run without --resume first")
        state = torch.load(path, weights_only=False)
        for key in ("backend", "precision", "model", "batch_size", "seq_len"):
            if state["args"][key] != getattr(self.args, key):
                raise UsageError(f"--resume: the checkpoint was made with --{key.replace('_', '-')} "
                                 f"{state['args'][key]}, this run has {getattr(self.args, key)}")
        if self.off is not None:
            self.off.load_state_dict(state["engine"])
        else:
            self.model.load_state_dict({k: v.to(self.device) for k, v in state["model"].items()}, strict=False)
            self.opt.load_state_dict(state["optimizer"])
        stream.restore(state["data"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        if state["rng"]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        return int(state["step"])


# ------------------------------------------------------------------------------------------------ main

def check_loss_args(args: argparse.Namespace, device: torch.device) -> None:
    if args.loss_chunk_tokens < 1:
        raise UsageError(f"--loss-chunk-tokens must be at least 1, got {args.loss_chunk_tokens}")
    try:
        resolve_loss_backend(args.loss_backend, device)
    except RuntimeError as exc:
        raise UsageError(f"--loss-backend {args.loss_backend}: {exc}") from exc


def run(args: argparse.Namespace) -> dict[str, Any]:
    device, simulated = resolve_device(args)
    on_gpu = device.type == "cuda"
    if args.device == "auto" and not on_gpu and args.backend != "none":
        print("offload-train: no CUDA device: training on the CPU without offload (--backend none)", flush=True)
        args.backend = "none"
    apply_defaults(args, on_gpu)
    check_loss_args(args, device)
    if args.backend == "native":
        from . import _ext

        if not _ext.available():
            raise UsageError(f"--backend native: the native extension is not available ({_ext.error()}); "
                             "reinstall with `pip install --no-build-isolation .`, or use --backend python")
    os.makedirs(args.out, exist_ok=True)
    random.seed(args.seed)
    np.random.seed(args.seed)
    try:
        stream, tokenizer, vocab = build_stream(args)
    except ValueError as exc:  # bad data arguments: the message names the flag and the fix
        raise UsageError(str(exc)) from exc
    model = build_model(args, vocab)
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if max_pos is not None and args.seq_len > max_pos:
        raise UsageError(f"--seq-len {args.seq_len} is above the model's maximum of {max_pos} positions")
    trainer = Trainer(args, model, device, simulated)
    start = trainer.load(stream) if args.resume else 0
    metrics_path = os.path.join(args.out, "metrics.jsonl")
    if not args.resume and os.path.exists(metrics_path):
        os.remove(metrics_path)
    tokens_per_step = args.batch_size * args.seq_len * args.grad_accum
    summary = _loop(args, trainer, stream, tokenizer, start, metrics_path, tokens_per_step, on_gpu)
    return summary


def _loop(args, trainer, stream, tokenizer, start, metrics_path, tokens_per_step, on_gpu) -> dict[str, Any]:
    from tqdm import tqdm

    profiler = _profiler(args) if args.trace else None
    losses, rates = [], []
    end = args.steps if args.stop_after is None else min(args.steps, start + args.stop_after)
    bar = tqdm(range(start, end), initial=start, total=args.steps, desc="offload-train",
               disable=os.environ.get("OFFLOAD_TRAIN_NO_BAR") == "1")
    with open(metrics_path, "a") as metrics:
        for step in bar:
            lr = lr_at(args, step)
            t0 = time.perf_counter()
            loss = trainer.train_step(stream, lr)
            if on_gpu:
                torch.cuda.synchronize()
            rate = tokens_per_step / (time.perf_counter() - t0)
            mem = torch.cuda.max_memory_allocated() / 1e9 if on_gpu else 0.0
            losses.append(loss)
            rates.append(rate)
            if profiler is not None:
                profiler.step()
            if (step + 1) % args.log_every == 0:
                row = {"step": step + 1, "loss": loss, "lr": lr, "tokens_per_s": rate, "gpu_mem_gb": mem}
                if trainer.last_grad_norm is not None:
                    row["grad_norm"] = trainer.last_grad_norm
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{rate:,.0f}", mem_gb=f"{mem:.1f}")
            if args.save_every and (step + 1) % args.save_every == 0:
                trainer.save(step + 1, stream, tokenizer)
    if profiler is not None:
        profiler.stop()
    trainer.save(end, stream, tokenizer)
    steady = rates[min(3, len(rates) - 1):] if rates else [0.0]
    summary = {"steps": end, "first_loss": losses[0] if losses else None,
               "final_loss": losses[-1] if losses else None, "tokens_per_s": float(np.median(steady)),
               "gpu_peak_gb": torch.cuda.max_memory_allocated() / 1e9 if on_gpu else 0.0, "out": args.out}
    print(f"offload-train: done {summary['steps']} steps, loss {summary['first_loss']} -> {summary['final_loss']}, "
          f"{summary['tokens_per_s']:,.0f} tok/s (median), GPU peak {summary['gpu_peak_gb']:.2f} GB, "
          f"checkpoint in {os.path.join(args.out, 'checkpoint')}", flush=True)
    return summary


def _profiler(args: argparse.Namespace):
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    trace = os.path.join(args.out, "trace.json")
    p = profile(activities=activities, schedule=schedule(wait=2, warmup=1, active=3, repeat=1),
                on_trace_ready=lambda prof: prof.export_chrome_trace(trace))
    p.start()
    return p


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        run(args)
    except UsageError as exc:
        print(f"offload-train: error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
