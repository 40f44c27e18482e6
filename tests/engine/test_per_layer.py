"""PerLayerOffloadWithBackwardGradient: a loop written for the hook offloader of that name trains unchanged with the
import swapped, with the losses and weights of the Offloader on the same model (the simulated device)."""
from __future__ import annotations

import copy

import pytest
import torch

import offload_ext
from helpers import batches, offloaded_training, tiny_llama
from offload_ext import PerLayerOffloadWithBackwardGradient

KWARGS = dict(lr=3e-4, weight_decay=0.0, fused=True)


def _model() -> torch.nn.Module:
    return tiny_llama(layers=3).bfloat16()


def test_the_hook_offloaders_loop_trains_as_the_offloader_does() -> None:
    model = _model()
    ref = copy.deepcopy(model)
    data = batches(5)
    offloader = PerLayerOffloadWithBackwardGradient(model, torch.optim.AdamW, KWARGS)
    offloader.cpu()  # .cuda() on a GPU: the simulated device here
    losses = []
    for x in data:  # the loop as written for the original, unchanged
        loss = model(input_ids=x, labels=x).loss
        offloader.disable_forward_hook = True
        loss.backward()
        offloader.disable_forward_hook = False
        offloader.optim_step()
        offloader.optim_zero_grad()
        losses.append(loss.item())
    off = offload_ext.Offloader(ref, lr=3e-4, weight_decay=0.0, device="cpu", precision="bf16")
    assert losses == offloaded_training(off, ref, data)
    offloader.offloader.close()
    off.close()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))


def test_disabled_it_leaves_the_model_to_the_optimizer_it_names() -> None:
    model = _model()
    before = copy.deepcopy(model.state_dict())
    offloader = PerLayerOffloadWithBackwardGradient(model, torch.optim.SGD, dict(lr=0.1), enable=False).cpu()
    x = batches(1)[0]
    model(input_ids=x, labels=x).loss.backward()
    offloader.optim_step()
    offloader.optim_zero_grad()
    assert offloader.offloader is None
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("optim_cls, kwargs, error, message", [
    (torch.optim.SGD, dict(lr=0.1), TypeError, "optim_cls must be torch.optim.AdamW"),
    (torch.optim.AdamW, dict(lr=1e-3, amsgrad=True), ValueError, "amsgrad=True is not supported"),
    (torch.optim.AdamW, dict(lr=1e-3, momentum=0.9), TypeError, "unexpected keyword argument 'momentum'"),
])
def test_what_the_host_adamw_cannot_run_is_refused_before_anything_moves(optim_cls, kwargs, error, message) -> None:
    with pytest.raises(error, match=message):
        PerLayerOffloadWithBackwardGradient(_model(), optim_cls, kwargs)


def test_fp32_parameters_are_refused_with_the_cast_that_fixes_it() -> None:
    with pytest.raises(TypeError, match=r"torch.float32; the host AdamW trains bf16 parameters: call "
                                        r"model.bfloat16\(\) first"):
        PerLayerOffloadWithBackwardGradient(tiny_llama(layers=2).float(), torch.optim.AdamW, KWARGS)


def test_training_before_cuda_says_to_call_it() -> None:
    offloader = PerLayerOffloadWithBackwardGradient(_model(), torch.optim.AdamW, KWARGS)
    with pytest.raises(RuntimeError, match=r"call \.cuda\(\) \(or \.cpu\(\)\) before training"):
        offloader.optim_step()
