"""causal_lm_loss equals the model's own loss and gradients, with any chunk size."""
from __future__ import annotations

import copy

import pytest
import torch

import offload_ext
from helpers import batches, tiny_llama


@pytest.mark.parametrize("chunk", [7, 30, 4096])
def test_chunked_loss_matches_the_models_loss_and_grads(chunk: int) -> None:
    model, x = tiny_llama(layers=2), batches(1)[0]
    ref = copy.deepcopy(model)
    expected = ref(input_ids=x, labels=x).loss
    expected.backward()
    loss = offload_ext.causal_lm_loss(model, x, chunk_tokens=chunk)
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
