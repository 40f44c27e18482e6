"""The built-in shapes: each is the model it names, counted on the meta device."""
from __future__ import annotations

import pytest

from offload_ext.models.weights import from_config_empty
from offload_ext.train.flags import parse_args
from offload_ext.train.model_configs import model_config


# The parameter counts the models' own cards give (the 24 B's from its safetensors index), in billions.
@pytest.mark.parametrize("name,billions", [("llama-8b", 8.03), ("qwen-14b", 14.77), ("mistral-24b", 23.57),
                                           ("llama-70b", 70.55)])
def test_a_built_in_shape_has_the_parameters_of_the_model_it_names(name, billions) -> None:
    args = parse_args(["--model", name, "--seq-len", "4096"])
    model, _ = from_config_empty(model_config(args, 8192), seed=0)
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=0.005)
    layer = model.model.layers[0].self_attn
    assert layer.q_proj.out_features == model.config.num_attention_heads * layer.head_dim
