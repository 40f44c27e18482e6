"""B1: training step time side by side — GPU-resident, python backend, native backend, DeepSpeed — in bf16 and mixed.

Random-init Llama from a config (no download; Llama-3.2-1B shape by default), bf16 compute, activation
checkpointing, batch 4 x 2048. Median step time over --steps after --warmup, tok/s, ratios to
GPU-resident, GPU peak memory, set-up time (and its parts), forward time, and the time the Python thread
waited on the host AdamW (native: in step(), forward hooks and gradient-slot reuse). Also times the
mixed AdamW kernel over the same 973 M parameters in the same run. The loss is
offload_ext.causal_lm_loss (chunked vocabulary projection; the native cross-entropy kernels when built) in every mode.

A mode is resident[-lean][-recipe] or backend-precision[-tN][-nN][-gN][-dN][-rN][-drN][-whole][-sync][-recipe]
(precision bf16, bf16sr for "bf16-sr", 8bit and 8bitsr for "bf16-8bit" and "bf16-8bit-sr", or mixed: e.g.
native-bf16sr-clip): auto for the layout that offload-train's
--resident-layers auto --device-layers auto chooses for the run's micro-batch on this GPU (or its cap; with rN, the
buffers only), tN engine threads, nN their niceness
(host_nice), gN gradient slots, dN device_layers, rN resident_layers (the lowest N layers kept and stepped on
the GPU), drN device_redo_layers (clipped redos of the top N layers on the GPU; default a third), whole for
host steps not sliced (one unit at a time, as before slicing), sync for async_step=False (e.g.
native-mixed-g6-sync), nospec for
speculative_clip=False, aoff for activation_offload=True, lazy for eager_uploads=False, onepass for
params_first=False (a host step after the clipping norm in one pass, not params then moments), hostsum for
accumulate_on_device=False
(micro-batches summed on the host; by default on the GPU when the sums fit). resident-lean checkpoints each
layer with the engine's own checkpoint (offload_ext.engine.recompute: torch's non-reentrant rule with less
bookkeeping) instead of HF's default (torch's checkpoint), to show what that alone is worth; offloaded modes
always use it, and their ratios are to the resident mode without the suffix. The recipe suffixes, on
offloaded and resident modes alike: clip (max_grad_norm=1e6, configured but never triggering), clipall
(max_grad_norm=1e-3, triggering every step), clipreal (max_grad_norm=1.0, the usual setting: with --data embedded it
clips where a pretraining run's first steps on real text do, and the row reports the fraction clipped), accumN (N
micro-batches of batch/N rows, the same tokens
per step), loraN (peft LoRA of rank N, alpha 2N, on every projection of each layer: the base frozen,
the adapters trained; with baseint8 / basefp8 / basenf4 the base held in that format: offloaded through
base_dtype, resident as benchmarks/_qlora.py says, NF4 being bitsandbytes' QLoRA),
ckptnone / ckptN / ckptauto (activation_checkpointing "none", N, "auto": layers
kept without recompute; resident modes take ckptnone only, and ckptN / ckptauto are compared with the
resident mode of full checkpointing). Each offloaded mode's ratio is to the resident mode of the same
recipe when the run has one.
The host busy column is the engine's stepping time per step; step minus busy is the time the host had
nothing to step.

deepspeed-precision[-tuned][-recipe] (e.g. deepspeed-bf16, deepspeed-bf16-tuned-clipall, deepspeed-mixed-accum2) is
DeepSpeed ZeRO-3 with parameters and optimizer offloaded to pinned host memory and DeepSpeedCPUAdam (tuned: its
buckets and prefetch sized to the model's layers, overlap_comm; see _deepspeed.zero_config), deepspeed2-... the same
with ZeRO-2, where only the optimizer is offloaded (the weights must fit on the GPU); zenflow (ZeRO-2, e.g.
deepspeed2-mixed-zenflow-clipreal) and superoffload (ZeRO-3, the weights on the GPU) take DeepSpeed's newer offload
engines with their tutorials' settings (ZenFlow steps most gradients every 4th step: not AdamW's rule; its
optimizer takes no bf16 master weights, so it runs in mixed only), one
process on one GPU, under the same GPU cap, loss, checkpointing and AdamW settings (benchmarks/_deepspeed.py;
bf16: bf16 masters and moments as native-bf16, mixed: DeepSpeed's stock fp32 masters as native-mixed).
Below the table, each DeepSpeed mode's step time over the native mode of the same precision and recipe.
A DeepSpeed mode that cannot run (not installed, initialize failed) shows the error in its row.

torchao-bf16[-recipe] keeps the model on the GPU (checkpointed as resident-lean) and steps it with torchao's
CPUOffloadOptimizer over torch's fused AdamW (gradients stay on the GPU until its step): the peer where the weights
fit. Without torchao its row shows the ImportError.

    python benchmarks/bench_train.py                       # B1
    python benchmarks/bench_train.py --compile             # per-layer torch.compile
    python benchmarks/bench_train.py --modes resident-clipall,native-bf16-clipall,resident-accum2,native-bf16-accum2
    python benchmarks/bench_train.py --interleave 3 --modes resident-accum2,native-bf16-d16-r8-accum2  # in turns
    python benchmarks/bench_train.py --preset b2 --gpu-cap-gb 24 --modes resident,native-bf16   # B2, capped
    python benchmarks/bench_train.py --modes resident,native-bf16,deepspeed-bf16,native-mixed,deepspeed-mixed
    python benchmarks/bench_train.py --layers 2 --hidden 256 --intermediate 512 --seq 256  # smoke run
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import hashlib
import os
import re
import statistics
import time
import traceback
from typing import Any

import torch

import _common
import _deepspeed
import _qlora
import offload_ext
from offload_ext import testing
from offload_ext.engine.layers import wrap_layer
from offload_ext.engine.timeline import GPU_CATEGORIES, RUNTIME_CATEGORIES, Timeline, span
from offload_ext.models.init_weights import tile_random
from offload_ext.models.lora import add_lora
from offload_ext.models.quantized_base import BASE_DTYPES
from offload_ext.models.stacks import find_layer_stacks
from offload_ext.models.weight_source import filled_on, materialize
from offload_ext.planning.auto_layout import choose_layout
from offload_ext.planning.choices import Settings
from offload_ext.planning.plan import machine as plan_machine
from offload_ext.train.machine import allocator_for_kept_layers

MODES = ["resident", "python-bf16", "native-bf16", "native-bf16-sync", "python-mixed", "native-mixed",
         "native-mixed-g6", "native-mixed-sync", "native-mixed-d16"]


# Model and batch shapes: B1 = Llama-3.2-1B (tied embeddings), B2 = Llama-3.1-8B (untied).
PRESETS = {
    "b1": dict(layers=16, hidden=2048, intermediate=8192, heads=32, kv_heads=8, vocab=128256, batch=4, seq=2048,
               untied=False),
    "b2": dict(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256, batch=2, seq=4096,
               untied=True),
    # B2 at a long context: one sequence of 32768 tokens (issue 13's, where kept activations leave the GPU)
    "b2-32k": dict(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256, batch=1,
                   seq=32768, untied=True),
    # Qwen2.5-14B's shape: a Qwen2 model (biased q/k/v projections), rope theta 1e6
    "qwen-14b": dict(layers=48, hidden=5120, intermediate=13824, heads=40, kv_heads=8, vocab=152064, batch=1,
                     seq=4096, untied=True, arch="qwen2"),
    # Mistral-Small-24B's shape (heads 128 wide) and Llama-3.1-70B's, as offload-train builds them
    "mistral-24b": dict(layers=40, hidden=5120, intermediate=32768, heads=32, kv_heads=8, vocab=131072, batch=1,
                        seq=4096, untied=True, head_dim=128),
    "llama-70b": dict(layers=80, hidden=8192, intermediate=28672, heads=64, kv_heads=8, vocab=128256, batch=1,
                      seq=4096, untied=True),
}
CLIP_NORMS = {"clip": 1e6, "clipall": 1e-3, "clipreal": 1.0}
# the mode suffixes without a number
PEERS = ("deepspeed", "deepspeed2", "torchao")  # the other offloading libraries' modes
# DeepSpeed's newer offload engines (_deepspeed.Zero.variant), by the backend (ZeRO stage) each runs on
DS_VARIANTS = {"zenflow": "deepspeed2", "superoffload": "deepspeed"}
# why neither newer engine takes bf16 master weights (ZenFlow: DeepSpeed asserts it in initialize; SuperOffload: its
# host worker sets an fp32 gradient on each bf16 master, which torch refuses in the first step)
DS_BF16_REFUSAL = {"zenflow": "ZenFlow's optimizer takes no bf16 master weights (DeepSpeed allows them with "
                              "DeepSpeedCPUAdam only)",
                   "superoffload": "SuperOffload's host worker steps fp32 gradients on fp32 masters only"}
FLAG_OPTIONS = ("whole", "sync", "nospec", "aoff", "hostsum", "lazy", "onepass", "lean", "tuned", "auto", *DS_VARIANTS)
NUMBERED_OPTIONS = ("t", "n", "g", "d", "r", "dr")  # and the prefixes of those with one (Mode.option)
# a mode name's precision part holds no "-"
PRECISION_NAMES = {"bf16sr": "bf16-sr", "8bit": "bf16-8bit", "8bitsr": "bf16-8bit-sr"}
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# AdamW settings of every mode, the Offloader's defaults (torch's AdamW would decay weights by 0.01)
BETAS, EPS, WEIGHT_DECAY = (0.9, 0.999), 1e-8, 0.0


@dataclasses.dataclass(frozen=True)
class Mode:
    name: str
    backend: str                   # "resident", "python", "native", "deepspeed", "deepspeed2" or "torchao"
    precision: str = "bf16"
    options: tuple[str, ...] = ()  # tN, gN, dN, rN, drN, whole, sync, nospec, aoff, hostsum, lazy, onepass, lean
    clip: str | None = None        # a key of CLIP_NORMS
    accum: int = 1
    lora: int | None = None        # LoRA rank
    ckpt: str | int = "all"        # activation_checkpointing
    base: str | None = None        # LoRA's frozen base held in this format (offload_ext.models.quantized_base)

    @classmethod
    def parse(cls, name: str) -> "Mode":
        backend, *rest = name.split("-")
        precision = "bf16"
        if backend != "resident":
            if not rest:
                raise SystemExit(f"bench_train: mode {name!r} needs a precision (e.g. native-bf16)")
            precision, rest = PRECISION_NAMES.get(rest[0], rest[0]), rest[1:]
        clip = next((o for o in rest if o in CLIP_NORMS), None)
        accum = next((int(o[5:]) for o in rest if o.startswith("accum")), 1)
        lora = next((int(o[4:]) for o in rest if o.startswith("lora") and o[4:].isdigit()), None)
        ckpt = next((o[4:] for o in rest if o.startswith("ckpt")), "all")
        ckpt = int(ckpt) if ckpt.isdigit() else ckpt
        base = next((o[4:] for o in rest if o.startswith("base")), None)
        if base is not None and (base not in BASE_DTYPES or lora is None):
            raise SystemExit(f"bench_train: mode {name!r}: base<format> takes one of {BASE_DTYPES} and a loraN")
        options = tuple(o for o in rest
                        if o not in CLIP_NORMS and not o.startswith(("accum", "lora", "ckpt", "base")))
        if backend in PEERS and (set(options) - {"tuned", *DS_VARIANTS} or lora or ckpt != "all"
                                 or precision not in _deepspeed.PRECISIONS):
            raise SystemExit(f"bench_train: mode {name!r}: {backend} takes a precision in {_deepspeed.PRECISIONS}, "
                             "the clip and accum suffixes and (deepspeed) tuned, zenflow or superoffload only")
        variant = next((o for o in options if o in DS_VARIANTS), None)
        if variant is not None and DS_VARIANTS[variant] != backend:
            raise SystemExit(f"bench_train: mode {name!r}: {variant} is a {DS_VARIANTS[variant]} mode")
        if variant is not None and precision == "bf16":  # found only after the model is built, or in a step
            raise SystemExit(f"bench_train: mode {name!r}: {DS_BF16_REFUSAL[variant]}; run it in mixed: "
                             f"{name.replace('bf16', 'mixed')}")
        numbered = rf"({'|'.join(NUMBERED_OPTIONS)})\d+"
        unknown = [o for o in options if o not in FLAG_OPTIONS and not re.fullmatch(numbered, o)]
        if unknown:
            raise SystemExit(f"bench_train: mode {name!r}: unknown suffix {unknown[0]!r} (see --help for the suffixes)")
        if backend == "resident" and ckpt not in ("all", "none"):
            raise SystemExit(f"bench_train: mode {name!r}: resident modes checkpoint every layer or none (ckptnone)")
        if "lean" in options and (backend != "resident" or ckpt != "all"):
            raise SystemExit(f"bench_train: mode {name!r}: lean is a resident mode's checkpoint (every layer "
                             "checkpointed): offloaded modes always use it")
        return cls(name, backend, precision, options, clip, accum, lora, ckpt, base)

    def option(self, prefix: str) -> int | None:
        assert prefix in NUMBERED_OPTIONS, prefix  # a new one must be known to the suffix check above
        return next((int(o[len(prefix):]) for o in self.options if o.startswith(prefix) and o[len(prefix):].isdigit()),
                    None)

    @property
    def recipe(self) -> tuple[str | None, int, int | None, str, str | None]:
        """What a resident peer must share: ckptN and ckptauto are compared with full checkpointing, what
        resident training has to do where the offloaded run keeps layers with the memory offload frees."""
        return self.clip, self.accum, self.lora, "none" if self.ckpt == "none" else "all", self.base

    @property
    def max_grad_norm(self) -> float | None:
        return CLIP_NORMS[self.clip] if self.clip else None


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="b1", help="shape defaults (flags below override)")
    for name in ("layers", "hidden", "intermediate", "heads", "kv-heads", "head-dim", "vocab", "batch", "seq"):
        ap.add_argument(f"--{name}", type=int, default=None)
    ap.add_argument("--untied", action="store_true", default=None, help="untied embeddings (B2's default)")
    ap.add_argument("--arch", choices=("llama", "qwen2"), default=None, help="the model class (qwen-14b: qwen2)")
    ap.add_argument("--gpu-cap-gb", type=float, default=None,
                    help="cap the offloaded modes' GPU memory (resident modes run uncapped)")
    ap.add_argument("--cap-resident", action="store_true",
                    help="cap the resident modes too (to show what does not fit without offload: the row says why)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: the simulated device, for a smoke run of the script itself (timings mean nothing)")
    ap.add_argument("--trace", default=None, metavar="DIR",
                    help="after the timed steps, trace one more step per mode (DeepSpeed's aside) into "
                         "DIR/timeline_<mode>.json")
    ap.add_argument("--trace-gpu", action="store_true",
                    help="with --trace: run the traced step under torch.profiler and merge its GPU streams, CUDA "
                         "API calls and torch ops in")
    ap.add_argument("--memory-log", default=None, metavar="FILE",
                    help="sample host RSS and MemAvailable every 0.5 s into FILE (flushed: it survives a kill)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--compile", action="store_true", help="torch.compile each layer")
    ap.add_argument("--step-sync", choices=("compute", "device"), default="compute",
                    help="what a step waits for at its end: its compute stream (a training loop reading its loss), "
                         "or the whole device, the engine's side streams too (every step until 28d25d5)")
    ap.add_argument("--sync-each-forward", action="store_true",
                    help="synchronise after each forward and read each micro-batch's loss (the loop before run 61)")
    ap.add_argument("--batches", type=int, default=1, metavar="N",
                    help="step k trains on the k %% N-th of N batches drawn at the start (the same in every mode)")
    ap.add_argument("--data", choices=("random", "embedded"), default="random",
                    help="embedded: the batches are offload-train's embedded corpus (the standard library's source, "
                         "its own BPE of up to 4096 tokens), so that clipreal's norm follows a real trajectory")
    ap.add_argument("--interleave", type=int, default=0, metavar="K",
                    help="set every mode up at once and run them in turns of an untimed lead-in step and K timed ones "
                         "(0: one mode after another); resident and offloaded modes, uncapped")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--stem", default=None)
    a = ap.parse_args()
    if a.batches < 1:
        raise SystemExit("bench_train: --batches takes N >= 1")
    if a.interleave < 0:
        raise SystemExit("bench_train: --interleave takes K >= 1 steps per turn, or 0 for one mode after another")
    if a.interleave and (a.gpu_cap_gb or a.memory_log or any(m.startswith("deepspeed") for m in a.modes.split(","))):
        raise SystemExit("bench_train: --interleave runs resident and offloaded modes side by side in one process: "
                         "drop --gpu-cap-gb and --memory-log (both per mode) and the DeepSpeed modes")
    for key, value in {"arch": "llama", **PRESETS[a.preset]}.items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    return a


_BLOCK = 1 << 24  # pre-drawn N(0, 1) values a matrix is tiled from


class TiledWeights:
    """The benchmark models' weights, as a WeightSource: N(0, initializer_range) for matrices and
    embeddings (tiled from one pre-drawn block, each parameter from a generator seeded by its name, so
    every mode gets the same values whatever order it fills in), ones for norms, zeros for biases, as
    HF's init; in seconds, where HF's own init of the 1.24 B shape takes about a minute on the GPU
    machine's host. The offloaded modes fill the engine from it directly (no model on the host); the
    others materialise the model from it."""

    thread_safe = True

    def __init__(self, model: torch.nn.Module, std: float) -> None:
        self.block = torch.randn(_BLOCK, generator=torch.Generator().manual_seed(0)).mul_(std).bfloat16()
        self.names: dict[int, str] = {}
        for name, p in model.named_parameters():  # a tied parameter under its first name
            self.names.setdefault(id(p), name)

    def fill(self, param: torch.nn.Parameter, dst: torch.Tensor) -> None:
        self._fill(self.names[id(param)], param.dim() > 1, dst)  # dst may be the parameter's flat span

    def fill_named(self, name: str, dst: torch.Tensor) -> None:
        """The values of the parameter of this name into a tensor of its shape (materialize_shards' fill)."""
        self._fill(name, dst.dim() > 1, dst)

    def _fill(self, name: str, matrix: bool, dst: torch.Tensor) -> None:
        if matrix:
            seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") >> 1
            tile_random(dst.view(-1), self.block, torch.Generator().manual_seed(seed))
        else:
            dst.fill_(0.0 if name.endswith("bias") else 1.0)

    def value(self, param: torch.nn.Parameter, device: torch.device | str) -> torch.Tensor:
        return filled_on(self, param, device, torch.bfloat16)  # what the models train in


def build_model(a: argparse.Namespace) -> tuple[torch.nn.Module, TiledWeights]:
    """A bf16 Llama (or Qwen2) of the preset's shape with its parameters on the meta device, and its
    weights (TiledWeights). Tied weights stay tied."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if a.arch == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    cfg = config_cls(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                     num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                     max_position_embeddings=max(a.seq, 128), tie_word_embeddings=not a.untied,
                     rope_theta=1e6 if a.arch == "qwen2" else 500000.0, use_cache=False,
                     **({"head_dim": a.head_dim} if a.head_dim else {}))
    with offload_ext.parameters_on_meta():
        model = model_cls(cfg)
    return model, TiledWeights(model, cfg.initializer_range)


def corpus_batches(a: argparse.Namespace) -> torch.Tensor:
    """--batches batches of the embedded corpus, consecutive --seq windows of its token stream (documents joined
    by the end-of-text token), tokenized by offload-train's embedded tokenizer (cached where offload-train keeps it)."""
    import tempfile

    from offload_ext.train import data

    max_bytes, vocab = 8 << 20, min(a.vocab, 4096)
    if vocab < 512:  # a byte-level BPE has 257 tokens before its first merge
        raise SystemExit(f"bench_train: --data embedded needs --vocab 512 or more, got {a.vocab}")
    path = os.path.join(data.cache_dir() or tempfile.mkdtemp(), data.embedded_entry(max_bytes, vocab),
                        "tokenizer.json")
    texts = data.stdlib_corpus(max_bytes)
    tok = data.train_tokenizer(None if os.path.exists(path) else texts, vocab, path)
    need, ids = a.batches * a.batch * a.seq, []
    for k in range(0, len(texts), 64):  # no more of the corpus than the batches take
        for enc in tok.encode_batch(texts[k:k + 64]):
            ids += enc.ids + [0]
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise SystemExit(f"bench_train: the embedded corpus has {len(ids):,} tokens, fewer than --batches x --batch "
                         f"x --seq = {need:,}")
    return torch.tensor(ids[:need]).view(a.batches, a.batch, a.seq)


def _materialize(model: torch.nn.Module, weights: TiledWeights) -> None:
    for p in {id(p): p for p in model.parameters()}.values():
        if p.is_meta:  # LoRA adapters are real already
            materialize(weights, p, "cpu")


def build_real_model(a: argparse.Namespace) -> torch.nn.Module:
    """build_model's model with its weights on the CPU (bf16 parameters, buffers as built)."""
    model, weights = build_model(a)
    _materialize(model, weights)
    return model


def _setup(mode: Mode, model: torch.nn.Module, weights: TiledWeights,
           a: argparse.Namespace) -> tuple[torch.nn.Module, Any, Any]:
    """(model, Offloader or None, device optimizer or _deepspeed.ZeroRun or None) for `mode`, GPU memory
    capped for every offloaded mode (DeepSpeed's included)."""
    if mode.backend == "resident" and mode.base is not None:  # before anything else is made real: see _qlora
        _qlora.hold_base(model, mode.base, a.device, weights)
    if mode.backend in ("resident", *PEERS):
        _materialize(model, weights)
    if a.device == "cuda":
        cap = a.gpu_cap_gb * 1e9 / torch.cuda.get_device_properties(0).total_memory if a.gpu_cap_gb else 1.0
        uncapped = mode.backend in ("resident", "torchao") and not a.cap_resident
        torch.cuda.set_per_process_memory_fraction(1.0 if uncapped else min(1.0, cap))
    if mode.backend in ("resident", "torchao"):
        model.to(a.device)
        # the engine's own checkpoint on each layer, nothing to fetch (torchao's rows are resident-lean's peers)
        if "lean" in mode.options or mode.backend == "torchao":
            for layer in _layers(model):
                wrap_layer(layer, lambda: None, a.compile)
        elif mode.ckpt == "all":
            offload_ext.enable_activation_checkpointing(model)
        if a.compile and "lean" not in mode.options:
            for layer in _layers(model):
                layer.compile()
        trainable = [p for p in model.parameters() if p.requires_grad]
        for p in trainable:  # peft makes fp32 adapters; the engine trains them in bf16, as every other weight
            p.data = p.data.to(torch.bfloat16)
        if mode.backend == "torchao":
            from torchao.optim import CPUOffloadOptimizer

            return model, None, CPUOffloadOptimizer(trainable, torch.optim.AdamW, offload_gradients=False, fused=True,
                                                    lr=a.lr, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
        return model, None, torch.optim.AdamW(trainable, lr=a.lr, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                              fused=True)
    if mode.backend.startswith("deepspeed"):
        if a.compile:
            raise RuntimeError("deepspeed modes do not take --compile")
        offload_ext.enable_activation_checkpointing(model)
        layer_numel = sum(p.numel() for p in _layers(model)[0].parameters())
        tuning = _deepspeed.Zero(stage=2 if mode.backend == "deepspeed2" else 3, tuned="tuned" in mode.options,
                                 layer_numel=layer_numel,
                                 variant=next((v for v in DS_VARIANTS if v in mode.options), None))
        run = _deepspeed.ZeroRun(model, offload_ext.causal_lm_loss, device=a.device, batch=a.batch, accum=mode.accum,
                                 max_grad_norm=mode.max_grad_norm, precision=mode.precision, lr=a.lr, betas=BETAS,
                                 eps=EPS, weight_decay=WEIGHT_DECAY, zero=tuning)
        return model, None, run
    options = dict(precision=mode.precision, backend=mode.backend, device=a.device,
                   compile_layers=a.compile, num_threads=mode.option("t"), host_nice=mode.option("n") or 0,
                   grad_slots=mode.option("g"), device_layers=mode.option("d") or 2,
                   async_step=False if "sync" in mode.options else None,
                   slice_elements=1 << 62 if "whole" in mode.options else None,
                   grad_accum=mode.accum, max_grad_norm=mode.max_grad_norm,
                   speculative_clip="nospec" not in mode.options,
                   accumulate_on_device=False if "hostsum" in mode.options else None,
                   resident_layers=mode.option("r") or 0, device_redo_layers=mode.option("dr"),
                   activation_checkpointing=mode.ckpt, activation_offload="aoff" in mode.options,
                   eager_uploads="lazy" not in mode.options, params_first="onepass" not in mode.options,
                   base_dtype=mode.base)
    if "auto" in mode.options:
        options.update(_auto_layout(mode, model, options, a))
    off = offload_ext.Offloader(model, lr=a.lr, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, weights=weights,
                                **options)
    return model, off, None


def _auto_layout(mode: Mode, model: torch.nn.Module, options: dict[str, Any], a: argparse.Namespace) -> dict[str, int]:
    """Resident layers and device buffers as offload-train's `--resident-layers auto --device-layers auto` picks
    them, for this mode's micro-batch on this GPU (its cap, when the run has one); an rN suffix fixes the resident
    count and leaves the buffers to the choice."""
    cfg = offload_ext.OffloadConfig.from_options(**{**options, "resident_layers": mode.option("r") or 0,
                                                    "device_layers": 2})
    settings = Settings(cfg, batch_size=a.batch // mode.accum, seq_len=a.seq)
    cap = int(a.gpu_cap_gb * 1e9) if a.gpu_cap_gb and a.device == "cuda" else None
    choice = choose_layout(model, settings, plan_machine(a.device, gpu_memory=cap, model=model),
                           resident=mode.option("r"))
    print(f"  {mode.name}: auto layout {choice.flags} ({choice.reason})", flush=True)
    return dict(resident_layers=choice.resident_layers, device_layers=choice.device_layers)


def _layers(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder layers, under peft's wrapper too."""
    return find_layer_stacks(model)[0][1]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _sync_step() -> None:
    """A step's end: its compute stream drained, as a training loop that reads its loss sees it. Not the whole
    device: the engine's side streams (clipped redos on the device, copying their results back) run on into the
    next step's forward, as they do in training, and a wait for them here would put them on every step's path
    (B2 clip 1.0, run 92: 0.4 s a step of redo copies, the gap between the step and its GPU phases)."""
    if torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()


# Warm-up steps a mode may take past --warmup while the engine measures which layers the device redoes: every
# step clipped, it measures in 14; a run whose steps rarely clip may not be done in these.
TUNING_WARMUP_CAP = 40


class _PhaseClock:
    """A step's time by phase (forward, backward, step) without a synchronisation inside it: a CUDA event and
    the wall clock at each phase's start and at the step's end, read once after the step. A phase's GPU time
    runs from the device reaching its first mark to reaching the next, so the phases split the device's
    timeline of the step; its CPU time is the launching thread's time in it. A sync after each forward (as
    before run 61) empties the device's queue before every backward, which a training loop does not do. On the
    CPU the two are one clock."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.marks: list[tuple[str | None, Any, float]] = []  # (phase starting here, event, wall clock)

    def begin(self, phase: str | None) -> None:
        """Start `phase` (None: the step's end)."""
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self.marks.append((phase, event, time.perf_counter()))

    def seconds(self) -> dict[str, dict[str, float]]:
        """Per phase, {"gpu": s, "cpu": s} summed over its spans; call after begin(None)."""
        if self.cuda:
            self.marks[-1][1].synchronize()
        out: dict[str, dict[str, float]] = {}
        for (phase, e0, t0), (_, e1, t1) in zip(self.marks, self.marks[1:]):
            gpu = e0.elapsed_time(e1) / 1e3 if self.cuda else t1 - t0
            spent = out.setdefault(phase, {"gpu": 0.0, "cpu": 0.0})
            spent["gpu"] += gpu
            spent["cpu"] += t1 - t0
        return out


def _train_step(mode: Mode, model: torch.nn.Module, off: Any, opt: Any, micro: list[torch.Tensor],
                timeline: Timeline | None = None, sync_each: bool = False) -> tuple:
    """One step over the micro-batches: (loss, summed forward seconds, whether it clipped, its phases' times:
    _PhaseClock.seconds, empty for DeepSpeed). A resident step marks its backward passes and step on
    `timeline` (the Offloader marks its own). Nothing synchronises within the step but what the recipe needs
    (clipping's norm); the losses are read at its end."""
    if isinstance(opt, _deepspeed.ZeroRun):
        loss_sum, t_fwd, norm = opt.train_step(micro, _sync_step)
        clipped = norm is not None and mode.max_grad_norm is not None and norm > mode.max_grad_norm
        return loss_sum, t_fwd, clipped, {}
    clock, losses = _PhaseClock(micro[0].is_cuda), []
    for tokens in micro:
        clock.begin("forward")
        loss = offload_ext.causal_lm_loss(model, tokens) / len(micro)
        clock.begin("backward")
        if sync_each:
            _sync()
        if off is not None:
            off.backward(loss)
        else:
            with span(timeline, "python", "backward"):
                loss.backward()
        losses.append(loss.detach())
        if sync_each:
            loss.item()
    clock.begin("step")
    if off is not None:
        off.step()
        off.zero_grad()
        norm = off.last_grad_norm
    else:
        with span(timeline, "python", "step"):
            norm = (float(torch.nn.utils.clip_grad_norm_(model.parameters(), mode.max_grad_norm))
                    if mode.max_grad_norm is not None else None)
            opt.step()
        opt.zero_grad(set_to_none=True)
    clock.begin(None)
    clipped = norm is not None and norm > mode.max_grad_norm
    phases = clock.seconds()
    return float(torch.stack(losses).sum()), phases["forward"]["gpu"], clipped, phases


def run_mode(mode: Mode, a: argparse.Namespace, tokens: torch.Tensor) -> dict[str, Any]:
    """The mode's row; a DeepSpeed mode that fails, or any mode refused for memory, leaves a row with its
    error, and the run goes on."""
    try:
        run = _ModeRun(mode, a, tokens)
        k = run.warm_up(0)
        for j in range(a.steps):
            run.step(k + j, timed=True)
        return run.finish()
    except Exception as e:  # a peer's failures (import, op build, initialize, OOM); our memory check's
        if mode.backend not in PEERS and not isinstance(e, (MemoryError, torch.OutOfMemoryError)):
            raise
        traceback.print_exc()
        error = f"{type(e).__name__}: {e}"
        print(f"  {mode.name:13s} not run: {error}", flush=True)
        return {"mode": mode.name, "error": error}
    finally:
        _release(mode, a)


def _release(mode: Mode, a: argparse.Namespace) -> None:
    if mode.backend.startswith("deepspeed"):
        _deepspeed.release()
    # A mode that failed half way leaves its model and Offloader in reference cycles (hooks, closures):
    # collected here, or the next mode found 13.7 GB of a 24 GB cap still taken (run 48).
    gc.collect()
    if a.device == "cuda":
        torch.cuda.empty_cache()


def run_interleaved(modes: list[Mode], a: argparse.Namespace, tokens: torch.Tensor) -> list[dict[str, Any]]:
    """Every mode set up at once, then turns of each: the modes share the host's moments (run 74: one mode's
    step time moved 35 % between two places in one process, every mode launch-bound on a thread whose speed
    drifts). The warm-up steps run in turns too. Each timed turn is one untimed lead-in step and --interleave
    timed ones, then the engine's host work is awaited, uncharged: every timed step starts behind the host work
    of the step before it, as in a run of one mode (where the last step's leftover is never charged either),
    and no mode's background work lands in another's time. Step k of every mode trains on the same batch."""
    runs = [_ModeRun(m, a, tokens, own_peak=False) for m in modes]
    k = 0
    for run in runs:
        k = max(k, run.warm_up(0))
        run.settle()
    while len(runs[0].steps) < a.steps:
        n = min(a.interleave, a.steps - len(runs[0].steps))
        for run in runs:
            for j in range(n + 1):
                run.step(k + j, timed=j > 0)
            run.settle()
        k += n + 1
    rows = [run.finish() for run in runs]
    del runs
    gc.collect()
    return rows


class _ModeRun:
    """One mode: built and set up at construction, stepped by step(k), its row made by finish(), which
    closes it."""

    def __init__(self, mode: Mode, a: argparse.Namespace, tokens: torch.Tensor, own_peak: bool = True) -> None:
        if a.batch % mode.accum:
            raise SystemExit(f"bench_train: {mode.name}: batch {a.batch} does not split into {mode.accum} "
                             "micro-batches")
        if a.device == "cuda" and own_peak:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        self.mode, self.a, self.tokens, self.own_peak = mode, a, tokens, own_peak
        t0 = time.perf_counter()
        model, weights = build_model(a)
        trainable = None
        if mode.lora:
            torch.manual_seed(0)  # peft draws the adapters from the global generator: the same in every mode and run
            model = add_lora(model, mode.lora, 2 * mode.lora, LORA_TARGETS)
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.flops_per_token = _common.model_flops_per_token(model.config, tokens.shape[-1], trainable)
        self.build = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.model, self.off, self.opt = _setup(mode, model, weights, a)
        _sync()
        self.setup = time.perf_counter() - t0
        self.model.train()
        self.steps: list[float] = []
        self.forwards: list[float] = []
        self.waits: list[float] = []
        self.busy: list[float] = []
        self.clipped: list[bool] = []
        self.phases: list[dict[str, dict[str, float]]] = []
        self.losses: list[float] = []
        self.tuning_steps = 0  # warm-up steps taken past --warmup while the engine measured its device redos

    def warm_up(self, k: int) -> int:
        """--warmup untimed steps from step k, then more while the engine still measures how many layers the
        device redoes (engine/redo_tuning.py; at most TUNING_WARMUP_CAP more): the timed steps are the run's
        steady state, as in a long run. Returns the next step's k."""
        for j in range(self.a.warmup):
            self.step(k + j, timed=False)
        k += self.a.warmup
        tuning = self.off.redo_tuning if self.off is not None else None
        while tuning is not None and tuning.chosen is None and self.tuning_steps < TUNING_WARMUP_CAP:
            self.step(k, timed=False)
            k += 1
            self.tuning_steps += 1
        return k

    def step(self, k: int, timed: bool | None = None) -> None:
        """Step k (on batch k % --batches); timed unless `timed` says otherwise (default: past the warm-up)."""
        off = self.off
        timed = k >= self.a.warmup if timed is None else timed
        before = off.stats() if off is not None and timed else {}
        t0 = time.perf_counter()
        loss, t_fwd, did_clip, phases = _train_step(self.mode, self.model, off, self.opt, self._micro(k),
                                                    sync_each=self.a.sync_each_forward)
        _sync() if self.a.step_sync == "device" else _sync_step()
        self.losses.append(loss)
        if not timed:
            return
        self.steps.append(time.perf_counter() - t0)
        self.forwards.append(t_fwd)
        self.phases.append(phases)
        self.clipped.append(did_clip)
        # Time the Python thread was blocked on host work: in step() (python backend, native with
        # -sync) or, with the native async step, also in forward hooks and gradient-slot reuse.
        after = off.stats() if off is not None else {}
        self.waits.append(max(off.last_step_wait, after["host_wait_s"] - before["host_wait_s"]) if off is not None
                          else 0.0)
        self.busy.append(after.get("step_busy_seconds", 0.0) - before.get("step_busy_seconds", 0.0))

    def _micro(self, k: int) -> list[torch.Tensor]:
        """Step k's micro-batches: batch k % --batches split in the mode's accumulation."""
        return list(self.tokens[k % len(self.tokens)].chunk(self.mode.accum))

    def settle(self) -> None:
        """End of a turn: wait for the host steps still running (another mode's turn comes next)."""
        if self.off is not None:
            testing.settle(self.off)

    def finish(self) -> dict[str, Any]:
        mode, a, off, opt = self.mode, self.a, self.off, self.opt
        peak = torch.cuda.max_memory_allocated() / 1e9 if a.device == "cuda" and self.own_peak else None
        # what the cap bounds: the allocator's reserve, fragmentation included (the plan's margin is for it)
        reserved = torch.cuda.max_memory_reserved() / 1e9 if a.device == "cuda" and self.own_peak else None
        if a.trace and not isinstance(opt, _deepspeed.ZeroRun):  # one more step, traced, after the timed ones
            _traced_step(mode, self.model, off, opt, self._micro(0), a)
        median = statistics.median(self.steps)
        row = {"mode": mode.name, "step_s": median, "forward_s": statistics.median(self.forwards),
               "step_wait_s": statistics.median(self.waits), "host_busy_s": statistics.median(self.busy),
               "setup_s": self.setup, "build_s": self.build, "gpu_peak_gb": peak, "gpu_reserved_peak_gb": reserved,
               "losses": self.losses,
               "step_times_s": self.steps, "tokens_per_s": self.tokens[0].numel() / median,
               "model_tflops": self.flops_per_token * self.tokens[0].numel() / median / 1e12,
               "clipped_fraction": sum(self.clipped) / len(self.clipped) if mode.clip else None,
               "phases_s": {name: {clock: statistics.median(p[name][clock] for p in self.phases)
                                   for clock in ("gpu", "cpu")} for name in (self.phases[0] if self.phases else {})}}
        if off is not None and mode.precision == "mixed" and mode.backend == "native":
            row["a1_mixed_kernel_s"] = time_mixed_kernel(off)
        if off is not None:
            # numbers, and tables of them (the device-redo counts' measured times: layers -> seconds)
            row["engine"] = {k: v for k, v in off.stats().items() if isinstance(v, (int, float, bool, dict))}
            row["setup_parts_s"] = dict(off.setup_seconds)
            row["layout"] = {k: getattr(off.config.tuning, k) for k in ("resident_layers", "device_layers")}
            row["tuning_warmup_steps"] = self.tuning_steps
            if off.redo_tuning is not None and off.redo_tuning.times:
                print(f"  {mode.name}: device redo {off.redo_tuning.summary()}", flush=True)
            off.close(copy_out=False)  # the model is dropped next: no bf16 copy of it (70 B: 141 GB)
        if isinstance(opt, _deepspeed.ZeroRun):  # its host work is not visible from here: no wait or busy figures
            row.update(step_wait_s=None, host_busy_s=None, engine=opt.stats(), setup_parts_s=dict(opt.setup_seconds))
        self.model = self.off = self.opt = None
        parts = " ".join(f"{k} {v:.2f}" for k, v in row.get("setup_parts_s", {}).items())
        print(f"  {mode.name:13s} step {row['step_s']:.4f} s  fwd {row['forward_s']:.4f} s"
              f"  wait {_num(row['step_wait_s'])} s  busy {_num(row['host_busy_s'])} s"
              f"  build {self.build:.1f} s  setup {self.setup:.2f} s ({parts})  peak {_num(peak, '.1f')} GB"
              f"  loss {self.losses[0]:.3f}->{self.losses[-1]:.3f}", flush=True)
        return row


def _traced_step(mode: Mode, model: torch.nn.Module, off: Any, opt: Any, micro: list[torch.Tensor],
                 a: argparse.Namespace) -> None:
    """One step on the engine's timeline (a resident step: on one of its own, with its backward passes and
    step), written to DIR/timeline_<mode>.json; with --trace-gpu, inside torch.profiler too, its GPU streams
    (kernels, copies) merged in as more lanes, so that both columns' launches can be compared."""
    os.makedirs(a.trace, exist_ok=True)
    profiler = contextlib.nullcontext()
    if a.trace_gpu:
        from torch.profiler import ProfilerActivity, profile

        profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    with profiler as prof, (off.trace() if off is not None else contextlib.nullcontext(Timeline())) as timeline:
        _train_step(mode, model, off, opt, micro, timeline if off is None else None)
    if prof is not None:
        timeline.add_profile(prof, GPU_CATEGORIES + RUNTIME_CATEGORIES + ("cpu_op",))
    timeline.write(os.path.join(a.trace, f"timeline_{mode.name}.json"))


def _num(value: float | None, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


def time_mixed_kernel(off) -> float:
    """The A1 mixed kernel over this model's streamed layers, on the same buffers and thread count."""
    from offload_ext.engine.backends.native import default_engine_threads

    testing.settle(off)  # steps of the last backward may still run on these buffers
    layers = testing.host_buffers(off)
    offload_ext.set_num_threads(default_engine_threads(), pin=True)

    def once() -> None:
        for b in layers:
            offload_ext.adamw_step(b.master, b.grads, b.exp_avg, b.exp_avg_sq, lr=0.0, beta1=0.9, beta2=0.999,
                                   eps=1e-8, weight_decay=0.0, step=1000, param_out=b.trainable_params)
    return _common.median_seconds(once, steps=5, warmup=1)


def _table_line(r: dict[str, Any], peer: dict[str, Any] | None) -> str:
    """The row's table line; sets its ratio to `peer`, the resident mode of the same recipe."""
    if "error" in r:  # the reason in place of the numbers; markdown-safe on one line
        reason = " ".join(r["error"].split()).replace("|", "\\|")
        return f"| {r['mode']} | not run: {reason} |" + " - |" * 8
    ratio = r["step_s"] / peer["step_s"] if peer and "error" not in peer else None
    r["time_ratio_vs_resident"], r["resident_peer"] = ratio, peer["mode"] if peer else None
    frac = f"{r['clipped_fraction']:.0%}" if r["clipped_fraction"] is not None else "-"
    shown = f"{ratio:.3f}x" if ratio is not None else "-"
    return (f"| {r['mode']} | {r['step_s']:.4f} | {r['tokens_per_s']:.0f} | {shown} | "
            f"{r['forward_s']:.4f} | {_num(r['step_wait_s'])} | {_num(r['host_busy_s'])} | {r['setup_s']:.2f} | "
            f"{_num(r['gpu_peak_gb'], '.2f')} | {frac} |")


def _phase_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Each mode's median step split by phase (_PhaseClock): the device's time in each, then the launching
    thread's; forward and backward summed over the micro-batches."""
    timed = [r for r in rows if r.get("phases_s")]
    if not timed:
        return []
    names = ("forward", "backward", "step")
    lines = ["", "| mode | " + " | ".join(f"{n} GPU s" for n in names) + " | " + " | ".join(f"{n} CPU s" for n in names)
             + " |", "|---|" + "---:|" * 6]
    for r in timed:
        cells = [_num(r["phases_s"].get(n, {}).get(clock)) for clock in ("gpu", "cpu") for n in names]
        lines.append(f"| {r['mode']} | " + " | ".join(cells) + " |")
    return lines


def _deepspeed_lines(modes: list[Mode], rows: list[dict[str, Any]]) -> list[str]:
    """Each DeepSpeed mode's step time over the plain native mode of the same precision and recipe
    (deepspeed-bf16-clip over native-bf16-clip), where both ran; sets the ratio in the DeepSpeed row."""
    natives = {(m.precision, m.recipe): r for m, r in zip(modes, rows)
               if m.backend == "native" and not m.options and m.ckpt == "all" and "error" not in r}
    pairs = []
    for m, r in zip(modes, rows):
        peer = natives.get((m.precision, m.recipe))
        if m.backend.startswith("deepspeed") and peer and "error" not in r:
            r["time_ratio_vs_native"], r["native_peer"] = r["step_s"] / peer["step_s"], peer["mode"]
            pairs.append(f"{r['mode']} / {peer['mode']} = {r['time_ratio_vs_native']:.3f}x")
    return ["", "native vs DeepSpeed, same recipe (DeepSpeed step time / native step time): " + "; ".join(pairs)] \
        if pairs else []


def _peers(modes: list[Mode], rows: list[dict[str, Any]]) -> list[dict[str, Any] | None]:
    """Each row's resident peer: the last resident row of its recipe that ran before it, else the first after
    it (resident rows with a suffix other than the recipe's, e.g. -lean, are never peers). Listed in pairs
    (resident-accum2,native-bf16-accum2,resident-accum2,...), each row is compared with its own pair's: processes
    of one mode differ by up to 10 % on the GPU host (run 62)."""
    peers = []
    for k, m in enumerate(modes):
        same = [j for j, mm in enumerate(modes)
                if mm.backend == "resident" and not mm.options and mm.recipe == m.recipe]
        before = [j for j in same if j <= k]
        j = before[-1] if before else (same[0] if same else None)
        peers.append(rows[j] if j is not None else None)
    return peers


def main() -> None:
    a = parse()
    modes = [Mode.parse(m) for m in a.modes.split(",") if m]
    kept = next((m.ckpt for m in modes if m.ckpt != "all"), "all")
    allocator_for_kept_layers(kept)  # offload-train's allocator for kept layers, for every mode of the process
    # Each mode builds its own copy (the same seed, the same weights): no second host copy of the model
    # lives beside the one a mode trains (B2: 16 GB).
    n_params = sum(p.numel() for p in build_model(a)[0].parameters())
    # --batches N: step k trains on batch k % N (the first is the one a single batch has always been), so that a
    # long run does not learn its one batch by heart: clipall's norm fell under 1e-3 after ~24 steps (run 75).
    tokens = (corpus_batches(a) if a.data == "embedded" else
              torch.randint(0, a.vocab, (a.batches, a.batch, a.seq), generator=torch.Generator().manual_seed(0)))
    tokens = tokens.to(a.device)
    family = "Qwen2" if a.arch == "qwen2" else "Llama"
    print(f"{a.preset.upper()}: {family} {a.layers} layers, hidden {a.hidden}, {n_params / 1e6:.0f} M params, batch "
          f"{a.batch} x {a.seq}, compile={a.compile}, GPU cap for offload {a.gpu_cap_gb} GB", flush=True)
    memory = _common.HostMemoryLog(a.memory_log) if a.memory_log else None
    rows = []
    if a.interleave:
        rows = run_interleaved(modes, a, tokens)  # all at once: the table below is their first print
    for m in modes[len(rows):]:
        if memory:
            memory.label(m.name)
        rows.append(run_mode(m, a, tokens))
        if memory:
            rows[-1]["host_rss_peak_gb"] = memory.peak()
        # The row's table line at once (peers that ran before it): a run cut short keeps its lines in the log.
        print(_table_line(dict(rows[-1]), _peers(modes[:len(rows)], rows)[-1]), flush=True)
    if memory:
        memory.close()
    plain = (None, 1, None, "all", None)
    resident = next((r for m, r in zip(modes, rows) if m.backend == "resident" and m.recipe == plain), None)
    lines = ["| mode | s/step | tok/s | vs resident, same recipe (time) | forward s | host wait s | host busy s | "
             "set-up s | GPU peak GB | steps clipped |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [_table_line(r, peer) for r, peer in zip(rows, _peers(modes, rows))]
    lines += _deepspeed_lines(modes, rows)
    lines += _phase_lines(rows)
    for mixed in (r for r in rows if "a1_mixed_kernel_s" in r):
        # The forward of the GPU-resident run when there is one: the offloaded forward can include
        # waiting for host steps left over from the previous backward.
        fwd, source = (resident["forward_s"], "resident") if resident else (mixed["forward_s"], mixed["mode"])
        bound = fwd + 1.1 * mixed["a1_mixed_kernel_s"]
        lines += ["", f"{mixed['mode']}: step {mixed['step_s']:.4f} s vs forward ({source}) + 1.1 x mixed kernel "
                      f"({fwd:.4f} + 1.1 x {mixed['a1_mixed_kernel_s']:.4f}) = {bound:.4f} s"]
    stem = a.stem or f"train_{a.preset}" + ("_compile" if a.compile else "")
    _common.publish(stem, {"args": vars(a), "params": n_params, "rows": rows,
                           "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}, lines)


if __name__ == "__main__":
    main()
