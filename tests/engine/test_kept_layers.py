"""Kept layers (activation_checkpointing "none", N, "auto") on the simulated device: the same training as
without checkpointing, bit for bit, through accumulation, clipping, slow copies and auto's switch."""
from __future__ import annotations

import copy

import pytest
import torch

import offload_ext
from helpers import batches, offloaded_training, reference_training, tiny_llama
from offload_ext import testing

LR, WD = 1e-2, 0.1


def _offloader(model, **kw) -> offload_ext.Offloader:
    return offload_ext.Offloader(model, lr=LR, weight_decay=WD, device="cpu", **kw)


def _train(base, data, **kw) -> tuple[list[float], torch.nn.Module, offload_ext.Offloader]:
    model = copy.deepcopy(base)
    off = _offloader(model, **kw)
    losses = []
    for k in range(0, len(data), off.grad_accum):
        losses += offloaded_training(off, model, data[k:k + off.grad_accum])
    return losses, model, off


def _assert_same_model(model, ref_model) -> None:
    for (name, a), b in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("spec, resident_layers", [("none", 0), (2, 0), (2, 1), ("none", 1)])
@pytest.mark.parametrize("precision", ["bf16", "mixed"])
@pytest.mark.parametrize("backend", ["python", "native"])
def test_kept_layers_train_exactly_like_training_without_checkpointing(backend, precision, spec,
                                                                       resident_layers) -> None:
    base, data = tiny_llama(layers=4), batches(4)
    ref_losses, ref_model = reference_training(base, data, precision, LR, WD, checkpointing=False)
    losses, model, off = _train(base, data, backend=backend, precision=precision, activation_checkpointing=spec,
                                resident_layers=resident_layers)
    assert off.kept_layers == (4 if spec == "none" else 2)
    off.close()
    assert losses == ref_losses
    _assert_same_model(model, ref_model)


@pytest.mark.parametrize("max_grad_norm, grad_accum, on_device", [
    (None, 2, False), (None, 2, True), (0.5, 2, True), (0.5, 1, False), (1e6, 1, False)])
@pytest.mark.parametrize("precision", ["bf16", "mixed"])
@pytest.mark.parametrize("backend", ["python", "native"])
def test_kept_layers_with_accumulation_and_clipping_equal_torch(backend, precision, max_grad_norm, grad_accum,
                                                                on_device) -> None:
    base, data = tiny_llama(layers=4), batches(4)
    ref_losses, ref_model = reference_training(base, data, precision, LR, WD, micro_batches=grad_accum,
                                               max_grad_norm=max_grad_norm, exact_clip=True, checkpointing=False)
    losses, model, off = _train(base, data, backend=backend, precision=precision, activation_checkpointing=1,
                                grad_accum=grad_accum, max_grad_norm=max_grad_norm, accumulate_on_device=on_device)
    off.close()
    assert losses == ref_losses
    _assert_same_model(model, ref_model)


@pytest.mark.parametrize("backend", ["python", "native"])
def test_kept_layers_under_randomly_delayed_copies_change_nothing(backend) -> None:
    base, data = tiny_llama(layers=6), batches(3)
    ref_losses, ref_model = reference_training(base, data, "bf16", LR, WD, checkpointing=False)
    model = copy.deepcopy(base)
    off = _offloader(model, backend=backend, activation_checkpointing="none")
    testing.delayed_copies(off, 3000)
    assert offloaded_training(off, model, data) == ref_losses
    off.close()
    _assert_same_model(model, ref_model)


def _auto_run(budget_layers: float, data) -> tuple[list[float], torch.nn.Module, offload_ext.Offloader]:
    """Measure one kept layer's saved bytes, then train with "auto" under budget_layers times that."""
    base = tiny_llama(layers=4)
    _, _, probe = _train(base, data[:1], backend="native", activation_checkpointing="auto",
                         gpu_memory_budget=1)
    per_layer = probe.auto_choice["saved_bytes_per_layer"]
    probe.close()
    assert per_layer > 0
    return _train(base, data, backend="native", activation_checkpointing="auto",
                  gpu_memory_budget=int(budget_layers * per_layer))


@pytest.mark.parametrize("budget_layers, kept", [(0.5, 0), (2.5, 2), (100, 4)])
def test_auto_keeps_as_many_top_layers_as_the_measured_budget_holds(budget_layers, kept) -> None:
    data = batches(4)
    ref_losses, ref_model = reference_training(tiny_llama(layers=4), data, "bf16", LR, WD, checkpointing=False)
    losses, model, off = _auto_run(budget_layers, data)
    assert off.kept_layers == kept and off.auto_choice["kept_layers"] == kept, off.auto_choice
    assert off.stats()["kept_layers"] == kept
    off.close()
    assert losses == ref_losses  # the first step kept one layer, the rest `kept`: the same arithmetic
    _assert_same_model(model, ref_model)


def test_auto_measures_what_a_kept_layer_saves_beyond_its_input() -> None:
    data = batches(1, batch=2, seq=16)
    _, _, small = _train(tiny_llama(layers=4), data, backend="native", activation_checkpointing="auto",
                         gpu_memory_budget=1)
    _, _, long = _train(tiny_llama(layers=4), batches(1, batch=2, seq=32), backend="native",
                        activation_checkpointing="auto", gpu_memory_budget=1)
    a, b = small.auto_choice["saved_bytes_per_layer"], long.auto_choice["saved_bytes_per_layer"]
    small.close()
    long.close()
    # A Llama layer saves activations linear in the tokens (attention through SDPA saves no seq x seq
    # matrix at this size beyond its output's): twice the tokens, between 1.8x and 2.6x the bytes.
    assert 1.8 * a <= b <= 2.6 * a, (a, b)
    # bf16 activations of 32 tokens x hidden 64 are 4 KiB each: a layer saves more than ten of them.
    assert a > 10 * 2 * 32 * 64, a


def test_auto_measures_one_micro_batch_of_an_accumulated_step() -> None:
    data = batches(2)
    measured = []
    for grad_accum in (1, 2):
        _, _, off = _train(tiny_llama(layers=4), data[:grad_accum], backend="native", grad_accum=grad_accum,
                           activation_checkpointing="auto", gpu_memory_budget=1)
        measured.append(off.auto_choice["saved_bytes_per_layer"])
        off.close()
    assert measured[0] == measured[1] > 0


@pytest.mark.parametrize("kw, message", [
    (dict(activation_checkpointing="some"), r"activation_checkpointing must be 'all', 'none', 'auto' or an int >= 0"),
    (dict(activation_checkpointing=True), r"activation_checkpointing must be .*, got True"),
    (dict(activation_checkpointing=5), r"activation_checkpointing=5 layers, but a stack has 4: .*\[0, 4\]"),
    (dict(activation_checkpointing=-1), r"activation_checkpointing must be .*, got -1"),
    (dict(gpu_memory_budget=1 << 30), r"gpu_memory_budget=1073741824 is read by activation_checkpointing='auto'"),
    (dict(activation_checkpointing="auto"), r"'auto' on the simulated device needs gpu_memory_budget"),
])
def test_bad_checkpointing_settings_are_refused_before_allocation(kw, message) -> None:
    with pytest.raises(ValueError, match=message):
        _offloader(tiny_llama(layers=4), backend="native", **kw)


def test_close_after_kept_layers_leaves_an_ordinary_module() -> None:
    model = tiny_llama(layers=3)
    off = _offloader(model, backend="native", activation_checkpointing="none")
    offloaded_training(off, model, batches(1))
    off.close()
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)
    x = batches(1)[0]
    model(input_ids=x, labels=x).loss.backward()
    assert model.model.layers[2].mlp.up_proj.weight.grad is not None


@pytest.mark.parametrize("spec, runs", [("all", [2, 2, 2, 2]), (2, [2, 2, 1, 1]), ("none", [1, 1, 1, 1])])
def test_kept_layers_run_forward_once_and_checkpointed_ones_again_in_backward(spec, runs) -> None:
    model = tiny_llama(layers=4)
    off = _offloader(model, backend="native", activation_checkpointing=spec)
    calls = [0] * 4
    for i, layer in enumerate(model.model.layers):  # the MLP starts inside the layer's forward and its recompute
        # (a pre-hook: the recompute stops inside the MLP's last op, once every saved tensor is back)
        layer.mlp.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    offloaded_training(off, model, batches(1))
    off.close()
    assert calls == runs
