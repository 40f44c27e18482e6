"""Offloader: streams a model's layer stacks from host memory through a few device buffers, and owns
the optimizer (host AdamW for streamed layers, a device AdamW for everything else).

It composes the parts, each in its own module: the layout (what is streamed, where each parameter
lives in its unit's flat buffers), the host fill, the device ring (which layer each device buffer
holds), the gradient path (hooks that gather and flush each unit's gradients), the step policy (when a
unit may be stepped), the device optimizer for the rest, and the state. Hooks never know which
backend runs. It is a torch.optim.Optimizer, so torch's LR schedulers drive its `param_groups`.
"""
from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from offload_ext.config import OffloadConfig, check_hyper, device_precision, resolve_device, stochastic
from offload_ext.engine.activation_offload import HostActivations
from offload_ext.engine.backends import Backend, Hyper, LayerBuffers, make_backend
from offload_ext.engine.backward import BackwardHooks
from offload_ext.engine.host_fill import fill_unit
from offload_ext.engine.kept_layers import (
    SavedWeights,
)
from offload_ext.engine.layers import (
    disable_activation_checkpointing,
    enable_activation_checkpointing,
    hf_checkpointing_enabled,
    unwrap_layer,
)
from offload_ext.engine.persistence import StateIO
from offload_ext.engine.redo_tuning import RedoTuning
from offload_ext.engine.state import (
    model_weights,
)
from offload_ext.engine.step_policy import StepPolicy
from offload_ext.engine.timeline import Timeline, span
from offload_ext.engine.wiring import LayerWiring
from offload_ext.models.weight_source import WeightSource, check_materialized, make_real, materialize
from offload_ext.optim.device_optimizer import DeviceOptimizer
from offload_ext.planning.auto_layout import LayoutChoice, planned_layout
from offload_ext.planning.choices import Settings, check_checkpointing, checkpointed_count, choose
from offload_ext.planning.host_sizes import available_host_bytes
from offload_ext.planning.layout import GroupOf, Layout
from offload_ext.planning.param_groups import HYPER_KEYS, build_groups
from offload_ext.planning.plan import check_device_memory
from offload_ext.planning.plan import machine as plan_machine


class Offloader(BackwardHooks, LayerWiring, StateIO, torch.optim.Optimizer):
    """Full CPU offload of a model's layer stacks for training on one device.

    off = Offloader(model, lr=3e-4, config=OffloadConfig(precision="bf16", device="cuda"))
    loss = loss_fn(model(batch)); off.backward(loss); off.step(); off.zero_grad()

    `lr`, `betas`, `eps`, `weight_decay` are AdamW's; `groups` (param-group specs) and `no_decay` (name
    patterns kept out of weight decay) build the param groups; `weights` is where meta parameters get their
    values. `batch_shape` (batch_size, seq_len): on a GPU, the micro-batch of causal_lm_loss whose memory plan
    chooses the layout (resident layers, device buffers) as offload-train's default does, unless the config names
    one (`layout_choice` keeps the choice and its reason). `config` (an OffloadConfig) is everything else; any of
    its fields, or of its EngineTuning, may instead be given by name as a keyword (`Offloader(model,
    precision="mixed", device="cpu")`): they are applied on top of `config`, and an unknown name is refused. See
    docs/api.md for every field.

    With max_grad_norm the global norm is clipped as torch.nn.utils.clip_grad_norm_ does; a non-finite norm
    raises FloatingPointError as clip_grad_norm_(error_if_nonfinite=True) does, never an unscaled step, and
    leaves the Offloader failed (the layers that stepped speculatively keep that step): close() it and resume.
    Any error a step ends in leaves it failed the same way: every later call raises it until close(), which
    returns whatever failed.
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float = 3e-4,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        config: OffloadConfig | None = None,
        *,
        groups: Sequence[dict[str, Any]] | None = None,
        no_decay: Sequence[str] = (),
        weights: WeightSource | None = None,
        batch_shape: tuple[int, int] | None = None,
        **options: Any,
    ) -> None:
        cfg = OffloadConfig.from_options(config, **options)  # raises on an unknown or out-of-range option
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        specs, group_of = build_groups(model, groups, no_decay)
        # the layout offload-train chooses by default, planned for the micro-batch the caller names
        self.layout_choice = _planned(model, cfg, batch_shape, group_of)
        if self.layout_choice is not None:
            cfg = cfg.replace(resident_layers=self.layout_choice.resident_layers,
                              device_layers=self.layout_choice.device_layers)
        t = cfg.tuning
        for spec in specs:
            check_hyper(**(defaults | {k: v for k, v in spec.items() if k != "params"}))
        if not any(p.requires_grad for p in model.parameters()):
            raise ValueError("Offloader: the model has no trainable parameters (every requires_grad is False)")
        self.config = cfg
        self.device = resolve_device(cfg.device)
        settings = Settings(cfg)
        choices = choose(model, settings, self.device, group_of)
        self.layout: Layout = choices.layout
        check_checkpointing(cfg.activation_checkpointing, self.layout.fewest_stack_layers, cfg.gpu_memory_budget,
                            self.device)
        super().__init__(specs, defaults)
        self.model = model
        self.precision, self.backend_name = cfg.precision, t.backend
        # saved with the state: a resume continues the rounding stream
        self._sr_seed = cfg.sr_seed if stochastic(cfg.precision) else None
        self.last_step_wait = 0.0
        self._step = 0
        self._closed = False
        self._detached = False
        self._close_failure: str | None = None
        self._failed: str | None = None  # the error a step ended in: every later call raises it until close()
        self._timeline: Timeline | None = None
        rule = choices.rule
        self._policy = StepPolicy(rule.grad_accum, rule.max_grad_norm, rule.speculative, rule.sums_on_device)
        self._hf_checkpointing = hf_checkpointing_enabled(model)
        if self._hf_checkpointing:
            disable_activation_checkpointing(model)  # the Offloader checkpoints each layer itself
        self._backend: Backend = make_backend(
            t.backend, self.device, cfg.precision, num_threads=t.num_threads, pin_threads=t.pin_threads,
            host_nice=t.host_nice, params_first=t.params_first, slice_elements=t.slice_elements,
            async_step=t.async_step is not False, **choices.backend_options(), sr_seed=cfg.sr_seed)
        # The memory checks, nothing allocated yet: the host buffers (the backend's plan), then the device's.
        self._backend.plan(choices.sizes, choices.own_grads)
        check_device_memory(model, settings, choices, self.device, group_of)
        check_materialized(model, weights)
        t0 = time.perf_counter()
        for p in self.layout.device_params:  # before the host buffers: what it reads on the way is freed first
            if p.is_meta:
                materialize(weights, p, self.device)
        self._backend.prepare(choices.sizes, choices.own_grads)
        t1 = time.perf_counter()
        # The part outside the stacks has its own gradient buffer; layers may share a staging ring.
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as readers:
            self._host: list[LayerBuffers] = [fill_unit(u, self._backend, self.device, own_grads=not part.layers,
                                                        weights=weights, pool=readers)
                                              for part in self.layout.parts for u in part.units]
        self._rings, self._grad_paths = self._device_side(t.device_layers, t.eager_uploads)
        t2 = time.perf_counter()
        self._device_opt = DeviceOptimizer(self.layout.device_params, model, self.device,
                                           device_precision(cfg.precision),
                                           self._hyper_dicts(), group_of, cfg.sr_seed)
        self.setup_seconds = {"pin": t1 - t0, "fill": t2 - t1, "outer_to_device": time.perf_counter() - t2}
        for path in self._grad_paths:
            path.hook()
        self._compile_layers = cfg.compile_layers
        self._saved = SavedWeights(self._rings[:len(self.layout.stacks)])
        self._host_activations = HostActivations(self.device) if cfg.activation_offload else None
        self.activation_checkpointing = cfg.activation_checkpointing
        self._budget = cfg.gpu_memory_budget
        self.auto_choice: dict[str, int] | None = None  # "auto"'s measured choice, from the second step on
        self._checkpointed = checkpointed_count(cfg.activation_checkpointing, self.layout.fewest_stack_layers)
        self._saved.measuring = cfg.activation_checkpointing == "auto"
        self._wrap_layers()
        self._in_backward = False
        self._output_hooks = [stack.layers[-1].register_forward_hook(self._output_reached)
                              for stack in self.layout.stacks if stack.layers]
        self._restart_rings()

    # ------------------------------------------------------------------ training API

    @property
    def grad_accum(self) -> int:
        return self._policy.grad_accum

    @property
    def max_grad_norm(self) -> float | None:
        return self._policy.max_grad_norm

    @property
    def last_clip_action(self) -> str | None:
        """With max_grad_norm, what the last step did: "committed" (its speculative host steps stood, the norm
        was under the limit) or "redone" (they were redone exactly, clipped); without speculation
        ("speculative_clip=False" or the python backend) "unclipped" or "clipped"."""
        return self._policy.last_clip_action

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm of the last step (with max_grad_norm), before clipping."""
        return self._policy.last_grad_norm

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("Offloader: already closed; build a new Offloader to train again")
        if self._failed is not None:
            raise RuntimeError(f"Offloader: an earlier step failed ({self._failed}); its layers may be at "
                               "different steps: close() it and continue from a checkpoint")

    def _hyper_dicts(self) -> list[dict[str, Any]]:
        return [{k: group[k] for k in HYPER_KEYS} for group in self.param_groups]

    def _hypers(self) -> list[Hyper]:
        hypers = []
        for h in self._hyper_dicts():
            check_hyper(**h)  # a scheduler or a user may have set them
            hypers.append(Hyper(h["lr"], h["betas"][0], h["betas"][1], h["eps"], h["weight_decay"], self._step + 1))
        return hypers

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), with each streamed layer stepped on the host as soon as its grads land. A plain
        `loss.backward()` does the same: the Offloader begins its backward when the gradient first reaches the
        layers it streams, and ends it as autograd finishes (what Trainer and accelerate call works unchanged).

        With grad_accum=N, call it N times per step(): the first N-1 only sum each layer's gradients on
        the host; the N-th steps each layer as its summed gradients are complete. With max_grad_norm,
        every layer's gradients are kept until step(), which clips by the global norm and then steps.
        The hyperparameters are read from param_groups here.
        """
        self._begin_backward()
        try:
            with span(self._timeline, "python", "backward"):
                loss.backward()
        except BaseException as e:
            self._fail(e)  # some layers' gradients may have gone to their host steps, others not
            raise
        finally:
            self._end_backward()

    def step(self, closure: None = None) -> None:
        """Finish the host steps of this backward, step the device parameters, prefetch layer 0.

        With async_step (the native default), layers still being stepped on the host when this returns
        finish in the background; each layer's next use (forward, state_dict, close) waits for its own.
        """
        if closure is not None:
            raise ValueError("Offloader.step: closures are not supported; call backward() then step()")
        self._check_open()
        self._check_backward_ended()
        self._policy.check_step()
        try:
            with span(self._timeline, "python", "step"):
                self._finish_step()
        except BaseException as e:
            self._fail(e)
            raise

    def _fail(self, error: BaseException) -> None:
        """A step ended in `error`: some units may have stepped and others not, so nothing may train on, or be
        saved, from here; the engine runs none of the host steps still queued."""
        if self._failed is None:
            self._failed = f"{type(error).__name__}: {error}"
            self._backend.fail(self._failed)

    def _finish_step(self) -> None:
        self.last_step_wait = self._backend.finish_step()
        names: dict[int, str] = {}

        def name_of(p: nn.Parameter) -> str:  # only for an error's message: a walk of the model per step cost
            if not names:                     # ~1,400 Python calls on a 16-layer model
                names.update({id(q): n for n, q in self.model.named_parameters()})
            return names.get(id(p), "?")
        for path in self._grad_paths:
            path.check_complete(name_of)
        self._policy.finish_host_units(self._backend, self._device_opt.grads())
        choosing = self.activation_checkpointing == "auto" and self.auto_choice is None
        before = torch.cuda.memory_allocated(self.device) if choosing and self.device.type == "cuda" else 0
        self._device_opt.step(self._hyper_dicts())
        self._step += 1
        self._policy.end_step()
        if choosing:
            # torch's AdamW makes its state at its first step, after the backward that peaked: every later
            # backward has it too (B2's 4.2 GB of moments, an OOM under 24 GB without it).
            grown = torch.cuda.memory_allocated(self.device) - before if self.device.type == "cuda" else 0
            self._choose_kept(max(0, grown))
        self._restart_rings()

    @contextlib.contextmanager
    def trace(self, path: str | None = None) -> Iterator[Timeline]:
        """Record a timeline of what runs inside the block (see offload_ext.engine.timeline); at its end the host
        steps still running are waited for, so they are on it, and it is written to `path` when given."""
        self._check_open()
        if self._timeline is not None:
            raise RuntimeError("Offloader.trace: already tracing; nest no second trace() inside the first")
        timeline = Timeline()
        self._set_timeline(timeline)
        self._backend.start_trace()
        try:
            yield timeline
        finally:
            if not self._policy.micro:
                self._backend.settle()
            timeline.extend(self._backend.stop_trace())
            self._set_timeline(None)
        if path is not None:
            timeline.write(path)

    def _set_timeline(self, timeline: Timeline | None) -> None:
        self._timeline = timeline
        for ring in self._rings:
            ring.timeline = timeline

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Streamed layers' grads are consumed by their hooks; this clears the device parameters'."""
        self._device_opt.zero_grad()

    def _restart_rings(self, stepped: bool = True) -> None:
        for ring in self._rings:
            ring.restart(stepped)
        if self.layout.outside is not None:
            self._rings[-1].bind(0)  # used from the first op on: the compute stream waits for it

    # ------------------------------------------------------------------ state

    def _settle(self) -> None:
        """Between steps, with every host step finished: the host buffers may be read or written."""
        if self._policy.micro:
            raise RuntimeError("Offloader: call step() before saving, loading or closing")
        self._backend.settle()

    @property
    def redo_tuning(self) -> RedoTuning | None:
        """With clipping on the native engine: how many top layers of each stack the device redoes when clipping
        triggers, measured in the first redone steps (engine.redo_tuning); None on the python backend."""
        return self._backend.redo_tuning

    def stats(self) -> dict[str, Any]:
        setup = {f"setup_{k}_s": v for k, v in self.setup_seconds.items()}
        return {"step": self._step, "last_step_wait_s": self.last_step_wait,
                "host_wait_s": self._backend.wait_seconds(),
                "layer_copies_h2d": sum(r.copies for r in self._rings),
                "early_layer_copies": sum(r.early for r in self._rings), "kept_layers": self.kept_layers,
                **setup, **self._backend.stats()}

    def close(self, copy_out: bool = True) -> None:
        """Detach from the model: it becomes an ordinary module on the CPU holding its current weights. The
        optimizer state and gradient buffers are given back first; the weights' host buffers stay until the
        Offloader is dropped (model_state_dict still reads them).

        A copy the host has no room for (a quantized base comes out in bf16: 70 B is 141 GB) is refused with
        MemoryError before any of it is made; the engine is stopped by then, its weights still readable.
        `copy_out=False` detaches without the copy: every parameter is left on the meta device (save what you
        need first: model_state_dict(), save_pretrained(), or peft's adapter)."""
        if self._detached:
            return
        self._stop()
        weights = None
        if copy_out:
            self._check_room_to_copy_out()
            try:
                weights = model_weights(self.model, self.layout, self._host)
            except RuntimeError as e:  # after a device fault the device's weights cannot be read back
                self._close_failure = self._close_failure or str(e)
        self._detach(weights, copy_out)
        if self._close_failure:
            kept = ("the model holds its weights as the failure left them" if weights is not None else
                    "the model's weights could not be read back" if copy_out else "the model's weights were not "
                    "copied out")
            warnings.warn(f"Offloader.close: training had failed ({self._close_failure}); {kept}: continue from a "
                          "checkpoint", RuntimeWarning, stacklevel=2)

    def _stop(self) -> None:
        """The engine stopped and its optimizer state given back, once."""
        if self._closed:
            return
        # Whatever failed before (a host step, a device fault, an interrupted step), close() returns: the engine
        # stops first, then the model is detached.
        self._policy.end_step()
        self._close_failure = self._backend.close() or self._failed
        self._closed = True
        # The optimizer state goes before the weights are copied out: the copy would otherwise come on top of
        # the whole engine (qwen-14b: 113 GB at close against 84 GB through training).
        for layer in self._host:
            layer.release_state()
        self._backend.release_memory()

    def _streamed_shapes(self) -> dict[int, torch.Size]:
        """Each streamed parameter's shape by id: on the device it holds an empty placeholder."""
        return {id(s.param): s.shape for unit in self.layout.units for s in unit.spans}

    def _check_room_to_copy_out(self) -> None:
        streamed = self._streamed_shapes()  # copied out in bf16, a quantized one dequantized
        need = sum(streamed[id(p)].numel() * 2 if id(p) in streamed else p.numel() * p.element_size()
                   for p in self.model.parameters())
        room = available_host_bytes()
        if room is not None and need > room:
            raise MemoryError(f"Offloader.close: the model's weights copied out to the CPU take {need / 1e9:.1f} GB "
                              f"and the host has {room / 1e9:.1f} GB available; the engine is stopped and its "
                              "weights still readable: save them (model_state_dict(), save_pretrained(), peft's "
                              "adapter), then close(copy_out=False) to detach without the copy")

    def _detach(self, weights: dict[str, torch.Tensor] | None, copy_out: bool) -> None:
        for path in self._grad_paths:
            path.unhook()
        for hook in self._output_hooks:
            hook.remove()
        for layer in (*(layer for stack in self.layout.stacks for layer in stack.layers), *self.layout.resident):
            unwrap_layer(layer)
        if weights is not None:
            for name, p in self.model.named_parameters(remove_duplicate=False):
                p.data = weights[name]
            self.model.to("cpu")
        elif not copy_out:
            shapes = self._streamed_shapes()
            for p in self.model.parameters():
                make_real(p, torch.empty(shapes.get(id(p), p.shape), dtype=p.dtype, device="meta"))
        if self._hf_checkpointing:
            enable_activation_checkpointing(self.model)
        self._detached = True

    def __enter__(self) -> "Offloader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()  # it drains the host steps first, whatever failed


def _planned(model: nn.Module, cfg: OffloadConfig, batch_shape: tuple[int, int] | None,
             group_of: GroupOf) -> LayoutChoice | None:
    """The GPU layout for micro-batches of `batch_shape` (batch_size, seq_len) with causal_lm_loss, where `cfg`
    leaves it to the engine (planning.auto_layout.planned_layout); None without a batch_shape."""
    if batch_shape is None:
        return None
    if (not isinstance(batch_shape, tuple) or len(batch_shape) != 2
            or not all(type(n) is int and n >= 1 for n in batch_shape)):
        raise ValueError(f"Offloader: batch_shape must be (batch_size, seq_len), two ints >= 1 (the micro-batch the "
                         f"GPU layout is planned for), got {batch_shape!r}")
    device = resolve_device(cfg.device)
    settings = Settings(cfg, batch_size=batch_shape[0], seq_len=batch_shape[1])
    return planned_layout(model, settings, plan_machine(device, model=model), group_of)
