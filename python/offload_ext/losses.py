"""causal_lm_loss: the next-token loss of an HF causal LM without materialising the whole batch's logits.

The vocabulary projection and cross-entropy run in chunks of tokens, each checkpointed, so at most one
chunk of fp32 logits exists at a time (forward and backward). Same value as the model's own loss.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def _chunk_loss(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), labels, reduction="sum", ignore_index=-100)


def causal_lm_loss(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                   chunk_tokens: int = 2048) -> torch.Tensor:
    """Mean cross-entropy of predicting labels[:, 1:] (default: input_ids) from an HF causal LM."""
    hidden = model.get_decoder()(input_ids=input_ids).last_hidden_state
    return lm_head_loss(model.get_output_embeddings(), hidden, input_ids if labels is None else labels, chunk_tokens)


def lm_head_loss(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, chunk_tokens: int = 2048) -> torch.Tensor:
    """Mean cross-entropy of head(hidden[:, :-1]) against labels[:, 1:], in checkpointed chunks of tokens."""
    h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    y = labels[:, 1:].reshape(-1)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, h.shape[0], chunk_tokens):
        total = total + checkpoint(_chunk_loss, head, h[start:start + chunk_tokens], y[start:start + chunk_tokens],
                                   use_reentrant=False)
    return total / (y != -100).sum().clamp_min(1)
