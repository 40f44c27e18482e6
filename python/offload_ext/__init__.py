"""offload_ext: full CPU offload for training models larger than one GPU."""
from __future__ import annotations

from offload_ext._ext import build_info
from offload_ext._version import __version__
from offload_ext.config import EngineTuning, OffloadConfig
from offload_ext.engine.layers import enable_activation_checkpointing
from offload_ext.engine.offloader import Offloader
from offload_ext.engine.per_layer import PerLayerOffloadWithBackwardGradient
from offload_ext.models import stacks
from offload_ext.models.fsdp_shards import materialize_shards
from offload_ext.models.losses import causal_lm_loss, lm_head_loss
from offload_ext.models.weights import parameters_on_meta
from offload_ext.ops import adamw_step, get_num_threads, set_num_threads, set_simd_level, supported_simd_level
from offload_ext.optim.cpu_adamw import CPUAdamW, StochasticAdamW
from offload_ext.planning.plan import plan
from offload_ext.planning.report import MemoryPlan

__all__ = [
    "__version__",
    "build_info",
    "adamw_step",
    "get_num_threads",
    "set_num_threads",
    "set_simd_level",
    "supported_simd_level",
    "CPUAdamW",
    "StochasticAdamW",
    "causal_lm_loss",
    "enable_activation_checkpointing",
    "lm_head_loss",
    "materialize_shards",
    "parameters_on_meta",
    "EngineTuning",
    "MemoryPlan",
    "OffloadConfig",
    "Offloader",
    "PerLayerOffloadWithBackwardGradient",
    "plan",
    "stacks",
]
