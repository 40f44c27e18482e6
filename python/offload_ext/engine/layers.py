"""Streamed layers' forward: activation checkpointing (or a kept layer's saved-tensor hooks) around a hook
that binds the layer first, no KV cache written, and HF's own checkpointing paused meanwhile (new method
names first, old as fallback)."""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from offload_ext.engine.activation_offload import HostActivations, HostSlot, Key
from offload_ext.engine.kept_layers import SavedWeights, on_backward
from offload_ext.engine.recompute import recompute_checkpoint

_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


def _is_cache(value: Any) -> bool:
    """A transformers KV cache object (duck-typed: no import of transformers here)."""
    return hasattr(value, "update") and hasattr(value, "get_seq_length")


def without_kv_cache(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A checkpointed layer must not write a KV cache: its recompute would append the same keys again
    (and a training step has no use for the cache). HF's own checkpointing drops it the same way; GPT-2's
    blocks take it positionally."""
    if any(_is_cache(a) for a in args):
        args = tuple(None if _is_cache(a) else a for a in args)
    if not any(kwargs.get(k) is not None for k in _CACHE_KWARGS) and not kwargs.get("use_cache"):
        return args, kwargs
    kwargs = {k: (None if k in _CACHE_KWARGS else v) for k, v in kwargs.items()}
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    return args, kwargs


def wrap_layer(layer: nn.Module, before: Callable[[], None], compile_layer: bool,
               kept: tuple[SavedWeights, Callable[[], None]] | None = None,
               host: tuple[HostActivations, Key, Key | None] | None = None) -> None:
    """Replace layer.forward (an instance attribute; unwrap_layer removes it) by a forward that calls `before`
    first: checkpointed (offload_ext.engine.recompute; `before` runs again in the recompute; with `host` = (the host
    slots, this layer's key, the key of the layer below) its input held on the host meanwhile,
    offload_ext.engine.activation_offload), or with
    `kept` = (the saved-tensor hooks, what runs as its backward begins) keeping what it saves for backward
    (offload_ext.engine.kept_layers)."""
    inner = layer.forward
    compiled = torch.compile(inner) if compile_layer else inner

    def run(*args: Any, **kwargs: Any) -> Any:
        before()
        return compiled(*args, **kwargs)

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return run(*args, **kwargs)
        args, kwargs = without_kv_cache(args, kwargs)
        if kept is None:
            # Recompute is required: saved activations would point at buffers since refilled.
            held = host is not None and bool(args) and isinstance(args[0], torch.Tensor)
            return recompute_checkpoint(run, args, kwargs, HostSlot(*host) if held else None)
        saved, enter = kept
        saved.inputs(args, kwargs)
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            return on_backward(run(*args, **kwargs), enter)

    layer.forward = forward


def unwrap_layer(layer: nn.Module) -> None:
    layer.__dict__.pop("forward", None)


# Newer transformers name HF checkpointing `activation_checkpointing_*` and warn on the older
# `gradient_checkpointing_*` names; older releases have only those.

def _transformers_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper (whose attribute forwarding reaches the deprecated
    names), or the model itself."""
    return model.get_base_model() if hasattr(type(model), "get_base_model") else model


def hf_checkpointing_enabled(model: nn.Module) -> bool:
    model = _transformers_model(model)
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def enable_activation_checkpointing(model: nn.Module) -> None:
    """HF activation checkpointing (non-reentrant) on `model`, by whichever name its transformers has."""
    model = _transformers_model(model)
    if hasattr(type(model), "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def disable_activation_checkpointing(model: nn.Module) -> None:
    model = _transformers_model(model)
    if hasattr(type(model), "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()
