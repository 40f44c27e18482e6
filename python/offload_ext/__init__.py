"""offload_ext: full CPU offload for training models larger than one GPU."""
from __future__ import annotations

from . import stacks
from ._info import build_info
from ._version import __version__
from .layers import enable_activation_checkpointing
from .losses import causal_lm_loss, lm_head_loss
from .offloader import Offloader
from .ops import adamw_step, get_num_threads, set_num_threads, set_simd_level, supported_simd_level
from .optim import CPUAdamW, StochasticAdamW
from .planning import MemoryPlan, plan

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
    "MemoryPlan",
    "Offloader",
    "plan",
    "stacks",
]
