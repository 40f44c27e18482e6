"""Offloader on the simulated device (device="cpu"): the same hooks, bookkeeping and engine as on a GPU."""
from __future__ import annotations

import copy
import os
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import safetensors.torch
import torch
from torch import nn

import offload_ext
from conftest import bf16_ulp_distance
from helpers import batches, flat_tensors, offloaded_training, reference_training, tiny_gpt2, tiny_llama, to_bf16_params
from offload_ext import testing

LR, WD = 1e-2, 0.1


def _train(model, backend, precision, steps=5, **kw):
    off = offload_ext.Offloader(model, lr=LR, weight_decay=WD, precision=precision, backend=backend,
                                device="cpu", **kw)
    losses = offloaded_training(off, model, batches(steps))
    return losses, off


@pytest.mark.parametrize("precision", ["bf16", "mixed"])
@pytest.mark.parametrize("backend", ["python", "native"])
def test_llama_training_equals_training_without_offload(backend, precision) -> None:
    base = tiny_llama()
    ref_losses, ref_model = reference_training(base, batches(5), precision, LR, WD)
    model = copy.deepcopy(base)
    losses, off = _train(model, backend, precision)
    off.close()
    assert losses == ref_losses  # bit-exact: same arithmetic, same order
    for (name, a), b in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("backend", ["python", "native"])
def test_gpt2_stack_is_found_and_trains_like_without_offload(backend) -> None:
    base = tiny_gpt2()
    ref_losses, _ = reference_training(base, batches(4), "bf16", LR, WD)
    model = copy.deepcopy(base)
    losses, off = _train(model, backend, "bf16", steps=4)
    assert [name for name, _ in offload_ext.models.stacks.find_layer_stacks(model)] == ["transformer.h"]
    off.close()
    assert losses == ref_losses


def test_python_and_native_backends_agree_in_mixed_precision() -> None:
    base = tiny_llama(layers=3)
    runs = {}
    for backend in ("python", "native"):
        model = copy.deepcopy(base)
        losses, off = _train(model, backend, "mixed", steps=4)
        runs[backend] = (losses, off.state_dict())
        off.close()
    assert runs["python"][0] == runs["native"][0]
    for a, b in zip(runs["python"][1]["layers"], runs["native"][1]["layers"]):
        assert torch.equal(a["master"], b["master"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])


def _run_state(base: nn.Module, backend: str, steps: int = 4, precision: str = "bf16-sr", **kw
               ) -> tuple[list[float], list[torch.Tensor], dict]:
    """(losses, trained weights, host state) of a run on the simulated device."""
    model = copy.deepcopy(base)
    off = offload_ext.Offloader(model, lr=LR, weight_decay=WD, precision=precision, backend=backend, device="cpu",
                                sr_seed=5, **kw)
    losses = offloaded_training(off, model, batches(steps * off.grad_accum))
    state = off.state_dict()
    off.close()
    return losses, [p.detach().clone() for p in model.parameters()], state


# The python backend steps bf16-sr by offload_ext.optim.stochastic_rounding's torch ops and the 8-bit precisions
# by offload_ext.optim.eight_bit's, the native one by the kernels; the variants take the engine through group
# ranges, slices (8-bit: cut where a block of the range ends), accumulation inside the step, speculative steps and
# their redos (the python backend clips after backward), the part outside the stacks as a unit, and resident
# layers and device-kept parameters stepped by the torch ops on the device.
@pytest.mark.parametrize("precision", ["bf16-sr", "bf16-8bit", "bf16-8bit-sr"])
@pytest.mark.parametrize("common, native_only", [
    ({}, {}),
    ({"no_decay": ("norm", "bias")}, {"slice_elements": 777, "num_threads": 2}),
    ({"grad_accum": 2, "max_grad_norm": 0.5}, {}),
    ({"max_grad_norm": 1e-3}, {"slice_elements": 1000}),
    ({"offload_all": True, "resident_layers": 1}, {}),
])
def test_python_and_native_backends_agree_bit_for_bit(precision, common, native_only) -> None:
    base = tiny_llama(layers=3)
    python = _run_state(base, "python", precision=precision, **common)
    native = _run_state(base, "native", precision=precision, **common, **native_only)
    assert python[0] == native[0]
    for a, b in zip(python[1], native[1]):
        assert torch.equal(a, b)
    for a, b in zip(python[2]["layers"], native[2]["layers"]):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if a[k] is not None)
        assert (a["exp_avg_absmax"] is not None) == precision.startswith("bf16-8bit")


@pytest.mark.parametrize("max_grad_norm", [0.5, 1e6])  # every step redone / every step committed
def test_bf16_sr_speculative_clipping_equals_clipping_after_backward_bit_for_bit(max_grad_norm) -> None:
    # A redo draws the bits the clipped step would have drawn in the first place; a commit, the unclipped one's.
    base, data = tiny_llama(layers=4), batches(8)
    spec = _clipped_run(base, data, "native", "bf16-sr", max_grad_norm, speculative_clip=True)
    after = _clipped_run(base, data, "native", "bf16-sr", max_grad_norm, speculative_clip=False)
    assert set(spec[3]) == {"redone" if max_grad_norm < 1 else "committed"}
    assert spec[0] == after[0] and spec[1] == after[1]
    for a, b in zip(spec[2].parameters(), after[2].parameters()):
        assert torch.equal(a, b)


def test_bf16_sr_training_is_reproducible_from_its_seed() -> None:
    base = tiny_llama(layers=2)
    runs = []
    for seed in (1, 1, 2):
        model = copy.deepcopy(base)
        off = offload_ext.Offloader(model, lr=LR, precision="bf16-sr", device="cpu", sr_seed=seed)
        offloaded_training(off, model, batches(3))
        off.close()
        runs.append(dict(model.named_parameters()))
    for name in ("model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"):  # device-kept, streamed
        assert torch.equal(runs[0][name], runs[1][name]) and not torch.equal(runs[0][name], runs[2][name])


def test_a_bf16_sr_state_is_refused_by_an_offloader_of_another_seed() -> None:
    # Its stream could not continue: the message names the seed that would.
    base = tiny_llama(layers=2)
    model = copy.deepcopy(base)
    off = offload_ext.Offloader(model, lr=LR, precision="bf16-sr", device="cpu", sr_seed=3)
    offloaded_training(off, model, batches(1))
    saved = off.state_dict()
    off.close()
    same = offload_ext.Offloader(copy.deepcopy(base), lr=LR, precision="bf16-sr", device="cpu", sr_seed=3)
    same.load_state_dict(saved)
    same.close()
    other = offload_ext.Offloader(copy.deepcopy(base), lr=LR, precision="bf16-sr", device="cpu", sr_seed=4)
    with pytest.raises(ValueError, match="sr_seed=3 to continue"):
        other.load_state_dict(saved)
    other.close()


@pytest.mark.parametrize("backend", ["python", "native"])
def test_bf16_sr_moves_streamed_and_device_kept_weights_that_bf16_freezes(backend) -> None:
    # Norm weights start at 1.0, whose bf16 neighbours are 2^-8 below and 2^-7 above. Adam's steps are at most
    # (1 - beta1) / sqrt(1 - beta2) ~ 3.2 times lr = 5e-4, under half the gap below: rounded to nearest, no
    # norm weight ever moves. Rounded stochastically, one moves in a step with a probability of its step over
    # the gap: ~20 % of them in 10 steps here (at least 8 of 64 asked).
    base = tiny_llama(layers=2)
    norms = {}
    for precision in ("bf16", "bf16-sr"):
        model = copy.deepcopy(base)
        off = offload_ext.Offloader(model, lr=5e-4, precision=precision, backend=backend, device="cpu")
        offloaded_training(off, model, batches(10))
        off.close()
        norms[precision] = [model.model.norm.weight, model.model.layers[1].input_layernorm.weight]
    for frozen, moved in zip(norms["bf16"], norms["bf16-sr"]):  # the device optimizer's, a host unit's
        assert torch.all(frozen == 1.0) and (moved != 1.0).sum() >= 8


# With clipping, the native backend's speculative steps leave a unit's params in its second buffer: the
# frozen part must be there too, or the next forward reads zeros (never triggers / triggers every step).
@pytest.mark.parametrize("max_grad_norm", [None, 1e6, 0.5])
def test_frozen_parameters_are_streamed_but_not_stepped(max_grad_norm) -> None:
    base = tiny_llama(layers=3)
    for layer in base.model.layers:
        layer.input_layernorm.weight.requires_grad_(False)
    ref_losses, ref_model = reference_training(base, batches(3), "bf16", LR, WD, max_grad_norm=max_grad_norm,
                                               exact_clip=True)
    model = copy.deepcopy(base)
    losses, off = _train(model, "native", "bf16", steps=3, max_grad_norm=max_grad_norm)
    if max_grad_norm is not None:
        assert off.last_clip_action == ("redone" if max_grad_norm < 1 else "committed")
    off.close()
    assert losses == ref_losses
    for layer, ref_layer in zip(model.model.layers, ref_model.model.layers):
        assert torch.equal(layer.input_layernorm.weight, base.model.layers[0].input_layernorm.weight.bfloat16())
        assert torch.equal(layer.mlp.up_proj.weight, ref_layer.mlp.up_proj.weight)


@pytest.mark.parametrize("backend", ["python", "native"])
def test_state_dict_round_trip_continues_the_same_run(backend) -> None:
    base = tiny_llama(layers=3)
    data = batches(6)
    model = copy.deepcopy(base)
    off = offload_ext.Offloader(model, lr=LR, weight_decay=WD, precision="mixed", backend=backend, device="cpu")
    offloaded_training(off, model, data[:3])
    saved = off.state_dict()
    expected = offloaded_training(off, model, data[3:])
    off.close()

    resumed_model = copy.deepcopy(base)
    off2 = offload_ext.Offloader(resumed_model, lr=LR, weight_decay=WD, precision="mixed", backend=backend,
                                 device="cpu")
    off2.load_state_dict(saved)
    assert offloaded_training(off2, resumed_model, data[3:]) == expected
    off2.close()


def _saved_midway(tmp_path, base: torch.nn.Module, kw: dict[str, Any], data: list[torch.Tensor], split: int,
                  after_save: Callable[[Any], None] | None = None) -> list[float]:
    """A copy of `base` trained on data[:split], save_state into tmp_path (then `after_save(offloader)`), trained on
    the rest: the rest's losses, which a run resumed from tmp_path must give."""
    model = copy.deepcopy(base)
    off = offload_ext.Offloader(model, **kw)
    offloaded_training(off, model, data[:split])
    off.save_state(str(tmp_path))
    if after_save is not None:
        after_save(off)
    expected = offloaded_training(off, model, data[split:])
    off.close()
    return expected


@pytest.mark.parametrize("precision", ["bf16", "bf16-sr", "mixed", "bf16-8bit-sr"])
def test_save_state_to_a_directory_continues_the_same_run(tmp_path, precision) -> None:
    # save_state writes the host buffers from where they live (no copy in memory) and load_state reads
    # them back into place: the same run as state_dict / load_state_dict, after speculative steps too.
    base, data = tiny_llama(layers=3), batches(6)
    kw = dict(lr=LR, weight_decay=WD, precision=precision, backend="native", device="cpu", max_grad_norm=0.5)
    expected = _saved_midway(tmp_path, base, kw, data, 3)
    resumed = copy.deepcopy(base)
    off2 = offload_ext.Offloader(resumed, **kw)
    offloaded_training(off2, resumed, data[:1])  # its buffers swapped once: load into the live ones
    off2.load_state(str(tmp_path))
    assert offloaded_training(off2, resumed, data[3:]) == expected
    off2.close()
    other = offload_ext.Offloader(tiny_llama(layers=2), **kw)
    with pytest.raises(ValueError, match="another model"):  # refused before any buffer is written
        other.load_state(str(tmp_path))
    other.close()


def _tensor_bytes(path) -> int:
    """The tensor data a safetensors file holds: its size less the 8-byte length and the JSON header."""
    with open(path, "rb") as f:
        header = int.from_bytes(f.read(8), "little")
    return os.path.getsize(path) - 8 - header


@pytest.mark.parametrize("precision", ["bf16", "mixed"])
def test_saved_nbytes_is_the_tensor_data_save_state_and_save_pretrained_write(tmp_path, precision) -> None:
    # offload-train's disk-space check before a fresh run's first save counts on it; a resident layer's device
    # state counts once the first step has made it
    model = tiny_llama(layers=3)
    off = offload_ext.Offloader(model, lr=LR, weight_decay=WD, precision=precision, backend="native", device="cpu",
                                resident_layers=1)
    offloaded_training(off, model, batches(2))
    off.save_state(str(tmp_path))
    state = _tensor_bytes(tmp_path / "engine_state.safetensors") + _tensor_bytes(tmp_path / "engine_device.safetensors")
    assert off.saved_nbytes(weights=False) == state
    weights = off.save_pretrained(str(tmp_path / "weights"))
    assert off.saved_nbytes() == state + sum(_tensor_bytes(path) for path in weights)
    # with a filter: the names it accepts (a LoRA adapter saved alone), counted without copying them
    attention = off.model_state_dict(include=lambda name: ".self_attn." in name)
    assert attention
    assert off.saved_nbytes(include=lambda name: ".self_attn." in name) == state + sum(
        t.numel() * t.element_size() for t in attention.values())
    off.close()


def _tensors_in(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else []
    return [t for v in items for t in _tensors_in(v)]


@pytest.mark.parametrize("precision", ["bf16-sr", "mixed"])
def test_save_state_streams_the_device_state_into_its_own_file_and_keeps_no_tensor_in_the_small_one(
        tmp_path, precision) -> None:
    # A checkpoint never holds the device's whole state on the host: engine_state.pt is tensor-free, and
    # engine_device.safetensors holds what state_dict()'s device part holds, bit for bit (a resident layer's too).
    model = tiny_llama(layers=3)
    off = offload_ext.Offloader(model, lr=LR, weight_decay=WD, precision=precision, backend="native", device="cpu",
                                resident_layers=1)
    offloaded_training(off, model, batches(2))
    off.save_state(str(tmp_path))
    outer = off.state_dict()["outer"]
    off.close()
    small = torch.load(tmp_path / "engine_state.pt", weights_only=True)
    assert _tensors_in(small) == []
    saved = safetensors.torch.load_file(str(tmp_path / "engine_device.safetensors"))
    expected = {**{f"params.{i}": t for i, t in enumerate(outer["params"])},
                **{f"masters.{i}": t for i, t in enumerate(outer["masters"])},
                **{f"optimizer.{i}.{k}": t for i, entries in outer["optimizer"]["state"].items()
                   for k, t in entries.items()}}
    assert saved.keys() == expected.keys() and len(outer["optimizer"]["state"]) > 0
    for name, t in expected.items():
        assert saved[name].dtype == t.dtype and torch.equal(saved[name], t), name


def test_load_state_into_an_offloader_that_has_stepped_reads_into_its_device_moments_in_place(tmp_path) -> None:
    # The device optimizer's live moments are the load's targets: no second set beside them, and the run goes on
    # as the saved one.
    base, data = tiny_llama(layers=3), batches(5)
    kw = dict(lr=LR, weight_decay=WD, precision="mixed", backend="native", device="cpu", resident_layers=1)
    expected = _saved_midway(tmp_path, base, kw, data, 2)
    resumed = copy.deepcopy(base)
    off2 = offload_ext.Offloader(resumed, **kw)
    offloaded_training(off2, resumed, data[:1])
    moments = {(id(p), k): t.data_ptr() for p, s in off2._device_opt.opt.state.items() for k, t in s.items()
               if t.dim() > 0}
    off2.load_state(str(tmp_path))
    after = {(id(p), k): t.data_ptr() for p, s in off2._device_opt.opt.state.items() for k, t in s.items()
             if t.dim() > 0}
    assert len(moments) > 0 and after == moments
    assert offloaded_training(off2, resumed, data[2:]) == expected
    off2.close()


def test_load_state_reads_a_directory_whose_small_file_holds_the_device_state(tmp_path) -> None:
    # Directories written before the device's tensors had a file of their own keep loading.
    base, data = tiny_llama(layers=3), batches(5)
    kw = dict(lr=LR, weight_decay=WD, precision="mixed", backend="native", device="cpu", max_grad_norm=0.5)

    def older_form(off: Any) -> None:
        small = torch.load(tmp_path / "engine_state.pt", weights_only=True)
        torch.save({**small, "outer": off.state_dict()["outer"]}, tmp_path / "engine_state.pt")
        (tmp_path / "engine_device.safetensors").unlink()

    expected = _saved_midway(tmp_path, base, kw, data, 2, older_form)
    resumed = copy.deepcopy(base)
    off2 = offload_ext.Offloader(resumed, **kw)
    off2.load_state(str(tmp_path))
    assert offloaded_training(off2, resumed, data[2:]) == expected
    off2.close()


def test_load_state_refuses_device_tensors_of_another_shape_before_writing_anything(tmp_path) -> None:
    # The same layers with a larger vocabulary: the host buffers would fit, the embeddings do not; the refusal
    # comes before the host buffers are read into.
    kw = dict(lr=LR, weight_decay=WD, precision="bf16", backend="native", device="cpu")
    model = tiny_llama(layers=2)
    off = offload_ext.Offloader(model, **kw)
    offloaded_training(off, model, batches(2))
    off.save_state(str(tmp_path))
    off.close()
    other = tiny_llama(layers=2)
    other.resize_token_embeddings(160, mean_resizing=False)
    off2 = offload_ext.Offloader(other, **kw)
    before = off2.state_dict()
    with pytest.raises(ValueError, match=r"saved params\.0 is \[128, 64\].*another model"):
        off2.load_state(str(tmp_path))
    after = off2.state_dict()
    off2.close()
    assert all(torch.equal(a, b) for a, b in zip(_tensors_in(before["layers"]), _tensors_in(after["layers"])))


@pytest.mark.parametrize("resident_layers", [0, 1])
@pytest.mark.parametrize("precision", ["bf16", "mixed", "bf16-8bit"])
@pytest.mark.parametrize("max_grad_norm", [0.5, 1e6])  # every step redone / every step committed
def test_state_dict_after_speculative_steps_continues_the_same_run(precision, max_grad_norm, resident_layers) -> None:
    # Each speculative step leaves the live state in the other of a unit's two buffers: after an odd number
    # of steps, the state saved and the state loaded must be the live ones (a resident layer's, the device's).
    base, data = tiny_llama(layers=3), batches(5)
    kw = dict(lr=LR, weight_decay=WD, precision=precision, backend="native", device="cpu",
              max_grad_norm=max_grad_norm, resident_layers=resident_layers)
    model = copy.deepcopy(base)
    off = offload_ext.Offloader(model, **kw)
    offloaded_training(off, model, data[:3])
    saved = off.state_dict()
    expected = offloaded_training(off, model, data[3:])
    off.close()
    resumed_model = copy.deepcopy(base)
    off2 = offload_ext.Offloader(resumed_model, **kw)
    offloaded_training(off2, resumed_model, data[:1])  # its buffers swapped once: load into the live ones
    off2.load_state_dict(saved)
    assert offloaded_training(off2, resumed_model, data[3:]) == expected
    off2.close()
    for a, b in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.usefixtures("restore_kernel_settings")
@pytest.mark.parametrize("level", offload_ext.ops.SIMD_LEVELS)
def test_every_simd_level_trains_accumulation_and_speculative_clipping_exactly(level) -> None:
    # The engine's own passes (a step summing accum + gradient in its read, a step out of place into the
    # second buffers, a redo from them, the accumulate-and-norm pass) at each instruction set.
    if level not in offload_ext.ops.supported_simd_levels():
        pytest.skip(f"this CPU lacks {level}")
    offload_ext.set_simd_level(level)
    base, data = tiny_llama(layers=3), batches(4)
    ref_losses, ref_model = reference_training(base, data, "bf16", LR, WD, micro_batches=2)
    model = copy.deepcopy(base)
    off = offload_ext.Offloader(model, lr=LR, weight_decay=WD, backend="native", device="cpu", grad_accum=2)
    assert offloaded_training(off, model, data) == ref_losses
    off.close()
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)
    losses, norms, model, actions = _clipped_run(base, data, "native", "mixed")
    exact_norms: list[float] = []
    assert losses == reference_training(base, data, "mixed", LR, WD, micro_batches=2, max_grad_norm=0.5,
                                        norms=exact_norms, exact_clip=True)[0]
    assert set(actions) == {"redone"} and norms == pytest.approx(exact_norms, rel=1e-12)
    # bf16-sr's redone steps at this level draw the bits of the python backend's torch ops
    native, python = (_clipped_run(base, data, b, "bf16-sr") for b in ("native", "python"))
    assert native[0] == python[0] and all(torch.equal(a, b) for a, b in zip(native[2].parameters(),
                                                                           python[2].parameters()))


def test_host_buffers_this_machine_cannot_hold_are_refused_before_allocation() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from offload_ext.planning.host_sizes import available_host_bytes

    cfg = LlamaConfig(vocab_size=1000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=48,
                      num_attention_heads=64, num_key_value_heads=8)  # 41 B params: over 400 GB of host buffers
    available = available_host_bytes()
    if available is None or available > 500e9:
        pytest.skip("needs a host with less than 500 GB available and /proc/meminfo")
    with torch.device("meta"):  # nothing real is allocated: the check comes before the host buffers
        model = LlamaForCausalLM(cfg)
    refused = r"need [1-9][0-9]{2}\.[0-9] GB .* nothing was allocated.*speculative_clip=False \(saves"
    with pytest.raises(MemoryError, match=refused):
        offload_ext.Offloader(model, backend="native", device="cpu", max_grad_norm=1.0)


def test_pageable_buffers_are_checked_again_after_page_locking(monkeypatch) -> None:
    # A machine whose available memory drops by more than what was page-locked (a sandbox counting it
    # twice, say): the pageable part is refused before any of it is allocated, naming the cost.
    from offload_ext.planning import host_sizes as sizes

    readings = iter([1 << 50, 1 << 10])  # before page-locking: plenty; after: 1 kB
    monkeypatch.setattr(sizes, "available_host_bytes", lambda: next(readings))
    with pytest.raises(MemoryError, match=r"page-locking 0\.\d GB took .* GB of available memory, and the "
                                          r"pinned memory is released again"):
        offload_ext.Offloader(tiny_llama(layers=2), backend="native", device="cpu")


def test_close_leaves_an_ordinary_module_with_the_trained_weights() -> None:
    model = tiny_llama(layers=2)
    losses, off = _train(model, "native", "bf16", steps=2)
    weights = off.model_state_dict()
    with off:
        pass  # __exit__ closes
    assert all(p.device.type == "cpu" and p.numel() > 0 for p in model.parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, weights[name]), name
    assert "forward" not in model.model.layers[0].__dict__
    x = batches(1)[0]
    loss = model(input_ids=x, labels=x).loss
    loss.backward()  # an ordinary module again: plain autograd works
    assert model.model.layers[0].mlp.up_proj.weight.grad is not None


@pytest.mark.parametrize("backend", ["python", "native"])
def test_randomly_delayed_copies_change_nothing(backend) -> None:
    base = tiny_llama(layers=4)
    ref_losses, _ = _train(copy.deepcopy(base), backend, "bf16", steps=3)
    model = copy.deepcopy(base)
    off = offload_ext.Offloader(model, lr=LR, weight_decay=WD, backend=backend, device="cpu")
    testing.delayed_copies(off, 3000)
    assert offloaded_training(off, model, batches(3)) == ref_losses
    off.close()


def test_a_grad_ring_smaller_than_the_stack_waits_for_each_slots_step() -> None:
    base = tiny_llama(layers=5)
    ref_losses, ref_model = reference_training(base, batches(3), "mixed", LR, WD)
    model = copy.deepcopy(base)
    off = offload_ext.Offloader(model, lr=LR, weight_decay=WD, precision="mixed", backend="native", device="cpu",
                                grad_slots=2)
    testing.delayed_copies(off, 2000)
    assert offloaded_training(off, model, batches(3)) == ref_losses
    off.close()
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("async_step", [True, False])
def test_a_failed_host_step_surfaces_at_the_next_call(async_step) -> None:
    model = tiny_llama(layers=2)
    off = offload_ext.Offloader(model, backend="native", device="cpu", async_step=async_step)
    testing.fail_next_host_step(off)
    x = batches(1)[0]
    with pytest.raises(RuntimeError, match="injected failure"):
        # asynchronous, with a buffer per layer: already inside backward (the failed layer's copy up after its
        # step), else in step() or the next forward at the latest; synchronous: in step()
        off.backward(model(input_ids=x, labels=x).loss)
        off.step()
        model(input_ids=x, labels=x)


@pytest.mark.parametrize("precision", ["bf16", "mixed"])
def test_async_step_returns_early_and_each_layer_waits_for_its_own_step(precision) -> None:
    base = tiny_llama(layers=4)
    ref_losses, ref_model = reference_training(base, batches(4), precision, LR, WD)
    model = copy.deepcopy(base)
    off = offload_ext.Offloader(model, lr=LR, weight_decay=WD, precision=precision, backend="native", device="cpu")
    testing.slow_host_steps(off, 20_000)  # a host far slower than the device: steps outlast backward
    pending_after_step = []
    losses = []
    for x in batches(4):
        loss = model(input_ids=x, labels=x).loss
        off.backward(loss)
        losses.append(loss.item())
        off.step()
        pending_after_step.append(len(testing.pending_units(off)))
        off.zero_grad()
    off.close()
    assert max(pending_after_step) > 0  # step() did return with layers still queued
    assert losses == ref_losses         # and yet no layer ran on stale weights
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)


def test_synchronous_step_leaves_nothing_pending() -> None:
    model = tiny_llama(layers=3)
    off = offload_ext.Offloader(model, backend="native", device="cpu", async_step=False)
    testing.slow_host_steps(off, 5_000)
    x = batches(1)[0]
    off.backward(model(input_ids=x, labels=x).loss)
    off.step()
    assert testing.pending_units(off) == []
    off.close()


@pytest.mark.parametrize("backend", ["python", "native"])
def test_device_layers_keep_the_last_forward_layers_for_their_recompute(backend) -> None:
    base = tiny_llama(layers=4)
    ref_losses, ref_model = reference_training(base, batches(3), "mixed", LR, WD)
    copies = {}
    for device_layers in (2, 3, 4):
        model = copy.deepcopy(base)
        # Synchronous steps: the prefetch of layer 0 at the end of a step happens only if its host step is
        # done by then (else the next forward's bind copies it); after the last step there is no next forward.
        off = offload_ext.Offloader(model, lr=LR, weight_decay=WD, precision="mixed", backend=backend,
                                    device="cpu", device_layers=device_layers, async_step=False)
        before = off.stats()["layer_copies_h2d"]  # layer 0, prefetched when the Offloader was built
        assert offloaded_training(off, model, batches(3)) == ref_losses
        copies[device_layers] = (off.stats()["layer_copies_h2d"] - before) / 3
        off.close()
        for a, b in zip(model.parameters(), ref_model.parameters()):
            assert torch.equal(a, b)
    # Per step: 4 forward copies, plus a recompute copy for each layer not still on the device.
    assert copies == {2: 4 + 2, 3: 4 + 1, 4: 4}


@pytest.mark.parametrize("accumulate_on_device", [False, True])
def test_a_layer_with_a_buffer_of_its_own_goes_up_after_its_step_and_trains_exactly(accumulate_on_device) -> None:
    # device_layers = the stack: each layer's new weights are copied up once its host step is done (inside
    # backward, or at the latest in step(): here every step is done by then), and the next forward binds them
    # without another copy. Summed on the host, the first micro-batch's copies to the host are not steps:
    # nothing may go up after them (stale weights would change the losses).
    base, data = tiny_llama(layers=4), batches(6)
    ref_losses, ref_model = reference_training(base, data, "bf16", LR, WD, micro_batches=2)
    model = copy.deepcopy(base)
    off = offload_ext.Offloader(model, lr=LR, weight_decay=WD, backend="native", device="cpu", grad_accum=2,
                                device_layers=4, accumulate_on_device=accumulate_on_device)
    testing.delayed_copies(off, 500)
    losses, copies = [], [(0, off.stats()["layer_copies_h2d"])]  # layer 0, copied up at set-up
    for k, x in enumerate(data):
        loss = model(input_ids=x, labels=x).loss
        off.backward(loss)
        losses.append(loss.item())
        if k % 2:
            while testing.pending_units(off):
                time.sleep(0.001)
            off.step()
            off.zero_grad()
            stats = off.stats()
            copies.append((stats["early_layer_copies"], stats["layer_copies_h2d"]))
    off.close()
    assert losses == ref_losses
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)
    # the first forward copies layers 1-3 up; from then on, each step copies every layer once, right after its step
    assert copies == [(0, 1), (4, 8), (8, 12), (12, 16)]


def _accum2_trained_exactly(max_grad_norm: float | None = None, **kw: Any) -> dict:
    """Two steps of two micro-batches through a native Offloader on the simulated device (`kw` its options),
    asserted bit-exact with the reference rule (clipping by the float64 norm); the Offloader's stats after."""
    base, data = tiny_llama(layers=4), batches(4)
    ref_losses, ref_model = reference_training(base, data, "bf16", LR, WD, micro_batches=2,
                                               max_grad_norm=max_grad_norm, exact_clip=max_grad_norm is not None)
    model = copy.deepcopy(base)
    off = offload_ext.Offloader(model, lr=LR, weight_decay=WD, backend="native", device="cpu", grad_accum=2,
                                max_grad_norm=max_grad_norm, **kw)
    losses = offloaded_training(off, model, data)
    stats = off.stats()
    off.close()
    assert losses == ref_losses
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)
    return stats


def test_host_steps_at_the_lowest_priority_train_clipping_and_accumulation_exactly() -> None:
    stats = _accum2_trained_exactly(max_grad_norm=0.05, num_threads=3, host_nice=19)
    assert stats["host_nice"] == 19


def test_eager_uploads_off_keeps_each_copy_at_the_next_forward_and_trains_exactly() -> None:
    stats = _accum2_trained_exactly(device_layers=4, eager_uploads=False)
    assert stats["early_layer_copies"] == 0
    # two steps: the first forward's four, then each layer once after the first step (at the next forward), and
    # layer 0 prefetched again after the second if its host step has ended by then (else its next bind loads it:
    # the host thread's timing decides, 1 run in ~15 under load)
    assert stats["layer_copies_h2d"] in (4 + 4, 4 + 4 + 1)


def test_no_layer_goes_up_before_the_next_forward_where_clipping_may_redo_its_step() -> None:
    model = tiny_llama(layers=4)
    off = offload_ext.Offloader(model, lr=LR, backend="native", device="cpu", device_layers=4, max_grad_norm=1.0)
    offloaded_training(off, model, batches(2))
    assert off.stats()["early_layer_copies"] == 0
    off.close()


def test_python_backend_layer_buffers_are_disjoint_page_aligned_views_of_one_allocation() -> None:
    off = offload_ext.Offloader(tiny_llama(layers=3), backend="python", device="cpu", offload_all=True)
    start, end = testing.pinned_arena_bounds(off)
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for b in testing.host_buffers(off)
                   for t in (b.params, b.grads))
    assert len(spans) == 2 * 4  # three layers and the unit outside the stacks
    assert all(a % 4096 == 0 for a, _ in spans)
    assert spans[0][0] >= start and spans[-1][1] <= end
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
    off.close()


def test_fewer_than_two_device_layers_are_refused() -> None:
    with pytest.raises(ValueError, match="device_layers must be an int >= 2"):
        offload_ext.Offloader(tiny_llama(layers=2), device="cpu", device_layers=1)


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2])  # GPT-2's blocks take the cache positionally
@pytest.mark.parametrize("backend", ["python", "native"])
def test_training_forward_writes_no_kv_cache_so_recompute_sees_the_same_keys(backend, make) -> None:
    model = make(layers=2)
    assert model.config.use_cache  # HF would build and fill a cache in this forward
    off = offload_ext.Offloader(model, backend=backend, device="cpu")
    x = batches(1)[0]
    out = model(input_ids=x, labels=x)
    cache = getattr(out, "past_key_values", None)
    assert cache is None or cache.get_seq_length() == 0
    off.backward(out.loss)
    assert cache is None or cache.get_seq_length() == 0  # nor in the recompute
    off.step()
    off.close()


def test_per_layer_torch_compile_trains_like_eager_on_the_simulated_device() -> None:
    base = tiny_llama(layers=2)
    runs = {}
    for compiled in (False, True):
        model = copy.deepcopy(base)
        losses, off = _train(model, "native", "bf16", steps=3, compile_layers=compiled)
        runs[compiled] = losses
        off.close()
    for a, b in zip(runs[True], runs[False]):
        assert abs(a - b) <= 0.02 * abs(b) + 0.02, runs


def test_async_step_is_refused_by_the_python_backend() -> None:
    with pytest.raises(ValueError, match="async_step needs backend='native'"):
        offload_ext.Offloader(tiny_llama(layers=2), backend="python", device="cpu", async_step=True)


def test_backward_twice_without_step_is_refused() -> None:
    model = tiny_llama(layers=2)
    off = offload_ext.Offloader(model, backend="native", device="cpu")
    x = batches(1)[0]
    off.backward(model(input_ids=x, labels=x).loss)
    with pytest.raises(RuntimeError, match="backward\\(\\) called 2 times without step\\(\\), with grad_accum=1"):
        off.backward(model(input_ids=x, labels=x).loss)


def test_model_without_layer_stack_is_refused() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(ValueError, match="found no layer stack"):
        offload_ext.Offloader(model, device="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error shown when CUDA is absent")
def test_cuda_device_without_cuda_is_refused() -> None:
    with pytest.raises(RuntimeError, match="CUDA is not available.*device='cpu'"):
        offload_ext.Offloader(tiny_llama(layers=2), device="cuda")


def test_unknown_precision_and_backend_are_refused() -> None:
    with pytest.raises(ValueError, match="precision must be 'bf16', 'bf16-sr'"):
        offload_ext.Offloader(tiny_llama(layers=2), precision="fp8", device="cpu")
    with pytest.raises(ValueError, match="backend must be 'native' or 'python'"):
        offload_ext.Offloader(tiny_llama(layers=2), backend="jax", device="cpu")
    with pytest.raises(ValueError, match="grad_slots must be None or an int >= 1"):
        offload_ext.Offloader(tiny_llama(layers=2), device="cpu", grad_slots=0)
    with pytest.raises(ValueError, match=r"host_nice must be an int in \[0, 19\].*got -1"):
        offload_ext.Offloader(tiny_llama(layers=2), device="cpu", host_nice=-1)
    with pytest.raises(ValueError, match="host_nice needs backend='native'"):
        offload_ext.Offloader(tiny_llama(layers=2), device="cpu", backend="python", host_nice=5)


def test_hf_gradient_checkpointing_is_paused_while_attached_and_restored_on_close() -> None:
    model = tiny_llama(layers=2)
    offload_ext.enable_activation_checkpointing(model)
    with offload_ext.Offloader(model, backend="native", device="cpu") as off:
        assert not model.model.layers[0].gradient_checkpointing  # the Offloader checkpoints each layer itself
        offloaded_training(off, model, batches(1))
    assert model.model.layers[0].gradient_checkpointing


@pytest.mark.parametrize("precision", ["bf16", "mixed"])
@pytest.mark.parametrize("backend", ["python", "native"])
def test_offload_all_steps_every_parameter_on_the_host_like_training_without_offload(backend, precision) -> None:
    base = tiny_llama(layers=3)
    ref_losses, ref_model = reference_training(base, batches(4), precision, LR, WD)
    model = copy.deepcopy(base)
    off = offload_ext.Offloader(model, lr=LR, weight_decay=WD, precision=precision, backend=backend,
                                device="cpu", offload_all=True)
    assert off.layout.device_params == ()  # no device optimizer: the embeddings, norm and head are host-stepped
    losses = offloaded_training(off, model, batches(4))
    off.close()
    for ours, ref in zip(losses, ref_losses):
        assert ours == pytest.approx(ref, rel=1e-3)
    for (name, a), b in zip(model.named_parameters(), ref_model.parameters()):
        assert bf16_ulp_distance(a, b).max().item() <= 2, name


@pytest.mark.parametrize("on_device", [False, True])
@pytest.mark.parametrize("precision", ["bf16", "mixed"])
@pytest.mark.parametrize("backend", ["python", "native"])
def test_gradient_accumulation_equals_torch_accumulating_grads(backend, precision, on_device) -> None:
    base = tiny_llama(layers=4)
    data = batches(6)
    ref_losses, ref_model = reference_training(base, data, precision, LR, WD, micro_batches=3)
    model = copy.deepcopy(base)
    off = offload_ext.Offloader(model, lr=LR, weight_decay=WD, precision=precision, backend=backend, device="cpu",
                                grad_accum=3, grad_slots=2, accumulate_on_device=on_device)
    testing.delayed_copies(off, 1000)
    losses = offloaded_training(off, model, data)
    off.close()
    assert losses == ref_losses
    for (name, a), b in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(a, b), name


def test_summed_on_the_device_streamed_grads_are_the_running_sum_between_micro_batches_as_in_torch() -> None:
    # Between the micro-batches of a step a streamed parameter's .grad is the sum so far (autograd adds
    # into it in place), bit-exact with torch's own .grad; zero_grad() in between drops it, as in torch;
    # after the step's last backward it is None (on its way to the host).
    base = to_bf16_params(tiny_llama(layers=3))
    data = batches(3)
    ref = copy.deepcopy(base)
    model = copy.deepcopy(base)
    off = offload_ext.Offloader(model, backend="native", device="cpu", grad_accum=3, accumulate_on_device=True)
    pairs = [(p, q) for (name, p), q in zip(model.named_parameters(), ref.parameters()) if ".layers." in name]
    offload_ext.enable_activation_checkpointing(ref)
    for k, x in enumerate(data):
        if k == 1:  # drops micro-batch 0 on both sides
            model.zero_grad()
            ref.zero_grad()
        off.backward(model(input_ids=x, labels=x).loss)
        ref(input_ids=x, labels=x).loss.backward()
        for p, q in pairs:
            assert (p.grad is None) if k == 2 else torch.equal(p.grad, q.grad)
    off.step()
    off.close()


def test_sums_on_the_device_reach_the_host_once_per_step_with_no_host_accumulation() -> None:
    model = tiny_llama(layers=4)
    off = offload_ext.Offloader(model, backend="native", device="cpu", grad_accum=3, accumulate_on_device=True)
    data = batches(6)
    offloaded_training(off, model, data[:3])
    testing.settle(off)
    with off.trace() as timeline:
        offloaded_training(off, model, data[3:])
    off.close()
    d2h = [e for e in timeline.events if e[0] == "D2H"]
    host = {name.rsplit(" u", 1)[0] for lane, name, *_ in timeline.events if lane == "host step"}
    assert sorted(e[4] for e in d2h) == [0, 1, 2, 3] and host == {"step"}, (d2h, host)


@pytest.mark.parametrize("max_grad_norm, grad_accum", [(None, 1), (0.5, 2), (1e6, 1)])
@pytest.mark.parametrize("precision", ["bf16", "mixed"])
@pytest.mark.parametrize("backend", ["python", "native"])
def test_resident_layers_train_exactly_like_the_streamed_ones(backend, precision, max_grad_norm, grad_accum) -> None:
    # The lowest layers stay on the device, stepped there by torch's AdamW; the rest stream as before.
    base, data = tiny_llama(layers=4), batches(4)
    ref_losses, ref_model = reference_training(base, data, precision, LR, WD, micro_batches=grad_accum,
                                               max_grad_norm=max_grad_norm, exact_clip=True)
    model = copy.deepcopy(base)
    off = offload_ext.Offloader(model, lr=LR, weight_decay=WD, precision=precision, backend=backend, device="cpu",
                                resident_layers=2, grad_accum=grad_accum, max_grad_norm=max_grad_norm)
    assert [len(part.units) for part in off.layout.stacks] == [2] and len(off.layout.resident) == 2
    losses = []
    for k in range(0, len(data), grad_accum):
        losses += offloaded_training(off, model, data[k:k + grad_accum])
    off.close()
    assert losses == ref_losses
    for (name, a), b in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(a, b), name


def test_resident_layers_leave_a_streamed_layer_in_every_stack() -> None:
    with pytest.raises(ValueError, match=r"resident_layers must be in \[0, 3\].*got 4"):
        offload_ext.Offloader(tiny_llama(layers=4), backend="native", device="cpu", resident_layers=4)


def test_step_before_all_micro_batches_is_refused() -> None:
    model = tiny_llama(layers=2)
    off = offload_ext.Offloader(model, backend="native", device="cpu", grad_accum=2)
    x = batches(1)[0]
    off.backward(model(input_ids=x, labels=x).loss)
    with pytest.raises(RuntimeError, match="step\\(\\) after 1 backward\\(\\) calls, with grad_accum=2"):
        off.step()


def _clipped_run(base, data, backend, precision, max_grad_norm=0.5, grad_accum=2, **kw):
    """(losses, norms, model, clip actions) of a clipped run with randomly delayed copies."""
    model = copy.deepcopy(base)
    off = offload_ext.Offloader(model, lr=LR, weight_decay=WD, precision=precision, backend=backend, device="cpu",
                                grad_accum=grad_accum, max_grad_norm=max_grad_norm, grad_slots=2, **kw)
    testing.delayed_copies(off, 3000)  # the last gradient copies land after backward has returned
    norms: list[float] = []
    actions: list[str | None] = []
    losses = []
    for k in range(0, len(data), grad_accum):
        losses += offloaded_training(off, model, data[k:k + grad_accum], norms=norms)
        actions.append(off.last_clip_action)
    off.close()
    return losses, norms, model, actions


# Speculative clipping (the native default) steps each unit as its gradients land and redoes it exactly
# from a backup when the norm clips; speculative_clip=False (and the python backend) clip after backward.
CLIP_VARIANTS = [("python", True), ("native", True), ("native", False)]


@pytest.mark.parametrize("on_device", [False, True])
@pytest.mark.parametrize("precision", ["bf16", "mixed"])
@pytest.mark.parametrize("backend, speculative", CLIP_VARIANTS)
def test_gradient_clipping_is_exact_and_agrees_with_torch_clip_grad_norm(backend, speculative, precision,
                                                                          on_device) -> None:
    base, data = tiny_llama(layers=4), batches(8)
    losses, norms, model, actions = _clipped_run(base, data, backend, precision, speculative_clip=speculative,
                                                 accumulate_on_device=on_device)
    assert set(actions) == ({"redone"} if backend == "native" and speculative else {"clipped"})
    exact_norms: list[float] = []
    fp32_norms: list[float] = []
    exact_losses, exact_model = reference_training(base, data, precision, LR, WD, micro_batches=2,
                                                   max_grad_norm=0.5, norms=exact_norms, exact_clip=True,
                                                   fp32_norms=fp32_norms)
    assert min(exact_norms) > 0.5  # clipping was active on every step
    assert losses == exact_losses and norms == pytest.approx(exact_norms, rel=1e-12)
    for (name, a), b in zip(model.named_parameters(), exact_model.parameters()):
        assert torch.equal(a, b), name
    # torch's own norm of the same gradients, taken over fp32 copies: per-tensor norms summed in fp32 over
    # at most ~2^14 elements per tensor and 40 tensors. Pairwise/vectorised fp32 reduction errs by about
    # log2(n) * 2^-24 ~ 1e-6 relative; 1e-5 leaves a tenfold margin. (torch's clip_grad_norm_ on the bf16
    # grads themselves rounds each tensor's norm to bf16, 2^-9 relative, and the run it clips then drifts
    # from this one: that comparison has no tolerance the arithmetic guarantees.)
    assert norms == pytest.approx(fp32_norms, rel=1e-5)


@pytest.mark.parametrize("backend", ["python", "native"])
def test_an_lr_scheduler_drives_the_host_and_device_steps_like_torch_adamw(backend) -> None:
    base = tiny_llama(layers=3)
    decay = lambda step: 1.0 / (1 + step)  # noqa: E731
    ref_losses, ref_model = reference_training(base, batches(4), "bf16", LR, WD, lr_lambda=decay)
    model = copy.deepcopy(base)
    off = offload_ext.Offloader(model, lr=LR, weight_decay=WD, backend=backend, device="cpu")
    schedule = torch.optim.lr_scheduler.LambdaLR(off, decay)
    assert offloaded_training(off, model, batches(4), schedule=schedule) == ref_losses
    assert off.param_groups[0]["lr"] == pytest.approx(LR / 5)
    saved = off.state_dict()["param_groups"][0]
    assert saved["lr"] == off.param_groups[0]["lr"] and saved["initial_lr"] == LR
    off.close()
    for (name, a), b in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("backend", ["python", "native"])
def test_a_copy_that_fails_to_enqueue_raises_and_leaves_nothing_waiting(backend) -> None:
    model = tiny_llama(layers=4)
    off = offload_ext.Offloader(model, backend=backend, device="cpu")
    offloaded_training(off, model, batches(1))
    x = batches(1)[0]
    loss = model(input_ids=x, labels=x).loss
    testing.fail_next_copy(off)  # the first copy of this backward: the top layer's gradients to the host
    with pytest.raises(RuntimeError, match="injected copy failure"):
        off.backward(loss)
    finished = threading.Event()

    def finish() -> None:
        # That layer's gradients never reached its step: the step is refused, never taken by half the layers.
        with pytest.raises(RuntimeError, match="an earlier step failed .*injected copy failure"):
            off.step()
        with pytest.warns(RuntimeWarning, match="injected copy failure"):
            off.close()  # waits for every host step the engine expects
        finished.set()

    worker = threading.Thread(target=finish, daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert finished.is_set(), "step()/close() still waiting for a step whose copy never started"


def test_building_an_offloader_raises_no_deprecation_warnings() -> None:
    model = tiny_llama(layers=2)
    offload_ext.enable_activation_checkpointing(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        off = offload_ext.Offloader(model, backend="native", device="cpu")
        offloaded_training(off, model, batches(1))
        off.close()


def _norms_exempt(name: str) -> dict:
    return {"weight_decay": 0.0} if "norm" in name else {}  # tiny_llama has no biases


@pytest.mark.parametrize("offload_all", [False, True])
@pytest.mark.parametrize("precision", ["bf16", "mixed"])
@pytest.mark.parametrize("backend", ["python", "native"])
def test_no_decay_groups_train_like_torch_adamw_with_the_same_groups(backend, precision, offload_all) -> None:
    base = tiny_llama(layers=3)
    ref_losses, ref_model = reference_training(base, batches(4), precision, LR, WD, group_of=_norms_exempt)
    model = copy.deepcopy(base)
    off = offload_ext.Offloader(model, lr=LR, weight_decay=WD, precision=precision, backend=backend, device="cpu",
                                offload_all=offload_all, no_decay=("bias", "norm"))
    exempt = {id(p) for p in off.param_groups[1]["params"]}
    assert {n for n, p in model.named_parameters() if id(p) in exempt} == {
        n for n, _ in model.named_parameters() if "norm" in n}
    assert off.param_groups[1]["weight_decay"] == 0.0 and off.param_groups[0]["weight_decay"] == WD
    losses = offloaded_training(off, model, batches(4))
    off.close()
    if offload_all:  # the embeddings, final norm and head stepped on the host: to the host kernel's rounding
        assert losses == pytest.approx(ref_losses, rel=1e-3)
        for (name, a), b in zip(model.named_parameters(), ref_model.parameters()):
            assert bf16_ulp_distance(a, b).max().item() <= 2, name
        return
    assert losses == ref_losses
    for (name, a), b in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("backend", ["python", "native"])
def test_per_group_lr_under_a_scheduler_trains_like_torch_adamw(backend) -> None:
    base = tiny_llama(layers=3)
    decay = lambda step: 1.0 / (1 + step)  # noqa: E731
    mlp = lambda name: {"lr": LR / 4} if ".mlp." in name else {}  # noqa: E731
    ref_losses, ref_model = reference_training(base, batches(4), "bf16", LR, WD, lr_lambda=decay, group_of=mlp)
    model = copy.deepcopy(base)
    mlp_params = [p for n, p in model.named_parameters() if ".mlp." in n]
    off = offload_ext.Offloader(model, lr=LR, weight_decay=WD, backend=backend, device="cpu",
                                groups=[{"params": mlp_params, "lr": LR / 4}])
    schedule = torch.optim.lr_scheduler.LambdaLR(off, decay)
    assert offloaded_training(off, model, batches(4), schedule=schedule) == ref_losses
    assert [g["lr"] for g in off.param_groups] == pytest.approx([LR / 5, LR / 20])
    off.close()
    for (name, a), b in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(a, b), name


def test_bad_groups_are_refused_before_anything_is_allocated() -> None:
    model = tiny_llama(layers=2)
    w = model.model.layers[0].mlp.up_proj.weight
    with pytest.raises(ValueError, match="in groups\\[0\\] and groups\\[1\\]"):
        offload_ext.Offloader(model, device="cpu", groups=[{"params": [w]}, {"params": [w]}])
    with pytest.raises(ValueError, match="only \\('lr', 'betas', 'eps', 'weight_decay'\\)"):
        offload_ext.Offloader(model, device="cpu", groups=[{"params": [w], "momentum": 0.9}])
    with pytest.raises(ValueError, match="not a parameter of the model"):
        offload_ext.Offloader(model, device="cpu", groups=[{"params": [torch.nn.Parameter(torch.zeros(2))]}])
    with pytest.raises(ValueError, match="weight_decay must be >= 0"):
        offload_ext.Offloader(model, device="cpu", groups=[{"params": [w], "weight_decay": -1.0}])
    assert all(p.numel() > 0 for p in model.parameters())  # nothing was moved out of the model


def test_a_state_saved_with_other_param_groups_is_refused() -> None:
    base = tiny_llama(layers=2)
    model = copy.deepcopy(base)
    with offload_ext.Offloader(model, device="cpu", no_decay=("norm",)) as off:
        offloaded_training(off, model, batches(1))
        saved = off.state_dict()
    other = copy.deepcopy(base)
    with offload_ext.Offloader(other, device="cpu") as off2:
        with pytest.raises(ValueError, match="param groups"):
            off2.load_state_dict(saved)


@pytest.mark.parametrize("grad_accum", [1, 2])
@pytest.mark.parametrize("precision", ["bf16", "bf16-sr", "mixed"])
def test_steps_after_the_norm_train_the_same_bits_in_one_pass_or_params_first(precision, grad_accum) -> None:
    # params_first (the default) splits every redo and clipped step into a params pass and a moments pass.
    base, data = tiny_llama(layers=4), batches(4)
    runs = [_clipped_run(base, data, "native", precision, grad_accum=grad_accum, params_first=first)
            for first in (False, True)]
    (losses_a, norms_a, model_a, actions), (losses_b, norms_b, model_b, _) = runs
    assert set(actions) == {"redone"} and losses_a == losses_b and norms_a == norms_b
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("precision", ["bf16", "mixed"])
@pytest.mark.parametrize("backend, speculative", CLIP_VARIANTS)
def test_clipping_that_never_triggers_trains_exactly_like_no_clipping(backend, speculative, precision) -> None:
    base, data = tiny_llama(layers=4), batches(6)
    ref_losses, ref_model = reference_training(base, data, precision, LR, WD)
    losses, _, model, actions = _clipped_run(base, data, backend, precision, max_grad_norm=1e6, grad_accum=1,
                                             speculative_clip=speculative)
    assert set(actions) == ({"committed"} if backend == "native" and speculative else {"unclipped"})
    assert losses == ref_losses
    for (name, a), b in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(a, b), name


def _host_jobs(off, model, data, traced: int = -1) -> dict[int, set[str]]:
    """Per unit, the kinds of host job step `traced` of training on `data` ran (the others untraced)."""
    k = traced % len(data)
    offloaded_training(off, model, data[:k])
    testing.settle(off)
    with off.trace() as timeline:
        offloaded_training(off, model, data[k:k + 1])
    offloaded_training(off, model, data[k + 1:])
    jobs: dict[int, set[str]] = {}
    for lane, name, _, _, unit in timeline.events:
        if lane == "host step":
            jobs.setdefault(unit, set()).add(name.rsplit(" u", 1)[0])
    return jobs


@pytest.mark.parametrize("max_grad_norm", [1e6, 1e-3])
def test_every_layer_speculates_and_after_a_step_that_clipped_every_step_waits_for_the_norm(max_grad_norm) -> None:
    # The lowest layer lands last: its step is queued as its copy lands and, held once the norm is known,
    # steps once in place, or runs speculatively if it started first. After a step that clipped, every
    # speculative step is held until the norm (clipping tends to trigger again, and a speculative step run in
    # backward would be wasted host work): each layer then steps once, clipped, in place. The norms are taken
    # on the device either way: no host pass for them.
    model = tiny_llama(layers=8)
    off = offload_ext.Offloader(model, backend="native", device="cpu", max_grad_norm=max_grad_norm)
    jobs = _host_jobs(off, model, batches(3))
    off.close()
    # A step after the norm stores the params, then the moments in a pass of their own (params_first).
    after_norm = {"scale + step (params)", "scale + step (moments)"}
    assert all("norm" not in names for names in jobs.values()), jobs
    if max_grad_norm > 1:
        assert {u for u, names in jobs.items() if "speculative step" in names} - {0} == set(range(1, 8))
        # (a step still held when the norm did not clip runs in one pass: the host is behind)
        assert jobs[0] <= {"speculative step", "scale + step"}, jobs[0]
        assert off.last_clip_action == "committed"
    else:
        assert all(names == after_norm for names in jobs.values()), jobs
        assert off.last_clip_action == "redone"


def test_once_the_norm_is_known_no_speculative_step_starts_and_the_held_ones_step_in_place() -> None:
    # A slow host: most speculative steps have not started when the norm is known. Started then, each
    # would be wasted (clipping) or pay for the second buffers for nothing (no clipping).
    base, data = tiny_llama(layers=8), batches(3)
    ref_losses, ref_model = reference_training(base, data, "bf16", LR, WD, max_grad_norm=1e6, exact_clip=True)
    model = copy.deepcopy(base)
    off = offload_ext.Offloader(model, lr=LR, weight_decay=WD, backend="native", device="cpu", max_grad_norm=1e6)
    testing.slow_host_steps(off, 20_000)
    losses = offloaded_training(off, model, data[:-1])
    testing.settle(off)
    with off.trace() as timeline:
        losses += offloaded_training(off, model, data[-1:])
    off.close()
    host = [e for e in timeline.events if e[0] == "host step"]
    # The norm is known inside step(); a host step's event begins after the slice's injected 20 ms sleep. A
    # step taken just before the norm was known may begin up to one sleep after step() (and its overshoot on
    # a loaded machine: CI failed once at exactly one sleep); held steps released as speculative would begin
    # one after another, the second two sleeps after step(): 1.5 sleeps tells the two apart.
    step_end = max(end for lane, name, _, end, _ in timeline.events if (lane, name) == ("python", "step"))
    assert all(begin < step_end + 30_000_000 for _, name, begin, _, _ in host if name.startswith("speculative step"))
    in_place = {u for _, name, _, _, u in host if name.startswith("scale + step")}
    assert in_place - {0}, in_place  # speculative units held, then stepped in place
    assert losses == ref_losses and off.last_clip_action == "committed"
    for (name, a), b in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(a, b), name


def test_speculation_keeps_to_the_top_layers_whose_second_buffers_host_memory_holds(monkeypatch) -> None:
    from offload_ext.planning import host_sizes as sizes

    base, data = tiny_llama(layers=8), batches(3)
    ref_losses, ref_model = reference_training(base, data, "bf16", LR, WD, max_grad_norm=1e-3, exact_clip=True)
    # This machine "has" the host memory of the plan less three and a half layers' second buffers (6 bytes
    # per trainable parameter in bf16): the lowest speculative layers are dropped until it fits.
    per_layer = sum(p.numel() for p in base.model.layers[0].parameters())
    # (No redos on the device: their units' moments would be page-locked, which the arithmetic below leaves out.)
    plan = offload_ext.Offloader(copy.deepcopy(base), backend="native", device="cpu", max_grad_norm=1e-3,
                                 device_redo_layers=0)
    stats = plan.stats()
    plan.close()
    pinned = 8 * 2 * (2 * per_layer + (8 << 10))  # each layer's params and its kept gradient
    monkeypatch.setattr(sizes, "available_host_bytes", lambda: pinned + stats["host_in_use"] - 21 * per_layer)
    model = copy.deepcopy(base)
    with pytest.warns(UserWarning, match=r"second buffers for \d of 8 speculative units"):
        off = offload_ext.Offloader(model, lr=LR, weight_decay=WD, backend="native", device="cpu", max_grad_norm=1e-3,
                                    device_redo_layers=0)
    jobs = _host_jobs(off, model, data, traced=0)  # the first step speculates (the later ones hold: they clip)
    off.close()
    speculated = sorted(u for u, names in jobs.items() if "speculative step" in names)
    assert speculated and speculated[0] > 2 and speculated == list(range(speculated[0], 8)), speculated
    for (name, a), b in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("precision", ["bf16", "mixed"])
def test_a_redo_on_a_slow_host_with_late_copies_is_still_exact(precision) -> None:
    # Host steps far slower than the device: redos meet speculative steps queued, running and done.
    base, data = tiny_llama(layers=4), batches(6)
    exact_norms: list[float] = []
    ref_losses, ref_model = reference_training(base, data, precision, LR, WD, max_grad_norm=0.5, norms=exact_norms,
                                               exact_clip=True)
    model = copy.deepcopy(base)
    off = offload_ext.Offloader(model, lr=LR, weight_decay=WD, precision=precision, backend="native", device="cpu",
                                max_grad_norm=0.5, slice_elements=5000)
    testing.delayed_copies(off, 3000)
    testing.slow_host_steps(off, 3000)
    norms: list[float] = []
    assert offloaded_training(off, model, data, norms=norms) == ref_losses
    assert norms == pytest.approx(exact_norms, rel=1e-12) and off.last_clip_action == "redone"
    off.close()
    for (name, a), b in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("precision", ["bf16", "mixed"])
@pytest.mark.parametrize("device_redo_layers, piece", [(0, None), (1, None), (3, None), (3, 777)])
def test_clipped_redos_of_the_top_layers_on_the_device_are_exact(device_redo_layers, piece, precision,
                                                                 monkeypatch) -> None:
    # When clipping triggers, the top layers are redone on the (simulated) device from the state before their
    # speculative steps while the host redoes the rest. Slow host steps and late copies make the device's
    # redos meet speculative steps queued (dropped), running (waited for) and done. Norm weights without
    # weight decay make two groups per layer; pieces of 777 elements cut through them.
    from offload_ext.planning import gpu

    if piece is not None:
        monkeypatch.setattr(gpu, "REDO_PIECE", piece)
    base, data = tiny_llama(layers=4), batches(6)
    exact_norms: list[float] = []
    ref_losses, ref_model = reference_training(base, data, precision, LR, WD, max_grad_norm=0.5, norms=exact_norms,
                                               exact_clip=True, group_of=_norms_exempt)
    model = copy.deepcopy(base)
    off = offload_ext.Offloader(model, lr=LR, weight_decay=WD, precision=precision, backend="native", device="cpu",
                                max_grad_norm=0.5, slice_elements=5000, device_redo_layers=device_redo_layers,
                                no_decay=("norm",))
    testing.delayed_copies(off, 3000)
    testing.slow_host_steps(off, 3000)
    norms: list[float] = []
    assert offloaded_training(off, model, data[:-1], norms=norms) == ref_losses[:-1]
    testing.settle(off)
    with off.trace() as timeline:
        assert offloaded_training(off, model, data[-1:], norms=norms) == ref_losses[-1:]
    assert norms == pytest.approx(exact_norms, rel=1e-12) and off.last_clip_action == "redone"
    assert off.stats()["device_redos"] == device_redo_layers * len(data)
    redone_on_host = {u for lane, name, _, _, u in timeline.events if lane == "host step" and "(redo)" in name}
    assert not redone_on_host & set(range(4 - device_redo_layers, 4)), redone_on_host
    on_device = [(name, begin, end, u) for lane, name, begin, end, u in timeline.events if lane == "device redo"]
    assert {u for *_, u in on_device} == set(range(4 - device_redo_layers, 4))
    assert all(begin <= end for _, begin, end, _ in on_device)
    pieces = [e for e in on_device if e[0].startswith("copy in")]
    assert len(pieces) == len(on_device) // 2 >= device_redo_layers
    off.close()
    for (name, a), b in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("precision", ["bf16-8bit", "bf16-8bit-sr"])
@pytest.mark.parametrize("piece", [None, 777])
def test_clipped_8bit_redos_on_the_device_are_the_hosts_bit_for_bit(precision, piece, monkeypatch) -> None:
    # In 8 bits the device redoes each group range as the host does, a span of its own: its blocks and absmaxes
    # counted from its start, the params' stochastic rounding from its stream index. Pieces of 777 elements
    # (768 in 8 bits: whole blocks) cut the ranges; slow host steps and late copies meet every speculative state.
    from offload_ext.planning import gpu

    if piece is not None:
        monkeypatch.setattr(gpu, "REDO_PIECE", piece)
    base, data = tiny_llama(layers=4), batches(5)

    def run(device_redo_layers: int) -> tuple[list[float], list[torch.Tensor], int]:
        model = copy.deepcopy(base)
        off = offload_ext.Offloader(model, lr=LR, weight_decay=WD, precision=precision, backend="native",
                                    device="cpu", max_grad_norm=0.5, slice_elements=5000, no_decay=("norm",),
                                    device_redo_layers=device_redo_layers)
        testing.delayed_copies(off, 3000)
        testing.slow_host_steps(off, 3000)
        losses = offloaded_training(off, model, data)
        assert off.last_clip_action == "redone"
        state, redos = flat_tensors(off.state_dict()), off.stats()["device_redos"]
        off.close()
        return losses, [*model.parameters(), *state], redos

    on_host, on_device = run(0), run(3)
    assert (on_host[2], on_device[2]) == (0, 3 * len(data))
    assert on_device[0] == on_host[0]
    assert len(on_device[1]) == len(on_host[1])
    for a, b in zip(on_host[1], on_device[1]):
        assert torch.equal(a, b)


def test_device_redos_are_chosen_where_they_apply_and_refused_where_they_cannot() -> None:
    model = tiny_llama(layers=6)
    clip = dict(backend="native", device="cpu", max_grad_norm=1.0)
    chosen = offload_ext.Offloader(copy.deepcopy(model), **clip)
    assert chosen.stats()["device_redos"] == 0 and testing.device_redo_units(chosen) == {4, 5}  # a third
    chosen.close()
    eight = offload_ext.Offloader(copy.deepcopy(model), **clip, precision="bf16-8bit-sr")
    assert testing.device_redo_units(eight) == {4, 5}  # the 8-bit kernel rounds stochastically on the device too
    eight.close()
    for kw in (dict(grad_accum=2), dict(speculative_clip=False), dict(precision="bf16-sr")):
        off = offload_ext.Offloader(copy.deepcopy(model), **clip, **kw)
        assert not testing.device_redo_units(off), kw
        off.close()
        with pytest.raises(ValueError, match="device_redo_layers > 0 needs speculative clipping"):
            offload_ext.Offloader(copy.deepcopy(model), **clip, **kw, device_redo_layers=2)
    with pytest.raises(ValueError, match=r"device_redo_layers must be None \(chosen\) or an int in \[0, 6\]"):
        offload_ext.Offloader(copy.deepcopy(model), **clip, device_redo_layers=7)


@pytest.mark.parametrize("precision, state_spans", [("bf16", 4), ("mixed", 6)])
def test_device_redo_units_have_their_state_page_locked_in_the_plan(precision, state_spans) -> None:
    from offload_ext.planning.host_sizes import NativeHostPlan

    sizes = ((1000, 900),) * 4
    plain = NativeHostPlan.choose(precision, sizes, speculative_units=frozenset(range(4)))
    redo = NativeHostPlan.choose(precision, sizes, speculative_units=frozenset(range(4)),
                                 device_redo_units=frozenset({3}))
    moved = sum(b.nbytes for b in redo.pinned_blocks()) - sum(b.nbytes for b in plain.pinned_blocks())
    assert moved > 0 and moved == sum(b.nbytes for b in plain.pageable_blocks()) - sum(
        b.nbytes for b in redo.pageable_blocks())
    moments = [b for b in redo.pinned_blocks() if b.what == "moments (redone on the device)"]
    # both moments and both second moments; mixed: the fp32 master and its second too (as large as a moment)
    assert len(moments) == 2 and moved == state_spans * moments[0].nbytes
    assert redo.need().total == plain.need().total


@pytest.mark.parametrize("speculative", [True, False])
def test_speculative_clipping_steps_the_host_during_backward(speculative) -> None:
    model = tiny_llama(layers=4, hidden=256)  # a backward of tens of ms: the host has time to start a step
    off = offload_ext.Offloader(model, backend="native", device="cpu", max_grad_norm=1e6,
                                speculative_clip=speculative)
    testing.slow_host_steps(off, 1000)
    data = batches(2, batch=4, seq=64)
    offloaded_training(off, model, data[:1])
    testing.settle(off)  # the first step's host work stays off the timeline
    with off.trace() as timeline:
        offloaded_training(off, model, data[1:])
    off.close()
    _, _, begin, end, _ = next(e for e in timeline.events if e[1] == "backward")
    steps = [e for e in timeline.events if e[0] == "host step" and "step" in e[1] and e[2] >= begin]
    during = [e for e in steps if e[2] < end]
    if speculative:
        assert during and all(e[1].startswith("speculative step") for e in during)
    else:
        assert not during  # every step waits for the norm, after backward


class _BlockWithUnusedWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.unused = nn.Linear(16, 16)  # trainable, never in the loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class _StackWithUnusedWeights(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_BlockWithUnusedWeight() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


@pytest.mark.parametrize("backend", ["python", "native"])
def test_a_layer_parameter_outside_the_loss_is_named_in_steps_error(backend) -> None:
    model = _StackWithUnusedWeights()
    off = offload_ext.Offloader(model, backend=backend, device="cpu")
    off.backward(model(torch.randn(2, 16).bfloat16()).float().pow(2).mean())
    with pytest.raises(RuntimeError, match=r"got gradients for only 2 of its 4 .*blocks\.\d\.unused\.weight"):
        off.step()


def test_a_batch_shape_on_the_simulated_device_keeps_the_fixed_layout_and_a_bad_one_is_refused() -> None:
    model = tiny_llama(layers=3)
    with pytest.raises(ValueError, match=r"batch_shape must be \(batch_size, seq_len\), two ints >= 1"):
        offload_ext.Offloader(model, device="cpu", batch_shape=(2,))
    off = offload_ext.Offloader(model, device="cpu", batch_shape=(2, 16))
    assert off.layout_choice is None and off.layout.resident == ()  # no GPU to plan for
    off.close()
