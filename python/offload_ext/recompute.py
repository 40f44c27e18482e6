"""Activation checkpointing of one layer call by the reentrant rule: the forward runs under grad with nothing
saved, the backward recomputes it from the kept input and runs a nested backward into the same parameters.

Torch's non-reentrant checkpoint (HF's default) pays, per saved tensor of the forward, a Python pack hook and a
holder, and in backward an unpack that starts the recompute, with saved-tensor hooks of its own around it. The
rule here does none of that: one autograd node per layer call, the layer's graph dropped as the forward returns.
On an overhead-bound step (the thread that launches the kernels sets the pace) that is the launching thread's
time saved: on the CPU, a 16-layer tiny Llama's forward and backward took ~30 ms against ~46 with torch's
non-reentrant checkpoint.

Exactness: the forward runs under grad, as the recompute does and as an unwrapped forward would, so every op
picks the same kernel in both (SDPA picks by whether grad is needed); the RNG state of the forward and its
autocast state are restored for the recompute, as torch.utils.checkpoint does. Under the reentrant rule the
layer's output needs a gradient only if its first argument does (the parameters are not inputs of the node):
`applies` sends any other call (a frozen embedding below, a gradient-carrying keyword) to torch's checkpoint.
The nested backward accumulates into `.grad` directly, so `torch.autograd.grad` over such a model does not
reach the layers' parameters: training calls `backward()`.

Where the kept input waits is the caller's choice: on the device (saved with the node, version-checked) or in
host memory (offload_ext.activation_offload's slots, fetched back as the backward reaches the layer).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.utils._pytree import tree_leaves


class InputStore(Protocol):
    """Somewhere a layer's input waits between its forward and its backward."""

    def store(self, x: torch.Tensor) -> None: ...

    def take(self) -> torch.Tensor:
        """The input back on its device, the compute stream ready to read it."""
        ...


def _drop(_: torch.Tensor) -> None:
    return None


def _never(_: None) -> torch.Tensor:
    raise RuntimeError("offload_ext: a checkpointed forward's saved tensor was unpacked (its graph escaped the layer)")


def applies(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the reentrant rule gives this call's exact gradients: a first argument (the hidden states) that
    needs a gradient and no other tensor among the arguments that does."""
    if not args or not isinstance(args[0], torch.Tensor) or not args[0].requires_grad:
        return False
    return not any(isinstance(v, torch.Tensor) and v.requires_grad for v in tree_leaves((args[1:], kwargs)))


def _autocast_state(device_type: str) -> list[tuple[str, bool, torch.dtype]]:
    types = [device_type] if device_type == "cpu" else [device_type, "cpu"]
    return [(t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in types]


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, store: InputStore | None, run: Callable[..., Any], rest: tuple[Any, ...],
                kwargs: dict[str, Any], x: torch.Tensor) -> Any:
        ctx.store, ctx.run, ctx.rest, ctx.kwargs = store, run, rest, kwargs
        ctx.cuda = x.device.type == "cuda"
        ctx.rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(x.device) if ctx.cuda else None
        ctx.autocast = _autocast_state(x.device.type)
        ctx.cache = torch.is_autocast_cache_enabled()
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_drop, _never):
            out = run(x.detach().requires_grad_(), *rest, **kwargs)
        if store is None:
            ctx.save_for_backward(x)
        else:
            store.store(x)
        outs = out if isinstance(out, tuple) else (out,)
        ctx.mark_non_differentiable(*(o for o in outs if isinstance(o, torch.Tensor) and not o.is_floating_point()))
        return tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in out) if isinstance(out, tuple) \
            else out.detach()

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        x = (ctx.saved_tensors[0] if ctx.store is None else ctx.store.take()).detach().requires_grad_()
        with contextlib.ExitStack() as scope:
            scope.enter_context(torch.random.fork_rng(devices=[x.device] if ctx.cuda else []))
            scope.enter_context(torch.enable_grad())
            for device_type, enabled, dtype in ctx.autocast:
                scope.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=ctx.cache))
            torch.set_rng_state(ctx.rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, x.device)
            out = ctx.run(x, *ctx.rest, **ctx.kwargs)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return None, None, None, None, x.grad


def recompute_checkpoint(run: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                         store: InputStore | None = None) -> Any:
    """run(*args, **kwargs) checkpointed by the reentrant rule (the caller has checked `applies`), its input
    kept on the device or, with `store`, there."""
    return _Recompute.apply(store, run, args[1:], kwargs, args[0])
