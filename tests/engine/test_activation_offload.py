"""activation_offload on the simulated device: checkpointed layers' inputs wait on the host between forward
and backward, and training is the same as with them on the device, bit for bit."""
from __future__ import annotations

import copy
import weakref

import pytest
import torch

import offload_ext
from helpers import batches, offloaded_training, reference_training, tiny_llama
from offload_ext import testing

LR, WD = 1e-2, 0.1


def _train(base, data, **kw) -> tuple[list[float], torch.nn.Module]:
    model = copy.deepcopy(base)
    off = offload_ext.Offloader(model, lr=LR, weight_decay=WD, device="cpu", activation_offload=True, **kw)
    losses = []
    for k in range(0, len(data), off.grad_accum):
        losses += offloaded_training(off, model, data[k:k + off.grad_accum])
    off.close()
    return losses, model


def _assert_same_model(model, ref_model) -> None:
    for (name, a), b in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("kw", [dict(), dict(activation_checkpointing=2), dict(resident_layers=1),
                                dict(grad_accum=2, accumulate_on_device=True), dict(max_grad_norm=0.5)])
@pytest.mark.parametrize("precision", ["bf16", "mixed"])
@pytest.mark.parametrize("backend", ["python", "native"])
def test_inputs_held_on_the_host_train_exactly_like_training_without_offload(backend, precision, kw) -> None:
    base, data = tiny_llama(layers=4), batches(4)
    ref_losses, ref_model = reference_training(base, data, precision, LR, WD, micro_batches=kw.get("grad_accum", 1),
                                               max_grad_norm=kw.get("max_grad_norm"), exact_clip=True)
    losses, model = _train(base, data, backend=backend, precision=precision, **kw)
    assert losses == ref_losses
    _assert_same_model(model, ref_model)


@pytest.mark.parametrize("offload", [False, True])
def test_checkpointed_layers_inputs_leave_the_device_after_forward(offload) -> None:
    model = tiny_llama(layers=4)
    off = offload_ext.Offloader(model, lr=LR, device="cpu", backend="native", activation_offload=offload,
                                activation_checkpointing=3)  # the top layer is kept: its input stays either way
    inputs = []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda m, args: inputs.append(weakref.ref(args[0])))
    x = batches(1)[0]
    loss = model(input_ids=x, labels=x).loss
    alive = [ref() is not None for ref in inputs]
    off.backward(loss)
    off.step()
    off.close()
    # Checkpointed, each layer's input is what its recompute starts from: on the device until backward,
    # unless it waits on the host. The kept top layer saves its norm's fp32 copy, not its input.
    assert alive == ([False] * 4 if offload else [True, True, True, False])


@pytest.mark.parametrize("backend", ["python", "native"])
def test_held_inputs_under_randomly_delayed_copies_change_nothing(backend) -> None:
    base, data = tiny_llama(layers=5), batches(3)
    ref_losses, _ = reference_training(base, data, "bf16", LR, WD)
    model = copy.deepcopy(base)
    off = offload_ext.Offloader(model, lr=LR, weight_decay=WD, device="cpu", backend=backend, activation_offload=True)
    testing.delayed_copies(off, 3000)
    assert offloaded_training(off, model, data) == ref_losses
    off.close()


def test_dropout_in_the_recompute_draws_what_the_forward_drew() -> None:
    # GPT-2 with dropout: the recompute restores the forward's RNG state, as torch's checkpoint does, so the
    # losses and weights are those of the Offloader without activation offload; its blocks return tuples.
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=64, n_layer=3, n_head=4, n_positions=64,
                                      resid_pdrop=0.2, embd_pdrop=0.0, attn_pdrop=0.2))
    runs = {}
    for offload in (False, True):
        model = copy.deepcopy(base)
        off = offload_ext.Offloader(model, lr=LR, device="cpu", backend="native", activation_offload=offload)
        model.train()
        torch.manual_seed(1)
        runs[offload] = (offloaded_training(off, model, batches(3)), model)
        off.close()
    assert runs[True][0] == runs[False][0]
    _assert_same_model(runs[True][1], runs[False][1])


@pytest.mark.parametrize("backend", ["python", "native"])
def test_layer_whose_input_needs_no_gradient_still_trains_with_inputs_held_on_the_host(backend) -> None:
    # A frozen embedding (as under LoRA) feeds the first layer an input without grad: its recompute must take the
    # input back from the host without one too (ops save by which inputs need a gradient), and its weights move.
    base, data = tiny_llama(layers=3), batches(3)
    base.model.embed_tokens.weight.requires_grad_(False)
    runs = {}
    for offload in (False, True):
        model = copy.deepcopy(base)
        off = offload_ext.Offloader(model, lr=LR, device="cpu", backend=backend, activation_offload=offload)
        runs[offload] = (offloaded_training(off, model, data), model)
        off.close()
    assert runs[True][0] == runs[False][0]
    _assert_same_model(runs[True][1], runs[False][1])
    assert not torch.equal(runs[True][1].model.layers[0].mlp.up_proj.weight, base.model.layers[0].mlp.up_proj.weight)
