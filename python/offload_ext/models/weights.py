"""A model built with its parameters on the meta device (shape, dtype and requires_grad, no memory), paired
with the weight source that gives them their values once the engine's buffers for them exist: a checkpoint's
(from_pretrained_empty) or fresh draws by the model's init rule (from_config_empty). So the weights are never
whole in memory twice.
"""
from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from offload_ext.models.checkpoint_weights import CheckpointWeights
from offload_ext.models.init_weights import InitWeights
from offload_ext.models.safetensors_io import SafetensorsCheckpoint

_META_LOCK = threading.Lock()  # parameters_on_meta patches nn.Module for the whole process


def dtype_keyword() -> str:
    """from_pretrained's dtype argument: `dtype` since transformers 4.56 (`torch_dtype` warns there)."""
    import transformers
    from packaging.version import Version

    return "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"


def from_config_empty(config: Any, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                      device: torch.device | str = "cpu") -> tuple[nn.Module, InitWeights]:
    """A causal LM of `config` with its parameters on the meta device, and fresh weights for them drawn
    by its own init rule on `device`."""
    from transformers import AutoModelForCausalLM

    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, **{dtype_keyword(): dtype})
    return model, InitWeights(model, seed, device)


def from_pretrained_empty(name_or_path: str,
                          dtype: torch.dtype = torch.bfloat16) -> tuple[nn.Module, CheckpointWeights]:
    """A causal LM built from its config with its parameters on the meta device, and the checkpoint's
    weights for them: a local directory, or a hub id (only its config and safetensors are fetched)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = name_or_path
    if not os.path.isdir(path) and not os.path.isfile(path):
        from huggingface_hub import snapshot_download

        path = snapshot_download(name_or_path, allow_patterns=["*.json", "*.safetensors"])
    checkpoint = SafetensorsCheckpoint(path)  # raises first when there are no safetensors
    config = AutoConfig.from_pretrained(path)
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, **{dtype_keyword(): dtype})
    return model, CheckpointWeights(checkpoint, model)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Inside, modules register their parameters on the meta device (shape, dtype and requires_grad
    kept, no memory); buffers stay real, so values computed at construction (rotary frequencies) hold."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)

    with _META_LOCK:
        nn.Module.register_parameter = register
        try:
            yield
        finally:
            nn.Module.register_parameter = original
