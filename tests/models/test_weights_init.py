"""Weights drawn fresh into the engine (Offloader.from_config): by the model's own init rule, ancestors'
rules included, and a function of the seed and the model alone, whatever the layout."""
from __future__ import annotations

import math

import pytest
import torch

import offload_ext
from helpers import tiny_gpt2, tiny_llama

LAYOUTS = [dict(), dict(resident_layers=2), dict(offload_all=True), dict(resident_layers=1, offload_all=True)]


def _drawn(config, seed: int = 5, **layout) -> dict[str, torch.Tensor]:
    off = offload_ext.Offloader.from_config(config, seed=seed, backend="python", device="cpu", **layout)
    weights = off.model_state_dict()
    off.close()
    return weights


@pytest.mark.parametrize("layout", LAYOUTS[1:], ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2])
def test_the_drawn_weights_depend_on_the_seed_and_the_model_not_on_the_layout(make, layout) -> None:
    config = make().config
    reference = _drawn(config)
    weights = _drawn(config, **layout)
    assert weights.keys() == reference.keys()
    for name, value in weights.items():
        assert torch.equal(value, reference[name]), name
    other = _drawn(config, seed=6, **layout)
    assert not any(torch.equal(other[n], reference[n]) for n in reference if n.endswith("proj.weight"))


def test_gpt2_draws_its_residual_projections_with_the_depth_scaled_std() -> None:
    config = tiny_gpt2(layers=8).config
    config.n_embd, config.n_inner = 256, 1024  # enough values per matrix to tell 0.02 from 0.005
    weights = _drawn(config)
    scaled = config.initializer_range / math.sqrt(2 * config.n_layer)
    for name, value in weights.items():
        if name.endswith("c_proj.weight"):
            want = scaled  # GPT-2's rule: its attention and MLP blocks redraw c_proj after Conv1D's own draw
        elif name.endswith("c_attn.weight") or name.endswith("c_fc.weight"):
            want = config.initializer_range
        else:
            continue
        n = value.numel()
        assert abs(value.float().std().item() - want) < 6 * want / n ** 0.5 + want / 64, name


def test_norms_are_ones_and_biases_zeros_as_the_models_rule_has_them() -> None:
    weights = _drawn(tiny_gpt2().config)
    for name, value in weights.items():
        if ".ln_" in name or name.startswith("transformer.ln_f"):
            want = torch.ones_like(value) if name.endswith("weight") else torch.zeros_like(value)
            assert torch.equal(value, want), name
        elif name.endswith(".bias") and "attn.bias" not in name:
            assert torch.equal(value, torch.zeros_like(value)), name
