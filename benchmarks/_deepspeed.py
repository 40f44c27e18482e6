"""DeepSpeed as bench_train's peer: ZeRO stage 3 with parameters and optimizer states offloaded to pinned
host memory (or stage 2, the optimizer states only), DeepSpeedCPUAdam, one process on one device; or its ZenFlow
and SuperOffload engines (Zero.variant).

Precision, named as the offload_ext modes are: "bf16" keeps bf16 masters, gradients and Adam moments on
the host (bf16_master_weights_and_grads + bf16_optimizer_states, what native-bf16 keeps); "mixed" is
DeepSpeed's stock bf16 recipe, fp32 masters and moments (what native-mixed keeps).

DeepSpeed is imported only when a run starts, so that the benchmark runs without it; every global it
changes (the process group, nn.functional.linear) is put back by release().
"""
from __future__ import annotations

import dataclasses
import gc
import os
import time
from typing import Any, Callable

import torch
from torch import nn

import _common

PRECISIONS = ("bf16", "mixed")
LossFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]
_live: list["ZeroRun"] = []  # engines not yet destroyed, for release() after a failure anywhere


class _LossModule(nn.Module):
    """The model with the benchmark's loss as its forward: ZeRO-3 gathers and releases parameters from
    hooks on the module that the engine calls, so the loss has to run inside that call."""

    def __init__(self, model: nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.lm, self._loss_fn = model, loss_fn

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._loss_fn(self.lm, tokens)


def _init_single_process(backend: str) -> None:
    """A world of one: the env:// rendezvous with this process as rank 0 (no launcher, no MPI probe)."""
    import deepspeed

    if torch.distributed.is_initialized():
        return
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_common.free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)


@dataclasses.dataclass(frozen=True)
class Zero:
    """Which ZeRO: stage 3 (parameters and optimizer state on the host) or 2 (optimizer state only: the weights
    stay on the device), stock or tuned. Tuned sizes the buckets to the model's layers (`layer_numel`), where the
    stock ones (50 M elements to prefetch, 1 B live) were set for models of another shape: fetch the next two
    layers while one computes, keep at most four live, reduce one layer's gradients per bucket, and overlap the
    reduction and the copies with the computation."""

    stage: int = 3
    tuned: bool = False
    layer_numel: int = 0
    # DeepSpeed's newer offload engines, each with the settings its own tutorial gives: "zenflow" (ZeRO-2: the
    # top 5 % of gradients by norm stepped on the device every step, the rest on the host every 4th step, summed
    # meanwhile: not AdamW's rule) or "superoffload" (ZeRO-3 with the weights on the device, 90 % of the optimizer
    # state on the host, stepped by 90 % of the cores; made for CPU-GPU superchips)
    variant: str | None = None

    def __post_init__(self) -> None:
        wanted = {"zenflow": 2, "superoffload": 3}
        if self.variant is not None and wanted.get(self.variant) != self.stage:
            raise ValueError(f"deepspeed: {self.variant!r} runs on ZeRO stage {wanted.get(self.variant, '2 or 3')}, "
                             f"got stage {self.stage}")

    def section(self, offload: dict[str, Any]) -> dict[str, Any]:
        """The zero_optimization section of the config."""
        zero: dict[str, Any] = {"stage": self.stage, "offload_optimizer": dict(offload)}
        if self.variant == "superoffload":
            zero["offload_optimizer"].update(super_offload=True, ratio=0.90, cpuadam_cores_perc=0.90)
        elif self.stage == 3:
            zero["offload_param"] = dict(offload)
        if self.variant == "zenflow":
            zero["zenflow"] = {"topk_ratio": 0.05, "select_strategy": "auto", "select_interval": "auto",
                               "update_interval": 4, "full_warm_up_rounds": 0, "overlap_step": True}
        if self.tuned:
            if self.layer_numel <= 0:
                raise ValueError("deepspeed: a tuned ZeRO needs the elements of one layer (layer_numel > 0)")
            n = self.layer_numel
            zero.update(overlap_comm=True, contiguous_gradients=True, reduce_bucket_size=n)
            if self.stage == 3:
                zero.update(stage3_prefetch_bucket_size=2 * n, stage3_max_live_parameters=4 * n,
                            stage3_max_reuse_distance=4 * n, stage3_param_persistence_threshold=0)
        return zero


def zero_config(batch: int, accum: int, max_grad_norm: float | None, precision: str, zero: Zero = Zero()
                ) -> dict[str, Any]:
    if precision not in PRECISIONS:
        raise ValueError(f"deepspeed: precision must be one of {PRECISIONS}, got {precision!r}")
    if zero.stage not in (2, 3):
        raise ValueError(f"deepspeed: ZeRO stage must be 2 or 3 (optimizer offload), got {zero.stage}")
    bf16: dict[str, Any] = {"enabled": True}
    if precision == "bf16":
        bf16.update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    offload = {"device": "cpu", "pin_memory": True}
    return {
        "train_batch_size": batch,
        "train_micro_batch_size_per_gpu": batch // accum,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": max_grad_norm or 0.0,  # 0 turns clipping off
        "bf16": bf16,
        "zero_optimization": zero.section(offload),
        "steps_per_print": 1 << 30,  # no periodic progress lines in the benchmark's output
        "wall_clock_breakdown": False,
    }


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    """ZeRO-3 places parameters itself; buffers (rotary tables) it leaves where they are."""
    for sub in module.modules():
        for name, buf in sub._buffers.items():
            if buf is not None:
                sub._buffers[name] = buf.to(device)


class ZeroRun:
    """deepspeed.initialize on `model` (host-resident; partitioned to pinned host memory here), and one
    training step at a time with the same semantics as the offload_ext modes: `micro` holds the
    step's micro-batches, the reported loss is their mean, and the optimizer steps once per call."""

    def __init__(self, model: nn.Module, loss_fn: LossFn, *, device: str, batch: int, accum: int,
                 max_grad_norm: float | None, precision: str, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, zero: Zero = Zero()) -> None:
        import deepspeed
        from deepspeed.accelerator import get_accelerator
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from deepspeed.ops.op_builder import CPUAdamBuilder

        accelerator = get_accelerator().device_name()
        if accelerator != device:
            raise RuntimeError(f"deepspeed modes need --device {accelerator} here (DeepSpeed's accelerator), "
                               f"got --device {device}")
        self.engine: Any = None
        self.setup_seconds: dict[str, float] = {}
        t0 = time.perf_counter()
        # DeepSpeedCPUAdam builds its op on first use (a JIT compile, cached afterwards): timed on its own
        CPUAdamBuilder().load()
        t1 = time.perf_counter()
        _init_single_process("nccl" if device == "cuda" else "gloo")
        t2 = time.perf_counter()
        config = zero_config(batch, accum, max_grad_norm, precision, zero)
        wrapped = _LossModule(model, loss_fn)
        here = torch.device(get_accelerator().current_device_name())
        if zero.stage == 3:
            # Partitioned one parameter at a time; left to deepspeed.initialize, a host model is first
            # moved to the device whole, which would put its full size into the measured GPU peak.
            deepspeed.zero.Init(module=wrapped, config_dict_or_path=config, remote_device="cpu", pin_memory=True,
                                dtype=torch.bfloat16)
            _move_buffers(wrapped, here)
        else:  # ZeRO-2 keeps the weights on the device
            wrapped.to(here)
        t3 = time.perf_counter()

        def make_optimizer(params: Any) -> torch.optim.Optimizer:
            return DeepSpeedCPUAdam(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw_mode=True,
                                    fp32_optimizer_states=precision == "mixed")

        client: dict[str, Any] = {"optimizer": make_optimizer}
        if zero.variant is not None:  # each brings its own CPU Adam, which DeepSpeed builds from the config
            config["optimizer"] = {"type": "AdamW", "params": {"lr": lr, "betas": list(betas), "eps": eps,
                                                               "weight_decay": weight_decay}}
            client = {}
        self.engine, *_ = deepspeed.initialize(model=wrapped, model_parameters=wrapped.parameters(), config=config,
                                               **client)
        _live.append(self)
        self.setup_seconds = {"op_load": t1 - t0, "dist_init": t2 - t1, "partition": t3 - t2,
                              "initialize": time.perf_counter() - t3}
        self.accum = accum

    def train_step(self, micro: list[torch.Tensor], sync: Callable[[], None]) -> tuple[float, float, float | None]:
        """(mean loss over the micro-batches, summed synchronised forward seconds, global gradient norm
        before clipping). engine.backward divides by the accumulation steps itself and engine.step()
        steps only on the last micro-batch, so each call is one optimizer step over the same tokens as
        the other modes."""
        if len(micro) != self.accum:
            raise ValueError(f"deepspeed: {len(micro)} micro-batches for gradient_accumulation_steps {self.accum}")
        loss_sum, t_fwd = 0.0, 0.0
        for tokens in micro:
            t0 = time.perf_counter()
            loss = self.engine(tokens)
            sync()
            t_fwd += time.perf_counter() - t0
            self.engine.backward(loss)
            self.engine.step()
            loss_sum += loss.item() / len(micro)
        norm = self.engine.get_global_grad_norm()
        return loss_sum, t_fwd, None if norm is None else float(norm)

    def stats(self) -> dict[str, Any]:
        """Steps DeepSpeed skipped on a non-finite gradient (its bf16 overflow check), and its version."""
        import deepspeed

        return {"skipped_steps": int(self.engine.skipped_steps), "deepspeed": deepspeed.__version__}

    def close(self) -> None:
        if self.engine is not None:
            engine, self.engine = self.engine, None
            engine.destroy()
        if self in _live:
            _live.remove(self)


def _clear_lru_caches(cls: type) -> None:
    """Empty the functools.lru_cache of each method of `cls`, also under a decorator that closes over it."""
    for fn in vars(cls).values():
        cells = getattr(fn, "__closure__", None) or ()
        for f in (fn, *(c.cell_contents for c in cells if c.cell_contents is not None)):
            if callable(getattr(f, "cache_clear", None)):
                f.cache_clear()


def release() -> None:
    """Undo what the runs left behind, also after a failed one: their engines, the process group, ZeRO-3's
    replacement of nn.functional.linear (which outlives the engine) and the device memory cached. Call
    it with no engine in use."""
    while _live:
        _live[0].close()
    try:
        import deepspeed.comm as dist
        from deepspeed.runtime.zero import parameter_offload
        from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as Init
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
    except ImportError:
        return
    # Two references that engine.destroy() leaves, each of which keeps the engine, its pinned host
    # partitions and its device buffers alive: ZeRO-3's module-level stack of top modules, and the
    # class-wide lru_cache of its parameter coordinator, keyed by modules.
    parameter_offload.FWD_MODULE_STACK.clear()
    _clear_lru_caches(PartitionedParameterCoordinator)
    if torch.distributed.is_initialized():
        dist.destroy_process_group()
    original = getattr(Init, "linear_bk", None)
    if original is not None:
        torch.nn.functional.linear = original
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
