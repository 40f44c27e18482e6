"""causal_lm_loss: the next-token loss of an HF causal LM without materialising the whole batch's logits.

The vocabulary projection and cross-entropy run in chunks of tokens. Every chunk but the last is
checkpointed, so one chunk of logits exists at a time; the last one is computed last in the forward
and first in the backward, so keeping it costs no memory and saves its recompute. On CUDA the
cross-entropy is the extension's fused kernels, one pass over the logits in their own dtype each way
(kernel "native"); elsewhere, or without a CUDA build, F.cross_entropy on fp32 logits (kernel
"torch"; on the CPU it is faster than the extension's plain C++ loops). Same value as the model's own
loss.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from offload_ext import _ext, ops

IGNORE_INDEX = -100
KERNELS = ("auto", "native", "torch")


def _native_kernels_for(device: torch.device) -> bool:
    if not _ext.available() or device.type not in ("cpu", "cuda"):
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key("offload_ext::cross_entropy_rows", device.type.upper())


def resolve_loss_kernel(kernel: str, device: torch.device) -> str:
    """The cross-entropy `kernel` ("auto", "native" or "torch") means for tensors on `device`."""
    if kernel not in KERNELS:
        raise ValueError(f"lm_head_loss: kernel must be one of {KERNELS}, got {kernel!r}")
    native = _native_kernels_for(device)
    if kernel == "native" and not native:
        raise RuntimeError(
            f"lm_head_loss: kernel='native' needs the extension's cross-entropy kernels for {device.type} "
            f"(extension: {'loaded' if _ext.available() else _ext.error()}; a CUDA build is needed for CUDA "
            "tensors). Use kernel='auto' or 'torch'.")
    return "native" if kernel == "native" or (kernel == "auto" and native and device.type == "cuda") else "torch"


def _native_chunk_loss(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # A plain nn.Linear saves its input and weight, not its output: the logits' gradient may overwrite them.
    loss, _ = ops.cross_entropy_rows(head(hidden).contiguous(), labels, IGNORE_INDEX, overwrite=type(head) is nn.Linear)
    return loss.sum()


def _torch_chunk_loss(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), labels, reduction="sum", ignore_index=IGNORE_INDEX)


def causal_lm_loss(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                   chunk_tokens: int = 4096, kernel: str = "auto", **model_inputs: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting labels[:, 1:] (default: input_ids; -100 ignored) from an HF causal LM.
    `model_inputs` go to its decoder as they are (position_ids, attention_mask: packed examples)."""
    hidden = model.get_decoder()(input_ids=input_ids, **model_inputs).last_hidden_state
    return lm_head_loss(model.get_output_embeddings(), hidden, input_ids if labels is None else labels,
                        chunk_tokens, kernel)


def lm_head_loss(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, chunk_tokens: int = 4096,
                 kernel: str = "auto") -> torch.Tensor:
    """Mean cross-entropy of head(hidden[:, :-1]) against labels[:, 1:] (-100 ignored), in chunks of tokens.

    kernel: "native" (the extension's fused kernels), "torch" (F.cross_entropy on fp32 logits) or
    "auto" (native on CUDA when the extension was built with CUDA, else torch).
    """
    if chunk_tokens < 1:
        raise ValueError(f"lm_head_loss: chunk_tokens must be at least 1, got {chunk_tokens}")
    chunk_loss = _native_chunk_loss if resolve_loss_kernel(kernel, hidden.device) == "native" else _torch_chunk_loss
    h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    y = labels[:, 1:].reshape(-1)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, h.shape[0], chunk_tokens):
        part = (head, h[start:start + chunk_tokens], y[start:start + chunk_tokens])
        last = start + chunk_tokens >= h.shape[0]
        total = total + (chunk_loss(*part) if last else checkpoint(chunk_loss, *part, use_reentrant=False))
    return total / (y != IGNORE_INDEX).sum().clamp_min(1)
