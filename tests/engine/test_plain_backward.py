"""A plain loss.backward() drives the Offloader as off.backward(loss) does: the backward begins when the gradient
first reaches the offloaded layers and ends with autograd's, so Trainer, accelerate and hand-written loops need
no special call. Bit-exact against off.backward(loss) on the simulated device."""
from __future__ import annotations

import copy

import pytest
import torch

import offload_ext
from helpers import batches, offloaded_training, tiny_gpt2, tiny_llama

LR = 1e-3


def _plain_training(off, model, data) -> list[float]:
    losses = []
    for k, x in enumerate(data):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        losses.append(loss.item())
        if k % off.grad_accum == off.grad_accum - 1:
            off.step()
            off.zero_grad()
    return losses


def _both(make, data, **options) -> tuple[list[float], list[float], dict, dict]:
    runs = []
    for train in (offloaded_training, _plain_training):
        model = copy.deepcopy(make)
        off = offload_ext.Offloader(model, lr=LR, weight_decay=0.1, device="cpu", **options)
        losses = train(off, model, data)
        norms = off.last_grad_norm
        off.close()
        runs.append((losses, model.state_dict(), norms))
    (a, wa, na), (b, wb, nb) = runs
    assert na == nb
    return a, b, wa, wb


@pytest.mark.parametrize("options", [
    dict(backend="native"),
    dict(backend="python"),
    dict(backend="native", precision="mixed", grad_accum=2),
    dict(backend="native", max_grad_norm=0.5),
    dict(backend="python", max_grad_norm=0.5, precision="bf16-sr"),
    dict(backend="native", offload_all=True, max_grad_norm=0.5),
    dict(backend="native", activation_checkpointing="none", grad_accum=2),
    dict(backend="native", resident_layers=1),
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_a_plain_backward_trains_bit_exactly_as_off_backward(options) -> None:
    data = batches(6)
    a, b, wa, wb = _both(tiny_llama(layers=3), data, **options)
    assert a == b
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_plain_backward_works_on_gpt2s_blocks_too() -> None:
    a, b, wa, wb = _both(tiny_gpt2(layers=3), batches(4), backend="native")
    assert a == b and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_backward_stopped_by_an_error_fails_the_next_step_with_the_fix() -> None:
    model = tiny_llama(layers=3)
    off = offload_ext.Offloader(model, lr=LR, device="cpu")
    x = batches(1)[0]
    loss = model(input_ids=x, labels=x).loss
    hook = model.model.layers[0].mlp.down_proj.weight.register_hook(lambda g: (_ for _ in ()).throw(ValueError("boom")))
    with pytest.raises(ValueError, match="boom"):
        loss.backward()
    hook.remove()
    with pytest.raises(RuntimeError, match="the last backward did not complete.*close\\(\\) it and continue from a "
                                           "checkpoint"):
        off.step()
    with pytest.raises(RuntimeError, match="an earlier step failed"):
        off.step()
    with pytest.warns(RuntimeWarning, match="training had failed"):
        off.close()


def test_step_without_any_backward_names_both_ways() -> None:
    off = offload_ext.Offloader(tiny_llama(layers=2), lr=LR, device="cpu")
    with pytest.raises(RuntimeError, match=r"step\(\) without a preceding backward; call loss\.backward\(\) \(or "
                                           r"off\.backward\(loss\)\)"):
        off.step()
    off.close()


def test_no_grad_and_eval_forwards_leave_the_next_backward_alone() -> None:
    model = tiny_llama(layers=3)
    ref = copy.deepcopy(model)
    data = batches(3)
    off = offload_ext.Offloader(model, lr=LR, device="cpu")
    off_ref = offload_ext.Offloader(ref, lr=LR, device="cpu")
    with torch.no_grad():
        model(input_ids=data[0], labels=data[0])
    model(input_ids=data[1], labels=data[1])  # a forward whose loss is never used: its hook never fires
    assert _plain_training(off, model, data) == offloaded_training(off_ref, ref, data)
    off.close()
    off_ref.close()
