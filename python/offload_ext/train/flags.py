"""offload-train's flags: the parser, and the configurations (OffloadConfig, TrainConfig) built from the parsed
flags in one place. Every config field names its flag in its metadata (`cli`); the engine's expert switches are
reached through one generated flag, --tuning NAME=VALUE[,...]."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, NoReturn

import torch

from offload_ext.config import PRECISIONS, EngineTuning, OffloadConfig, parse_size
from offload_ext.models.losses import KERNELS
from offload_ext.models.quantized_base import BASE_DTYPES
from offload_ext.train import data as data_mod
from offload_ext.train import prior_run
from offload_ext.train.config import TrainConfig
from offload_ext.train.errors import UsageError
from offload_ext.train.inputs import check_numbers
from offload_ext.train.model_configs import BUILTIN
from offload_ext.train.watch import check_report_to

DESCRIPTION = """Train a causal LM with CPU offload (or without, for comparison) on one device, or with --fsdp under
torchrun on several.

With no arguments it runs an embedded default that needs no download: a small Llama config (tiny on a
CPU), the Python standard library's own sources as text, and a BPE tokenizer trained on them in seconds.
"""
_ACCUMULATE_ON = {"auto": None, "device": True, "host": False}


def _count_or_auto(value: str) -> str | int:
    """A number of layers, or "auto" (chosen from the memory plan once the model is known)."""
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of layers or 'auto', got {value!r}") from None


def _checkpointing(value: str) -> str | int:
    """--activation-checkpointing's value: a name, or a number of layers."""
    return int(value) if value.isdigit() else value


class _Parser(argparse.ArgumentParser):
    """argparse's errors as offload-train's: one line and exit status 2, without the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (offload-train --help lists the options)\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, each numeric flag in its range (a UsageError otherwise)."""
    ap = _Parser(prog="offload-train", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="auto",
                    help=f"built-in config ({', '.join(BUILTIN)}; auto = small on a GPU, tiny on a CPU), "
                         "a local directory, or a hub id")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--from-scratch", dest="pretrained", action="store_false",
                   help="random init from the model's config (default for built-in configs and a directory "
                        "without weights)")
    g.add_argument("--pretrained", dest="pretrained", action="store_true",
                   help="load the model's weights (default for a directory with weights, or a hub id)")
    ap.set_defaults(pretrained=None)
    ap.add_argument("--task", choices=("lm", "sft"), default="lm",
                    help="lm: next-token loss on every token of raw text; sft: chat fine-tuning, the loss on the "
                         "assistant turns only, short examples packed without seeing each other (--dataset with a "
                         "'messages' column, or 'prompt' and 'completion'; embedded: questions on the standard "
                         "library answered by its docstrings)")
    ap.add_argument("--dataset", default=data_mod.EMBEDDED,
                    help="'stdlib' (embedded), a datasets hub id, a local dataset directory or a data file")
    ap.add_argument("--text-field", default="text")
    ap.add_argument("--split", default="train")
    ap.add_argument("--streaming", action="store_true")
    ap.add_argument("--tokenizer", default=None, help="HF tokenizer (hub id, directory or tokenizer.json file); "
                                                      "default: the model's, or one trained on the embedded corpus")
    ap.add_argument("--batch-size", type=int, default=None, help="default 8 on a GPU, 4 on a CPU")
    ap.add_argument("--seq-len", type=int, default=None, help="default 512 on a GPU, 64 on a CPU")
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--resident-layers", type=_count_or_auto, default=None, metavar="N|auto",
                    help="keep the lowest N layers of each stack on the GPU, stepped there (offload); auto (the "
                         "default on a GPU; 0 elsewhere): as many as the memory plan of the batch fits on this GPU, "
                         "the layout printed with its reason")
    ap.add_argument("--device-layers", type=_count_or_auto, default=None, metavar="N|auto",
                    help="layer buffers on the GPU per stack (offload): with one per layer the weights stay there "
                         "between a step's micro-batches instead of streaming twice in each; auto (the default on a "
                         "GPU; 2 elsewhere): one per streamed layer when the plan fits them, after the resident layers")
    ap.add_argument("--accumulate-on", choices=("auto", "device", "host"), default="auto",
                    help="where --grad-accum's micro-batches are summed (offload): on the GPU, one gradient copy "
                         "per layer and step, or on the host; auto: the GPU when the sums fit a quarter of its "
                         "free memory")
    ap.add_argument("--steps", type=int, default=None, help="default 200 on a GPU, 60 on a CPU")
    ap.add_argument("--lr", type=float, default=None,
                    help="peak learning rate (default 3e-3 for tiny and small, 3e-4 for every larger model)")
    ap.add_argument("--warmup-steps", type=int, default=None, help="linear warm-up, then cosine decay to 10%%")
    ap.add_argument("--weight-decay", type=float, default=0.0,
                    help="decoupled weight decay of every parameter --no-decay does not name")
    ap.add_argument("--no-decay", default="bias,norm",
                    help="comma-separated name parts: parameters whose name or module class contains one get no "
                         "weight decay (HF Trainer's rule: biases and norm weights); '' decays all")
    ap.add_argument("--lora-r", type=int, default=None,
                    help="train rank-R LoRA adapters (peft) instead of the whole model; the checkpoint is the adapter")
    ap.add_argument("--lora-alpha", type=float, default=None, help="LoRA scale numerator (default 2 x --lora-r)")
    ap.add_argument("--lora-targets", default="q_proj,v_proj", help="comma-separated module names to adapt")
    ap.add_argument("--base-dtype", choices=BASE_DTYPES, default=None,
                    help="with --lora-r: hold the frozen base's linear weights in int8, fp8 or nf4 (bitsandbytes' "
                         "NF4 layout) on the host and in the copies, dequantized to bf16 on the GPU as each layer "
                         "runs (offload)")
    ap.add_argument("--max-grad-norm", type=float, default=None,
                    help="clip by the global gradient norm (native offload: host steps run speculatively during "
                         "backward and are redone exactly when the norm clips; metrics log 'clip')")
    ap.add_argument("--backend", choices=["none", "python", "native"], default=None,
                    help="none = no offload (the model and optimizer on the device); default native, or none where "
                         "it trains on the CPU (no CUDA device, or --device cpu)")
    ap.add_argument("--precision", choices=PRECISIONS, default="bf16",
                    help="bf16 params and moments; bf16-sr: the same, params and exp_avg_sq stored by stochastic "
                         "rounding (seeded by --seed); mixed: fp32 masters and moments on the host; bf16-8bit, "
                         "bf16-8bit-sr: bf16 params (-sr: stochastically rounded), the host's moments in 8 bits "
                         "(about 3 bytes a parameter less than bf16)")
    ap.add_argument("--offload-all", action="store_true",
                    help="also keep the embeddings, final norm and head's grads and optimizer state on the host")
    ap.add_argument("--device", default="auto", help="cuda, cuda:N, cpu, or cpu-sim (offload engine on the "
                                                     "simulated device); auto = cuda if available, else cpu")
    ap.add_argument("--activation-checkpointing", default="all", type=_checkpointing, metavar="all|none|auto|N",
                    help="all: every layer recomputes in backward; none: none does; N: the lowest N of each stack do "
                         "(offload keeps the rest's saved tensors); auto (offload): as many top layers kept as "
                         "--gpu-memory-budget holds, measured in the first step")
    ap.add_argument("--no-activation-checkpointing", dest="activation_checkpointing", action="store_const",
                    const="none", help="the same as --activation-checkpointing none")
    ap.add_argument("--activation-offload", action="store_true",
                    help="offload: the input each checkpointed layer keeps waits in host memory until its backward")
    ap.add_argument("--gpu-memory-budget", default=None, metavar="SIZE",
                    help="--activation-checkpointing auto: the GPU peak it may reach (e.g. 20GB; default what the "
                         "process may allocate, less 5 %% and 1 GiB; needed with --device cpu-sim)")
    ap.add_argument("--compile", action="store_true", help="torch.compile each layer")
    ap.add_argument("--loss-kernel", choices=KERNELS, default="auto",
                    help="cross-entropy of the loss: the extension's kernels (native), torch's, or auto "
                         "(native on CUDA)")
    ap.add_argument("--loss-chunk-tokens", type=int, default=4096,
                    help="tokens per chunk of the vocabulary projection (GPU memory for logits vs speed)")
    ap.add_argument("--tuning", default="", metavar="NAME=VALUE[,...]", type=_tuning,
                    help="the engine's expert switches (EngineTuning), e.g. num_threads=8,device_redo_layers=0: "
                         + "; ".join(f"{f.name} ({f.metadata['valid']})" for f in dataclasses.fields(EngineTuning)
                                     if f.metadata["cli"] == "--tuning"))
    ap.add_argument("--dry-run", action="store_true",
                    help="print this run's memory plan (host RAM pinned and pageable, GPU memory, the largest batch x "
                         "seq that fits) from the model built on the meta device, and exit: 0 if it fits, 2 if not")
    ap.add_argument("--gpu-memory", default=None,
                    help="with --dry-run: plan for a GPU of this size (e.g. 80GB, 139GiB), all of it free; needed for "
                         "--device cuda where there is no GPU")
    ap.add_argument("--host-memory", default=None,
                    help="with --dry-run: plan for a host of this size (e.g. 125GB), all of it available")
    ap.add_argument("--fsdp", action="store_true",
                    help="under torchrun: FSDP2 over the ranks (CPU offload on GPUs), CPUAdamW stepping each shard in "
                         "backward, each rank its own batches, checkpoints gathered on rank 0")
    ap.add_argument("--out", default="runs/offload-train")
    ap.add_argument("--resume", nargs="?", const="latest", default=None, metavar="CHECKPOINT",
                    help="continue the run in --out from its newest complete checkpoint, verified against its "
                         "manifest (a torn one is refused), or from the step directory given (e.g. the previous "
                         "one, --out/checkpoints/step-000010); the flags that shape the run (model, batch, "
                         "layout, precision, schedule: --steps too, which the cosine schedule spans) must be the "
                         "checkpoint's")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace the run --out already holds (its metrics and checkpoints); without it or "
                         "--resume, such an --out is refused")
    ap.add_argument("--save-every", type=int, default=0,
                    help="checkpoint every N steps (always at the end), each into --out/checkpoints/step-N/ "
                         "(from_pretrained loads it; --out/latest points at the newest complete one)")
    ap.add_argument("--keep-checkpoints", type=int, default=2,
                    help="complete checkpoints kept; older ones are deleted once a newer one is whole")
    ap.add_argument("--stop-after", type=int, default=None,
                    help="stop (with a checkpoint) after this many steps of this invocation; the lr schedule "
                         "still spans --steps, and --resume continues (for preemptible jobs)")
    ap.add_argument("--log-every", type=int, default=1)
    ap.add_argument("--report-to", choices=("none", "tensorboard"), default="none",
                    help="also log each metrics row to TensorBoard (--out/tensorboard; pip install tensorboard)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace", action="store_true",
                    help="write a torch.profiler trace (trace.json) and, with offload, the engine's timeline "
                         "(timeline.json; benchmarks/plot_timeline.py draws it) of steps 4-6 to --out")
    ap.add_argument("--debug", action="store_true", help="show the traceback of an error on the inputs")
    args = ap.parse_args(argv)
    check_numbers(args)
    check_report_to(args.report_to)
    return args


def _tuning(text: str) -> dict[str, Any]:
    """--tuning's NAME=VALUE pairs, each value read as its EngineTuning field's type (None, a bool or an int),
    checked by EngineTuning itself when the config is built."""
    known = {f.name for f in dataclasses.fields(EngineTuning) if f.metadata["cli"] == "--tuning"}
    values: dict[str, Any] = {}
    for pair in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = pair.partition("=")
        if not eq or name not in known:
            raise argparse.ArgumentTypeError(f"{pair!r}: expected NAME=VALUE, NAME one of {', '.join(sorted(known))}")
        values[name] = _value(value.strip())
    return values


def _value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("none", "auto"):
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return int(text)
    except ValueError:
        return text  # EngineTuning refuses it, naming the field and its range


def offload_config(args: argparse.Namespace, device: torch.device) -> OffloadConfig:
    """The OffloadConfig these flags ask for (a bad value: a UsageError naming the field and its range)."""
    try:
        tuning = EngineTuning(backend=args.backend if args.backend in ("native", "python") else "native",
                              device_layers=args.device_layers, resident_layers=args.resident_layers,
                              accumulate_on_device=_ACCUMULATE_ON[args.accumulate_on], **args.tuning)
        return OffloadConfig(precision=args.precision, device=device, grad_accum=args.grad_accum,
                             max_grad_norm=args.max_grad_norm, activation_checkpointing=args.activation_checkpointing,
                             activation_offload=args.activation_offload,
                             gpu_memory_budget=parse_size(args.gpu_memory_budget) if args.gpu_memory_budget else None,
                             offload_all=args.offload_all, compile_layers=args.compile, sr_seed=args.seed,
                             base_dtype=args.base_dtype,
                             tuning=tuning)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from exc


def train_config(args: argparse.Namespace, device: torch.device) -> TrainConfig:
    """The TrainConfig of these flags, once set-up has resolved the defaults that depend on the machine."""
    return TrainConfig(offload=offload_config(args, device), offloaded=args.backend != "none", steps=args.steps,
                       warmup_steps=args.warmup_steps, lr=args.lr, weight_decay=args.weight_decay,
                       no_decay=tuple(p.strip() for p in args.no_decay.split(",") if p.strip()), seed=args.seed,
                       loss_chunk_tokens=args.loss_chunk_tokens, loss_kernel=args.loss_kernel, out=args.out,
                       keep_checkpoints=args.keep_checkpoints, adapter_only=args.lora_r is not None,
                       flags=run_flags(args))


def run_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The flags a resume must repeat, as set-up resolved them (before data and model set-up could add to
    `args`): recorded in each checkpoint's manifest and checked by --resume."""
    if getattr(args, "run_flags", None) is None:
        args.run_flags = {k: getattr(args, k, None) for k in prior_run.RESUME_FLAGS}
    return args.run_flags
