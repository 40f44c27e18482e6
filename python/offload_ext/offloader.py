"""Offloader: streams a model's layer stacks from host memory through a few device buffers, and owns
the optimizer (host AdamW for streamed layers, a device AdamW for everything else).

Hooks are backend-agnostic: each streamed layer's forward is wrapped (activation checkpointing
plus the "layer i is about to run" hook, which also fires in checkpoint recompute), and every
trainable streamed parameter has a post-accumulate-grad hook that gathers its gradient into the
layer's flat device buffer and, with the layer's last one, sends it to the host.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .backends import Hyper, LayerBuffers, make_backend
from .stacks import find_layer_stacks

_PRECISIONS = ("bf16", "mixed")


@dataclass
class _Slot:
    param: nn.Parameter
    offset: int
    numel: int
    shape: torch.Size


@dataclass
class _Stack:
    name: str
    layers: list[nn.Module]
    host: list[LayerBuffers] = field(default_factory=list)
    slots: list[list[_Slot]] = field(default_factory=list)   # per layer: trainable first, then frozen
    trainable: list[int] = field(default_factory=list)      # per layer: number of trainable params
    unit: list[int] = field(default_factory=list)           # per layer: global layer index in the backend
    dev_params: list[torch.Tensor] = field(default_factory=list)  # device_layers buffers: layer i uses i % n
    dev_grads: list[torch.Tensor] = field(default_factory=list)   # two (one for the unit outside the stacks)
    resident: list[int | None] = field(default_factory=list)      # per buffer: the layer it holds
    loaded: list[Any] = field(default_factory=list)               # per buffer: its copy's event
    grads_free: list[Any] = field(default_factory=list)
    received: list[set[int]] = field(default_factory=list)   # per layer: offsets whose grad arrived


_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


def _without_kv_cache(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A checkpointed layer must not write a KV cache: its recompute would append the same keys again
    (and a training step has no use for the cache). HF's own checkpointing drops it the same way."""
    if not any(kwargs.get(k) is not None for k in _CACHE_KWARGS) and not kwargs.get("use_cache"):
        return kwargs
    kwargs = {k: (None if k in _CACHE_KWARGS else v) for k, v in kwargs.items()}
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    return kwargs


def _resolve_device(device: str | torch.device) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"Offloader: device={str(device)!r} but CUDA is not available here "
                               "(torch.cuda.is_available() is False); use device='cpu' for the simulated device")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ValueError(f"Offloader: device must be 'cuda', 'cuda:N' or 'cpu' (simulated), got {device!r}")
    return dev


class Offloader:
    """Full CPU offload of a model's layer stacks for training on one device.

    off = Offloader(model, lr=3e-4, precision="bf16", backend="native", device="cuda")
    loss = loss_fn(model(batch)); off.backward(loss); off.step(); off.zero_grad()
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float = 3e-4,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        precision: str = "bf16",
        backend: str = "native",
        device: str | torch.device = "cuda",
        *,
        compile_layers: bool = False,
        num_threads: int | None = None,
        pin_threads: bool = True,
        grad_slots: int | None = None,
        device_layers: int = 2,
        offload_all: bool = False,
        grad_accum: int = 1,
        max_grad_norm: float | None = None,
        async_step: bool | None = None,
    ) -> None:
        if precision not in _PRECISIONS:
            raise ValueError(f"Offloader: precision must be one of {_PRECISIONS}, got {precision!r}")
        if grad_accum < 1:
            raise ValueError(f"Offloader: grad_accum must be >= 1 (backward() calls per step()), got {grad_accum}")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"Offloader: max_grad_norm must be > 0 (or None for no clipping), got {max_grad_norm}")
        if grad_slots is not None and grad_slots < 1:
            raise ValueError(f"Offloader: grad_slots must be >= 1 (pinned gradient staging slots), got {grad_slots}")
        if device_layers < 2:
            raise ValueError(f"Offloader: device_layers must be >= 2 (one layer computes while the next is "
                             f"copied), got {device_layers}")
        if async_step and backend == "python":
            raise ValueError("Offloader: async_step=True needs backend='native'; the python backend steps every "
                             "layer inside step(), after backward, by design")
        self.device = _resolve_device(device)
        stacks = find_layer_stacks(model)
        if not stacks:
            raise ValueError(
                f"Offloader: found no layer stack in {type(model).__name__}: expected an nn.ModuleList or "
                "nn.Sequential of two or more layers of one type (like model.model.layers in HF Llama)")
        self.model = model
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.precision = precision
        self.backend_name = backend
        self.last_step_wait = 0.0
        self._step = 0
        self.grad_accum = grad_accum
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm: float | None = None
        self._micro = 0  # backward() calls since the last step(); > 0: host steps may be pending
        self._closed = False
        self._hooks: list[Any] = []
        self._compile = compile_layers
        self._hf_checkpointing = bool(getattr(model, "is_activation_checkpointing",
                                              getattr(model, "is_gradient_checkpointing", False)))
        if self._hf_checkpointing:
            model.gradient_checkpointing_disable()  # the Offloader checkpoints each layer itself
        self._backend = make_backend(backend, self.device, precision, num_threads=num_threads,
                                     pin_threads=pin_threads, grad_slots=grad_slots,
                                     accumulate=grad_accum > 1 or max_grad_norm is not None,
                                     async_step=async_step is not False)
        stacked = {id(p) for _, s in stacks for p in s.parameters()}
        self._layer_count = 0
        self.device_layers = device_layers
        t0 = time.perf_counter()
        self._stacks = [self._plan(name, list(stack), [list(l.parameters()) for l in stack])
                        for name, stack in stacks]
        # offload_all: everything outside the stacks becomes one more host unit; its bf16 weights stay
        # on the device (they are used throughout), its grads and optimizer state live on the host.
        self._host_outer: _Stack | None = None
        rest = [p for p in model.parameters() if id(p) not in stacked]
        if offload_all and rest:
            self._host_outer = self._plan("outside the stacks", [model], [rest])
            stacked |= {id(p) for p in rest}
        own = self._sizes(self._host_outer) if self._host_outer else []
        self._backend.prepare([size for stack in self._stacks for size in self._sizes(stack)], own)
        t1 = time.perf_counter()
        for stack in self._stacks:
            self._fill(stack, device_buffers=min(len(stack.layers), device_layers))
        if self._host_outer is not None:
            self._fill(self._host_outer, device_buffers=1, own_grads=True)  # bound by _prefetch_first
        t2 = time.perf_counter()
        self._outer, self._outer_masters, self._outer_opt = self._move_outer(model, stacked)
        self.setup_seconds = {"pin": t1 - t0, "fill": t2 - t1, "outer_to_device": time.perf_counter() - t2}
        for stack in self._stacks:
            for i, layer in enumerate(stack.layers):
                self._wrap_layer(stack, i, layer)
                self._hook_grads(stack, i)
        if self._host_outer is not None:
            self._hook_grads(self._host_outer, 0)
        self._prefetch_first()

    # ------------------------------------------------------------------ layout

    def _plan(self, name: str, layers: list[nn.Module], params_per_layer: list[list[nn.Parameter]]) -> _Stack:
        """Order each layer's parameters (trainable first) and give each its offset in the flat buffer."""
        stack = _Stack(name, layers)
        for params in params_per_layer:
            ordered = [p for p in params if p.requires_grad] + [p for p in params if not p.requires_grad]
            slots, offset = [], 0
            for p in ordered:
                slots.append(_Slot(p, offset, p.numel(), p.shape))
                offset += p.numel()
            stack.slots.append(slots)
            stack.trainable.append(sum(p.requires_grad for p in params))
        return stack

    @staticmethod
    def _sizes(stack: _Stack) -> list[tuple[int, int]]:
        """(numel, trainable numel) per layer."""
        return [(sum(s.numel for s in slots), sum(s.numel for s in slots[:t]))
                for slots, t in zip(stack.slots, stack.trainable)]

    def _fill(self, stack: _Stack, device_buffers: int, own_grads: bool = False) -> None:
        """Move each layer's values into its host buffers; the module keeps empty device placeholders.
        The device gets `device_buffers` layer buffers for params and up to two for gradients."""
        for slots, t, (n, trainable) in zip(stack.slots, stack.trainable, self._sizes(stack)):
            host = self._backend.new_layer(n, trainable, own_grads=own_grads)
            for k, s in enumerate(slots):
                src = s.param.detach().reshape(-1)
                host.params[s.offset:s.offset + s.numel].copy_(src)
                if host.master is not None and k < t:
                    host.master[s.offset:s.offset + s.numel].copy_(src)
                s.param.data = torch.empty(0, dtype=torch.bfloat16, device=self.device)
            stack.host.append(host)
            stack.received.append(set())
        sizes = self._sizes(stack)
        stack.dev_params = [self._backend.device_buffer(max(n for n, _ in sizes)) for _ in range(device_buffers)]
        stack.dev_grads = [self._backend.device_buffer(max(1, max(t for _, t in sizes)))
                           for _ in range(min(2, device_buffers))]
        stack.resident, stack.loaded = [None] * device_buffers, [None] * device_buffers
        stack.grads_free = [None] * len(stack.dev_grads)
        stack.unit = list(range(self._layer_count, self._layer_count + len(stack.layers)))
        self._layer_count += len(stack.layers)

    def _move_outer(self, model: nn.Module, stacked: set[int]):
        outer = [p for p in model.parameters() if id(p) not in stacked]
        masters = []
        for p in outer:
            if self.precision == "mixed" and p.requires_grad:
                masters.append(p.detach().to(self.device, torch.float32, copy=True))
            p.data = p.data.to(self.device, torch.bfloat16)
        model.to(self.device)  # buffers; the streamed parameters are already device placeholders
        trainable = masters if self.precision == "mixed" else [p for p in outer if p.requires_grad]
        opt = None
        if trainable:
            opt = torch.optim.AdamW(trainable, lr=self.lr, betas=self.betas, eps=self.eps,
                                    weight_decay=self.weight_decay, fused=True)
        return outer, masters, opt

    # ------------------------------------------------------------------ hooks

    def _wrap_layer(self, stack: _Stack, i: int, layer: nn.Module) -> None:
        inner = layer.forward
        compiled = torch.compile(inner) if self._compile else inner

        def run(*args: Any, **kwargs: Any) -> Any:
            self._before_layer(stack, i)
            return compiled(*args, **kwargs)

        def forward(*args: Any, **kwargs: Any) -> Any:
            if torch.is_grad_enabled():
                # Recompute is required: saved activations would point at buffers since refilled.
                return checkpoint(run, *args, use_reentrant=False, **_without_kv_cache(kwargs))
            return run(*args, **kwargs)

        layer.forward = forward  # instance attribute; close() deletes it

    @staticmethod
    def _slot(stack: _Stack, i: int) -> int:
        """The device buffer layer i is loaded into."""
        return i % len(stack.dev_params)

    def _load(self, stack: _Stack, i: int) -> None:
        slot = self._slot(stack, i)
        dst = stack.dev_params[slot][: stack.host[i].params.numel()]
        stack.loaded[slot] = self._backend.load(stack.unit[i], stack.host[i], dst)
        stack.resident[slot] = i

    def _bind(self, stack: _Stack, i: int) -> None:
        """Make layer i resident in its device buffer and point its parameters there."""
        slot = self._slot(stack, i)
        if stack.resident[slot] != i:
            self._load(stack, i)
        self._backend.compute_wait(stack.loaded[slot])
        buf = stack.dev_params[slot]
        for s in stack.slots[i]:
            s.param.data = buf[s.offset:s.offset + s.numel].view(s.shape)

    def _before_layer(self, stack: _Stack, i: int) -> None:
        recompute = torch._C._current_graph_task_id() != -1  # inside backward: checkpoint recompute
        self._bind(stack, i)
        nxt = i - 1 if recompute else i + 1
        # A layer whose host step is still running is loaded by its own hook instead, after this
        # layer's kernels are launched: waiting here would hold them back.
        if (0 <= nxt < len(stack.layers) and stack.resident[self._slot(stack, nxt)] != nxt
                and self._backend.ready(stack.unit[nxt])):
            self._load(stack, nxt)

    def _hook_grads(self, stack: _Stack, i: int) -> None:
        for s in stack.slots[i][: stack.trainable[i]]:
            self._hooks.append(s.param.register_post_accumulate_grad_hook(
                lambda p, s=s: self._on_grad(stack, i, s, p)))

    def _on_grad(self, stack: _Stack, i: int, s: _Slot, p: nn.Parameter) -> None:
        slot = i % len(stack.dev_grads)
        if not stack.received[i] and stack.grads_free[slot] is not None:
            self._backend.compute_wait(stack.grads_free[slot])  # the slot's last D2H has landed
        stack.dev_grads[slot][s.offset:s.offset + s.numel].copy_(p.grad.reshape(-1))
        p.grad = None
        stack.received[i].add(s.offset)
        if len(stack.received[i]) == stack.trainable[i]:
            stack.received[i].clear()
            src = stack.dev_grads[slot][: stack.host[i].trainable]
            stack.grads_free[slot] = self._backend.flush_grads(stack.unit[i], stack.host[i], src)

    # ------------------------------------------------------------------ training API

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("Offloader: already closed; build a new Offloader to train again")

    def _hyper(self) -> Hyper:
        return Hyper(self.lr, self.betas[0], self.betas[1], self.eps, self.weight_decay, self._step + 1)

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), with each streamed layer stepped on the host as soon as its grads land.

        With grad_accum=N, call it N times per step(): the first N-1 only sum each layer's gradients on
        the host; the N-th steps each layer as its summed gradients are complete. With max_grad_norm,
        every layer's gradients are kept until step(), which clips by the global norm and then steps.
        """
        self._check_open()
        if self._micro == self.grad_accum:
            raise RuntimeError(f"Offloader: backward() called {self._micro + 1} times without step(), with "
                               f"grad_accum={self.grad_accum}; call step() after every {self.grad_accum} "
                               "backward() calls, or build the Offloader with a larger grad_accum")
        self._micro += 1
        self._backend.begin_step(self._hyper())
        # Clipping needs the global norm first: then no layer is stepped during backward.
        last = self._micro == self.grad_accum and self.max_grad_norm is None
        self._backend.begin_micro(first=self._micro == 1, last=last)
        loss.backward()

    def step(self) -> None:
        """Finish the host steps of this backward, step the device parameters, prefetch layer 0.

        With async_step (the native default), layers still being stepped on the host when this returns
        finish in the background; each layer's next use (forward, state_dict, close) waits for its own.
        """
        self._check_open()
        if self._micro == 0:
            raise RuntimeError("Offloader: step() without a preceding backward()")
        if self._micro != self.grad_accum:
            raise RuntimeError(f"Offloader: step() after {self._micro} backward() calls, with grad_accum="
                               f"{self.grad_accum}: every step sums exactly grad_accum micro-batches")
        self.last_step_wait = self._backend.finish_step()
        self._check_grads_complete()
        if self.max_grad_norm is not None:
            self._clip_and_step_host()
        if self._outer_opt is not None:
            self._step_outer()
        self._step += 1
        self._micro = 0
        self._prefetch_first()

    def _units(self) -> list[_Stack]:
        """Every group of host-stepped parameters: the stacks, and the rest under offload_all."""
        return self._stacks + ([self._host_outer] if self._host_outer is not None else [])

    def _check_grads_complete(self) -> None:
        names = {id(p): n for n, p in self.model.named_parameters()}
        for stack in self._units():
            for i, received in enumerate(stack.received):
                if received:
                    count = len(received)
                    missing = [names.get(id(s.param), "?") for s in stack.slots[i][: stack.trainable[i]]
                               if s.offset not in received]
                    received.clear()
                    raise RuntimeError(
                        f"Offloader: {stack.name} [{i}] got gradients for only {count} of its "
                        f"{stack.trainable[i]} trainable parameters (none for {missing[:4]}); freeze "
                        "parameters that take no part in the loss (p.requires_grad_(False)) before building "
                        "the Offloader")

    def _clip_and_step_host(self) -> None:
        """torch.nn.utils.clip_grad_norm_ over every parameter, then the host steps (after backward)."""
        device_grads = [p.grad for p in self._outer if p.grad is not None]
        sq = self._backend.grad_sq_norm() + sum(float(g.double().pow(2).sum()) for g in device_grads)
        self.last_grad_norm = math.sqrt(sq)
        scale = min(1.0, self.max_grad_norm / (self.last_grad_norm + 1e-6))
        self._backend.clipped_step(scale)
        for g in device_grads:
            g.mul_(scale)

    def _step_outer(self) -> None:
        group = self._outer_opt.param_groups[0]
        group.update(lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)
        if self.precision == "mixed":
            trainable = [p for p in self._outer if p.requires_grad]
            for p, m in zip(trainable, self._outer_masters):
                m.grad = p.grad.float() if p.grad is not None else None
            self._outer_opt.step()
            with torch.no_grad():
                for p, m in zip(trainable, self._outer_masters):
                    p.copy_(m)
        else:
            self._outer_opt.step()

    def zero_grad(self) -> None:
        """Streamed layers' grads are consumed by their hooks; this clears the device parameters'."""
        for p in self._outer:
            p.grad = None
        for m in self._outer_masters:
            m.grad = None

    def _prefetch_first(self) -> None:
        for stack in self._units():
            stack.resident = [None] * len(stack.dev_params)  # host params changed: device copies are stale
            if self._backend.ready(stack.unit[0]):
                self._load(stack, 0)
        if self._host_outer is not None:
            self._bind(self._host_outer, 0)  # used from the first op on: the compute stream waits for it

    # ------------------------------------------------------------------ state

    def _settle(self) -> None:
        """Between steps, with every host step finished: the host buffers may be read or written."""
        if self._micro:
            raise RuntimeError("Offloader: call step() before saving, loading or closing")
        self._backend.settle()

    def state_dict(self) -> dict[str, Any]:
        self._check_open()
        self._settle()
        layers = []
        for stack in self._units():
            for b in stack.host:
                layers.append({"params": b.params.clone(), "exp_avg": b.exp_avg.clone(),
                               "exp_avg_sq": b.exp_avg_sq.clone(),
                               "master": b.master.clone() if b.master is not None else None})
        # Copies, not views: the state must not change when training goes on.
        outer = {
            "params": [p.detach().to("cpu", copy=True) for p in self._outer],
            "masters": [m.detach().to("cpu", copy=True) for m in self._outer_masters],
            "optimizer": copy.deepcopy(self._outer_opt.state_dict()) if self._outer_opt is not None else None,
        }
        return {"step": self._step, "precision": self.precision, "lr": self.lr, "layers": layers, "outer": outer}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_open()
        self._settle()
        if state["precision"] != self.precision:
            raise ValueError(f"Offloader: state is for precision {state['precision']!r}, this Offloader uses "
                             f"{self.precision!r}")
        buffers = [b for stack in self._units() for b in stack.host]
        if len(state["layers"]) != len(buffers):
            raise ValueError(f"Offloader: state has {len(state['layers'])} layers, the model {len(buffers)}")
        for b, saved in zip(buffers, state["layers"]):
            for key in ("params", "exp_avg", "exp_avg_sq", "master"):
                dst = getattr(b, key)
                if dst is None:
                    continue
                if saved[key].shape != dst.shape:
                    raise ValueError(f"Offloader: saved {key} of shape {tuple(saved[key].shape)} does not fit "
                                     f"{tuple(dst.shape)}: was the state made for another model?")
                dst.copy_(saved[key])
        with torch.no_grad():
            for p, saved in zip(self._outer, state["outer"]["params"]):
                p.copy_(saved)
            for m, saved in zip(self._outer_masters, state["outer"]["masters"]):
                m.copy_(saved)
        if self._outer_opt is not None and state["outer"]["optimizer"] is not None:
            self._outer_opt.load_state_dict(state["outer"]["optimizer"])
        self._step = int(state["step"])
        self.lr = state["lr"]
        self._prefetch_first()

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's weights by name, as CPU tensors (streamed ones read from the host buffers)."""
        self._settle()
        streamed = {}
        for stack in self._units():
            for slots, b in zip(stack.slots, stack.host):
                for s in slots:
                    streamed[id(s.param)] = b.params[s.offset:s.offset + s.numel].view(s.shape)
        out = {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            out[name] = streamed[id(p)].clone() if id(p) in streamed else p.detach().cpu()
        for name, buf in self.model.named_buffers():
            out[name] = buf.detach().cpu()
        return out

    def stats(self) -> dict[str, Any]:
        setup = {f"setup_{k}_s": v for k, v in self.setup_seconds.items()}
        return {"step": self._step, "last_step_wait_s": self.last_step_wait, "host_wait_s": self._backend.wait_seconds(),
                **setup, **self._backend.stats()}

    def close(self) -> None:
        """Detach from the model: it becomes an ordinary module on the CPU holding its current weights."""
        if self._closed:
            return
        self._settle()
        self._backend.close()
        weights = self.model_state_dict()
        for h in self._hooks:
            h.remove()
        for stack in self._stacks:
            for layer in stack.layers:
                layer.__dict__.pop("forward", None)
        named = dict(self.model.named_parameters(remove_duplicate=False))
        for name, p in named.items():
            p.data = weights[name]
        self.model.to("cpu")
        if self._hf_checkpointing:
            self.model.gradient_checkpointing_enable()
        self._closed = True

    def __enter__(self) -> "Offloader":
        return self

    def __exit__(self, *exc: object) -> None:
        if self._micro and exc[0] is not None:
            self._backend.finish_step()  # drain: an exception mid-step must not leave threads writing
            self._micro = 0

        self.close()
