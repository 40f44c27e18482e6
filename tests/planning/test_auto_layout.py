"""Auto layout: the most resident layers the plan fits on the GPU with the headroom kept free, then a device
buffer per streamed layer where those fit too; nothing where the plan cannot tell."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import offload_ext
from offload_ext.config import OffloadConfig
from offload_ext.planning.auto_layout import HEADROOM, choose_layout, planned_layout
from offload_ext.planning.choices import Settings
from offload_ext.planning.memory import evaluate
from offload_ext.planning.plan import machine


def _llama_8b_on_meta() -> torch.nn.Module:
    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False, use_cache=False)
    with offload_ext.parameters_on_meta():
        return LlamaForCausalLM(cfg).to(torch.bfloat16)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return _llama_8b_on_meta()


def _settings(**options) -> Settings:
    return Settings(OffloadConfig(device="cuda").replace(**options), batch_size=2, seq_len=4096)


def _need(model, gpu, **options) -> int:
    return evaluate(model, _settings(**options), gpu).gpu.needed


def test_it_keeps_the_most_resident_layers_that_fit_with_the_headroom_free(model) -> None:
    gpu = machine("cuda", host_memory="125GB", gpu_memory="24GB")
    choice = choose_layout(model, _settings(), gpu)
    budget = gpu.gpu_available * (1 - HEADROOM)
    r, d = choice.resident_layers, choice.device_layers
    assert 0 < r < 31 and d >= 2
    assert _need(model, gpu, resident_layers=r, device_layers=d) <= budget
    assert _need(model, gpu, resident_layers=r + 1, device_layers=2) > budget  # one more would not fit
    assert choice.flags == f"--resident-layers {r} --device-layers {d}" and "of the 22.8 GB it may use" in choice.reason


def test_a_gpu_that_holds_the_model_keeps_all_but_one_layer_of_each_stack_resident(model) -> None:
    choice = choose_layout(model, _settings(), machine("cuda", host_memory="125GB", gpu_memory="139GB"))
    assert (choice.resident_layers, choice.device_layers) == (31, 2)


def test_with_the_resident_layers_given_every_streamed_layer_gets_a_buffer_where_they_fit(model) -> None:
    gpu = machine("cuda", host_memory="125GB", gpu_memory="80GB")
    choice = choose_layout(model, _settings(), gpu, resident=4)
    assert (choice.resident_layers, choice.device_layers) == (4, 28)
    tight = choose_layout(model, _settings(), machine("cuda", host_memory="125GB", gpu_memory="24GB"), resident=4)
    assert (tight.resident_layers, tight.device_layers) == (4, 2)


def test_a_gpu_too_small_for_the_stream_and_the_simulated_device_get_the_plain_layout(model) -> None:
    small = choose_layout(model, _settings(), machine("cuda", host_memory="125GB", gpu_memory="8GB"))
    assert (small.resident_layers, small.device_layers) == (0, 2) and "over" in small.reason
    sim = choose_layout(model, Settings(OffloadConfig(device="cpu"), batch_size=2, seq_len=4096),
                        machine("cpu", host_memory="125GB"))
    assert (sim.resident_layers, sim.device_layers) == (0, 2) and "no GPU memory figure" in sim.reason


def test_a_config_that_names_a_layout_or_the_simulated_device_is_left_as_it_is(model) -> None:
    gpu = machine("cuda", host_memory="125GB", gpu_memory="24GB")
    assert planned_layout(model, _settings(), gpu) == choose_layout(model, _settings(), gpu)
    assert planned_layout(model, _settings(resident_layers=1), gpu) is None
    assert planned_layout(model, _settings(device_layers=4), gpu) is None
    assert planned_layout(model, _settings(), machine("cpu", host_memory="125GB")) is None
