"""Tiny models and reference training for the Offloader tests."""
from __future__ import annotations

import contextlib
import copy
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator

import torch
from torch import nn

import offload_ext


def tiny_llama(layers: int = 4, hidden: int = 64) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def tiny_gpt2(layers: int = 3) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=128, n_embd=64, n_layer=layers, n_head=4, n_positions=64,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def batches(n: int, batch: int = 2, seq: int = 16, vocab: int = 128) -> list[torch.Tensor]:
    return [torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(k)) for k in range(n)]


def flat_tensors(obj) -> list[torch.Tensor]:
    """Every tensor in a nest of dicts, lists and tuples (a state_dict), in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else []
    return [t for item in items for t in flat_tensors(item)]


def to_bf16_params(model: nn.Module) -> nn.Module:
    """Parameters to bf16, buffers untouched: what the Offloader does."""
    for p in model.parameters():
        p.data = p.data.bfloat16()
    return model


def reference_training(base: nn.Module, data, precision: str, lr: float, wd: float, device: str = "cpu",
                       micro_batches: int = 1, max_grad_norm: float | None = None, norms: list | None = None,
                       exact_clip: bool = False, fp32_norms: list | None = None, lr_lambda=None, group_of=None,
                       checkpointing: bool = True):
    """The same model trained without offload: torch's fused AdamW, fp32 masters in "mixed"; with
    micro_batches > 1, gradients accumulate in the params' .grad over that many batches per step.
    With max_grad_norm, `norms` collects each step's norm by the rule used (exact_clip: clip_grad_norm_'s
    rule summed in float64; else torch's clip_grad_norm_ on the bf16 grads), and `fp32_norms` torch's own
    total norm over fp32 copies of the same gradients, before clipping. `lr_lambda` drives a LambdaLR
    schedule stepped after every optimizer step. `group_of(name)` gives a parameter's hyperparameter
    overrides (e.g. {"weight_decay": 0.0}): parameters with the same overrides share a torch param group.
    `checkpointing`: HF's activation checkpointing on (as the Offloader's default) or off."""
    model = copy.deepcopy(base)
    masters = [p.detach().float().clone().requires_grad_() for p in model.parameters() if p.requires_grad]
    to_bf16_params(model).to(device)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    if precision == "mixed":
        masters = [m.to(device).detach().requires_grad_() for m in masters]
        stepped = masters
    else:
        stepped = [p for p in model.parameters() if p.requires_grad]
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for name, s in zip(names, stepped):
        buckets.setdefault(tuple(sorted((group_of(name) if group_of else {}).items())), []).append(s)
    opt = torch.optim.AdamW([{"params": v, **dict(k)} for k, v in buckets.items()], lr=lr, weight_decay=wd,
                            fused=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda) if lr_lambda is not None else None
    if checkpointing:
        offload_ext.enable_activation_checkpointing(model)
    losses = []
    for k, x in enumerate(data):
        x = x.to(device)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        losses.append(loss.item())
        if k % micro_batches != micro_batches - 1:
            continue
        if max_grad_norm is not None:
            grads = [p.grad for p in model.parameters() if p.requires_grad]
            if fp32_norms is not None:
                fp32_norms.append(float(torch.nn.utils.get_total_norm([g.float() for g in grads])))
            if exact_clip:  # clip_grad_norm_'s rule with the norm summed in float64 (as the engine does)
                norm = sum(float(g.double().pow(2).sum()) for g in grads) ** 0.5
                for g in grads:
                    g.mul_(min(1.0, max_grad_norm / (norm + 1e-6)))
            else:
                norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad],
                                                      max_grad_norm)
            if norms is not None:
                norms.append(float(norm))
        if precision == "mixed":
            trainable = [p for p in model.parameters() if p.requires_grad]
            for p, m in zip(trainable, masters):
                m.grad = p.grad.float()
            opt.step()
            with torch.no_grad():
                for p, m in zip(trainable, masters):
                    p.copy_(m)
        else:
            opt.step()
        if schedule is not None:
            schedule.step()
        model.zero_grad(set_to_none=True)
    return losses, model


def offloaded_training(off, model: nn.Module, data, device: str = "cpu", norms: list | None = None,
                       schedule=None) -> list[float]:
    """Train through an Offloader: off.grad_accum batches per step; norms collects off.last_grad_norm;
    `schedule` (an LR scheduler over `off`) is stepped after every step."""
    losses = []
    for k, x in enumerate(data):
        x = x.to(device)
        loss = model(input_ids=x, labels=x).loss
        off.backward(loss)
        losses.append(loss.item())
        if k % off.grad_accum == off.grad_accum - 1:
            off.step()
            off.zero_grad()
            if schedule is not None:
                schedule.step()
            if norms is not None:
                norms.append(off.last_grad_norm)
    return losses


def torchrun(ranks: int, *args: str, env: dict[str, str] | None = None, cwd=None, check: bool = True,
             preexec_fn: Callable[[], None] | None = None) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run` with `ranks` local processes on `args`, one thread each. --standalone: its
    store binds a port it picks itself, where a port found free beforehand may be taken before the store binds it.
    With `check`, a failure asserts with the ranks' last output: a rank's error is in it, not in the exit status
    alone."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), *args]
    done = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, cwd=cwd,
                          capture_output=True, text=True, preexec_fn=preexec_fn)
    assert not check or done.returncode == 0, \
        f"torchrun exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done


def file_size_limit(limit: int) -> Callable[[], None]:
    """For a child process (preexec_fn): files it and its children write may not pass `limit` bytes (a write past it
    fails with EFBIG, as a full disk's fails with ENOSPC), the signal that would kill it ignored."""
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    return apply


@contextlib.contextmanager
def gloo_mesh(rank: int, world: int, store: str) -> Iterator:
    """A gloo process group of `world` CPU ranks (this one `rank`) met at the file `store`, and its 1-D device mesh,
    torn down on exit."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        yield init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()


def spawn_ranks(worker, world: int, *args) -> None:
    """worker(rank, world, store, *args) on `world` spawned processes, each ended by _run_then_exit. The ranks meet
    at a file store (a fresh path): no TCP port to find free and lose to another process before binding it."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_run_then_exit, args=(worker, world, os.path.join(d, "store"), *args), nprocs=world, join=True)


def _run_then_exit(rank: int, worker, world: int, store: str, *args) -> None:
    # Once the worker has returned (its results saved), the rank leaves without the interpreter's
    # finalization: there, a gloo worker thread may drop its last collective's tensors, take the GIL of
    # a finalizing interpreter and abort the process ("terminate called without an active exception";
    # the core of a failed run: ProcessGroupGloo::runLoop -> ~AsyncWork -> decref -> PyThread_exit_thread),
    # about 1 run in 25 of the two-rank tests. A failure inside the worker still raises before this.
    worker(rank, world, store, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def shard_linears(model: nn.Module, mesh) -> nn.Module:
    """fully_shard each Linear of a Sequential, then the whole."""
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def held_in(fmt: str, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the storage, the dequantized bf16 weight) of `w` held in a quantized base format `fmt`."""
    from offload_ext.models.quantized_base import dequantize, quantize_into, stored_elements

    storage = torch.empty(stored_elements(fmt, w.shape), dtype=torch.bfloat16)
    quantize_into(fmt, w, storage)
    out = torch.empty(w.shape, dtype=torch.bfloat16)
    dequantize(fmt, w.shape, storage, out)
    return storage, out


def base_dequantized(model: nn.Module, fmt: str) -> nn.Module:
    """A copy of a peft LoRA model whose layers' frozen linear weights are what `fmt` holds of them, in bf16."""
    out = copy.deepcopy(model)
    for layer in out.base_model.model.model.layers:
        for m in layer.modules():
            if isinstance(m, nn.Linear) and not m.weight.requires_grad:
                m.weight.data = held_in(fmt, m.weight.detach().bfloat16())[1]
    return out
