"""benchmarks/_qlora.py's resident peer on an int8 base: every linear dequantizes its own weight into the shared
buffer in forward and again in backward, so the adapters' gradients are those of the same base held in bf16."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from helpers import base_dequantized, tiny_llama
from offload_ext.engine.layers import wrap_layer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import _qlora

peft = pytest.importorskip("peft")


def test_the_int8_peer_backpropagates_through_each_linears_own_dequantized_weight() -> None:
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
    torch.manual_seed(1)
    peer = peft.get_peft_model(tiny_llama(layers=2), config).bfloat16()
    for name, p in peer.named_parameters():  # lora_B starts at zero: let the gradients reach below it
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    reference = base_dequantized(peer, "int8")
    _qlora.hold_base(peer, "int8", "cpu", weights=None)  # every weight is real: read from the model
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    grads = []
    for model in (peer, reference):
        for layer in model.base_model.model.model.layers:
            wrap_layer(layer, lambda: None, False)  # resident-lean's recompute
        model(input_ids=tokens, labels=tokens).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 12
    for name, grad in grads[0].items():
        assert torch.equal(grad, grads[1][name]), name
