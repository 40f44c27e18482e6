"""LoRA through the Offloader: a peft model's frozen base weights are streamed to the device and never
stepped (each layer's host step covers its adapters alone), training equals the same peft model trained
without offload, and the adapter it saves loads with peft."""
from __future__ import annotations

import copy

import pytest
import torch

import offload_ext
from helpers import batches, offloaded_training, reference_training, tiny_llama

peft = pytest.importorskip("peft")

LR, WD = 1e-2, 0.0


def _lora(base: torch.nn.Module, targets: list[str], save: list[str] | None = None) -> torch.nn.Module:
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, modules_to_save=save)
    torch.manual_seed(1)
    model = peft.get_peft_model(copy.deepcopy(base), config)
    for name, p in model.named_parameters():  # lora_B starts at zero: make the first steps see the adapters
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model


@pytest.mark.parametrize("precision", ["bf16", "mixed"])
@pytest.mark.parametrize("targets, save", [(["q_proj", "v_proj"], None),
                                           (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"], ["lm_head"])])
def test_a_peft_model_trains_like_without_offload_and_steps_its_adapters_only(precision, targets, save) -> None:
    base = _lora(tiny_llama(layers=3), targets, save)
    frozen = {n: p.detach().clone() for n, p in base.named_parameters() if not p.requires_grad}
    ref_losses, ref_model = reference_training(base, batches(4), precision, LR, WD)
    model = copy.deepcopy(base)
    adapters = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and ".layers." in n)
    off = offload_ext.Offloader(model, lr=LR, weight_decay=WD, precision=precision, device="cpu")
    # The layers' host steps (and gradient copies) cover their adapters alone: the trainable prefixes.
    assert sum(u.trainable_numel for part in off.layout.stacks for u in part.units) == adapters > 0
    assert offloaded_training(off, model, batches(4)) == ref_losses
    off.close()
    for (name, a), b in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(a, b), name
        if name in frozen:
            assert torch.equal(a, frozen[name].bfloat16()), name  # the base weights are never stepped


def test_a_layer_with_frozen_base_weights_waits_for_the_next_forward_to_go_up() -> None:
    # Its input gradient through the base weights may still be computed after the adapters' gradients land: a
    # copy up right after its step could overwrite a buffer a later kernel reads. Exact and never early.
    base = _lora(tiny_llama(layers=3), ["q_proj", "v_proj"])
    ref_losses, _ = reference_training(base, batches(4), "bf16", LR, WD)
    model = copy.deepcopy(base)
    off = offload_ext.Offloader(model, lr=LR, weight_decay=WD, device="cpu", device_layers=3)
    assert offloaded_training(off, model, batches(4)) == ref_losses
    assert off.stats()["early_layer_copies"] == 0
    off.close()


def test_the_saved_adapter_loads_with_peft(tmp_path) -> None:
    base = tiny_llama(layers=2)
    model = _lora(base, ["q_proj", "v_proj"])
    off = offload_ext.Offloader(model, lr=LR, device="cpu")
    offloaded_training(off, model, batches(3))
    weights = off.model_state_dict()
    # peft keeps the adapter entries of the state dict it is given: the Offloader's, whose streamed
    # weights are read from the host buffers.
    model.save_pretrained(str(tmp_path), state_dict=weights)
    off.close()
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path))
    got = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert got
    for name, value in got.items():
        assert torch.equal(value.bfloat16(), weights[name]), name


@pytest.mark.parametrize("max_grad_norm", [1e6, 1e-3])
def test_with_clipping_a_peft_model_trains_exactly_and_keeps_no_second_copy_of_its_base(max_grad_norm) -> None:
    # Speculation would give each layer second buffers of its whole params, the frozen base among them, to hide a
    # host step of its adapters alone: every layer waits for the norm instead, and steps once, clipped or not.
    base = _lora(tiny_llama(layers=3), ["q_proj", "v_proj"])
    ref_losses, ref_model = reference_training(base, batches(4), "bf16", LR, WD, max_grad_norm=max_grad_norm,
                                               exact_clip=True)
    model = copy.deepcopy(base)
    off = offload_ext.Offloader(model, lr=LR, weight_decay=WD, device="cpu", max_grad_norm=max_grad_norm)
    assert offloaded_training(off, model, batches(4)) == ref_losses
    assert off.last_clip_action == ("unclipped" if max_grad_norm > 1 else "clipped")
    assert not any(b.alt for b in off._backend._layers)  # no unit has second buffers
    off.close()
    for (name, a), b in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(a, b), name
