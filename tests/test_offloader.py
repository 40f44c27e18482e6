"""Offloader on the simulated device (device="cpu"): the same hooks, bookkeeping and engine as on a GPU."""
from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn

import offload_ext
from conftest import bf16_ulp_distance
from helpers import batches, offloaded_training, reference_training, tiny_gpt2, tiny_llama

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
    assert [name for name, _ in offload_ext.stacks.find_layer_stacks(model)] == ["transformer.h"]
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


def test_frozen_parameters_are_streamed_but_not_stepped() -> None:
    base = tiny_llama(layers=3)
    for layer in base.model.layers:
        layer.input_layernorm.weight.requires_grad_(False)
    ref_losses, ref_model = reference_training(base, batches(3), "bf16", LR, WD)
    model = copy.deepcopy(base)
    losses, off = _train(model, "native", "bf16", steps=3)
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
    if backend == "native":
        off._backend.engine.set_debug_delay_us(3000)
    else:
        _delay_python_copies(off)
    assert offloaded_training(off, model, batches(3)) == ref_losses
    off.close()


def test_a_grad_ring_smaller_than_the_stack_waits_for_each_slots_step() -> None:
    base = tiny_llama(layers=5)
    ref_losses, ref_model = reference_training(base, batches(3), "mixed", LR, WD)
    model = copy.deepcopy(base)
    off = offload_ext.Offloader(model, lr=LR, weight_decay=WD, precision="mixed", backend="native", device="cpu",
                                grad_slots=2)
    off._backend.engine.set_debug_delay_us(2000)
    assert offloaded_training(off, model, batches(3)) == ref_losses
    off.close()
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)


def test_host_zeros_reads_zero_also_when_memory_is_reused() -> None:
    engine = offload_ext.ops.native().Engine(-1, 1, False, 1 << 20)
    first = engine.host_zeros(1000, torch.float32)
    assert torch.count_nonzero(first) == 0
    first.fill_(7.0)
    del first
    again = engine.host_zeros(1000, torch.float32)
    assert torch.count_nonzero(again) == 0
    assert engine.memory_stats()["host_in_use"] >= 4000


def _delay_python_copies(off) -> None:
    import random
    import time

    copies = off._backend._copies
    original = copies.copy

    def slow_copy(stream, dst, src):
        def job():
            time.sleep(random.uniform(0, 0.003))
            dst.copy_(src)
        return stream.submit(job)

    copies.copy = slow_copy
    assert original is not None


@pytest.mark.parametrize("async_step", [True, False])
def test_a_failed_host_step_surfaces_at_the_next_call(async_step) -> None:
    model = tiny_llama(layers=2)
    off = offload_ext.Offloader(model, backend="native", device="cpu", async_step=async_step)
    off._backend.engine.inject_failure()
    x = batches(1)[0]
    off.backward(model(input_ids=x, labels=x).loss)
    with pytest.raises(RuntimeError, match="injected failure"):
        off.step()  # synchronous: raises here; asynchronous: here or in the next forward at the latest
        model(input_ids=x, labels=x)


@pytest.mark.parametrize("precision", ["bf16", "mixed"])
def test_async_step_returns_early_and_each_layer_waits_for_its_own_step(precision) -> None:
    base = tiny_llama(layers=4)
    ref_losses, ref_model = reference_training(base, batches(4), precision, LR, WD)
    model = copy.deepcopy(base)
    off = offload_ext.Offloader(model, lr=LR, weight_decay=WD, precision=precision, backend="native", device="cpu")
    engine = off._backend.engine
    engine.set_debug_step_delay_us(20_000)  # a host far slower than the device: steps outlast backward
    pending_after_step = []
    losses = []
    for x in batches(4):
        loss = model(input_ids=x, labels=x).loss
        off.backward(loss)
        losses.append(loss.item())
        off.step()
        pending_after_step.append(sum(not engine.ready(u) for u in off._backend._units))
        off.zero_grad()
    off.close()
    assert max(pending_after_step) > 0  # step() did return with layers still queued
    assert losses == ref_losses         # and yet no layer ran on stale weights
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)


def test_synchronous_step_leaves_nothing_pending() -> None:
    model = tiny_llama(layers=3)
    off = offload_ext.Offloader(model, backend="native", device="cpu", async_step=False)
    off._backend.engine.set_debug_step_delay_us(5_000)
    x = batches(1)[0]
    off.backward(model(input_ids=x, labels=x).loss)
    off.step()
    assert all(off._backend.engine.ready(u) for u in off._backend._units)
    off.close()


def test_a_unit_being_waited_on_is_stepped_before_other_queued_units() -> None:
    engine = offload_ext.ops.native().Engine(-1, 1, False, 1 << 20)
    units = []
    for _ in range(4):
        p, g, m, v = (engine.host_zeros(1024, torch.bfloat16) for _ in range(4))
        units.append(engine.add_unit(p, g, m, v))
    engine.set_hyper(1e-3, 0.9, 0.999, 1e-8, 0.0, 1)
    engine.set_debug_step_delay_us(50_000)
    for u in (3, 2, 1, 0):  # gradients land top-down, as in backward; unit 3 starts at once
        engine.notify(u)
    engine.wait_unit(1)     # unit 1 jumps ahead of 0 and 2
    assert engine.ready(1) and not engine.ready(2) and not engine.ready(0)
    engine.wait_unit(0)     # then the lowest id: 0 before 2
    assert not engine.ready(2)
    engine.wait_all()
    assert engine.stats()["wait_seconds"] > 0.1


def _engine_units(engine, sizes, precision):
    """Engine units over fresh random tensors (kept alive in the returned list)."""
    state = torch.float32 if precision == "mixed" else torch.bfloat16
    g = torch.Generator().manual_seed(0)
    units, tensors = [], []
    for n in sizes:
        t = [torch.randn(n, generator=g).to(state), torch.randn(n, generator=g).to(torch.bfloat16),
             torch.randn(n, generator=g).to(state), torch.rand(n, generator=g).to(state),
             torch.empty(n, dtype=torch.bfloat16) if precision == "mixed" else None,
             torch.randn(n, generator=g).to(torch.bfloat16)]
        units.append(engine.add_unit(*t[:4], t[4], accum=t[5]))
        tensors.append(t)
    engine.set_hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, 3)
    return units, tensors


@pytest.mark.parametrize("precision", ["bf16", "mixed"])
def test_a_job_stepped_in_slices_gives_the_same_result_as_in_one_go(precision) -> None:
    results = []
    for slice_elements in (None, 1000):  # 1000: slices end off the SIMD width, in the scalar tail
        engine = offload_ext.ops.native().Engine(-1, 2, False, 1 << 20)
        if slice_elements:
            engine.set_slice_elements(slice_elements)
        (u,), tensors = _engine_units(engine, [10_007], precision)
        grad = tensors[0][1]
        landing = torch.randn(grad.numel(), generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        # One job at a time: a landing copy must not overwrite the gradient a step still reads.
        for submit in (lambda: engine.notify(u),                                   # step with the gradient
                       lambda: engine.copy(1, grad, landing, notify_unit=u, job=1),  # accum = landed
                       lambda: engine.copy(1, grad, landing, notify_unit=u, job=3),  # accum += it; step
                       lambda: engine.run(u, 5, 0.5),                              # accum *= 0.5; step
                       lambda: engine.run(u, 4, 1.0)):                             # norm (not sliced)
            submit()
            engine.wait_unit(u)
        results.append([t for t in tensors[0] if t is not None] + [torch.tensor(engine.sq_norm(u))])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_a_lower_unit_goes_ahead_of_a_started_higher_one_at_its_next_slice() -> None:
    engine = offload_ext.ops.native().Engine(-1, 1, False, 1 << 20)
    engine.set_slice_elements(1024)
    (low, high), _ = _engine_units(engine, [1024, 8 * 1024], "bf16")
    engine.set_debug_step_delay_us(20_000)  # every slice: 20 ms; the high unit has 8
    engine.notify(high)                     # starts at once, as the top layer's gradients land first
    time.sleep(0.05)
    engine.notify(low)
    engine.wait_unit(low)                   # taken after the high unit's current slice
    assert not engine.ready(high)           # which still has slices left
    engine.wait_all()
    with pytest.raises(ValueError, match="slice"):
        engine.set_slice_elements(0)


@pytest.mark.parametrize("backend", ["python", "native"])
def test_device_layers_keep_the_last_forward_layers_for_their_recompute(backend) -> None:
    base = tiny_llama(layers=4)
    ref_losses, ref_model = reference_training(base, batches(3), "mixed", LR, WD)
    copies = {}
    for device_layers in (2, 3, 4):
        model = copy.deepcopy(base)
        off = offload_ext.Offloader(model, lr=LR, weight_decay=WD, precision="mixed", backend=backend,
                                    device="cpu", device_layers=device_layers)
        loads = []
        load = off._backend.load
        off._backend.load = lambda index, layer, dst: loads.append(index) or load(index, layer, dst)
        assert offloaded_training(off, model, batches(3)) == ref_losses
        off.close()
        for a, b in zip(model.parameters(), ref_model.parameters()):
            assert torch.equal(a, b)
        copies[device_layers] = len(loads) / 3
    # Per step: 4 forward copies, plus a recompute copy for each layer not still on the device.
    assert copies == {2: 4 + 2, 3: 4 + 1, 4: 4}


def test_python_backend_layer_buffers_are_disjoint_page_aligned_views_of_one_allocation() -> None:
    off = offload_ext.Offloader(tiny_llama(layers=3), backend="python", device="cpu", offload_all=True)
    arena = off._backend._arena.tensor
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for stack in off._units() for b in stack.host
                   for t in (b.params, b.grads))
    assert len(spans) == 2 * 4  # three layers and the unit outside the stacks
    assert all(a % 4096 == 0 for a, _ in spans)
    assert spans[0][0] >= arena.data_ptr() and spans[-1][1] <= arena.data_ptr() + arena.nbytes
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
    off.close()


def test_fewer_than_two_device_layers_are_refused() -> None:
    with pytest.raises(ValueError, match="device_layers must be >= 2"):
        offload_ext.Offloader(tiny_llama(layers=2), device="cpu", device_layers=1)


@pytest.mark.parametrize("backend", ["python", "native"])
def test_training_forward_writes_no_kv_cache_so_recompute_sees_the_same_keys(backend) -> None:
    model = tiny_llama(layers=2)
    assert model.config.use_cache  # HF would build and fill a cache in this forward
    off = offload_ext.Offloader(model, backend=backend, device="cpu")
    x = batches(1)[0]
    out = model(input_ids=x, labels=x)
    cache = getattr(out, "past_key_values", None)
    assert cache is None or cache.get_seq_length() == 0
    off.backward(out.loss)
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
    with pytest.raises(ValueError, match="async_step=True needs backend='native'"):
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
    with pytest.raises(ValueError, match="precision must be one of"):
        offload_ext.Offloader(tiny_llama(layers=2), precision="fp8", device="cpu")
    with pytest.raises(ValueError, match="backend must be 'native' or 'python'"):
        offload_ext.Offloader(tiny_llama(layers=2), backend="jax", device="cpu")
    with pytest.raises(ValueError, match="grad_slots must be >= 1"):
        offload_ext.Offloader(tiny_llama(layers=2), device="cpu", grad_slots=0)


def test_hf_gradient_checkpointing_is_paused_while_attached_and_restored_on_close() -> None:
    model = tiny_llama(layers=2)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
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
    assert off._outer_opt is None  # no device optimizer: the embeddings, norm and head are host-stepped
    losses = offloaded_training(off, model, batches(4))
    off.close()
    for ours, ref in zip(losses, ref_losses):
        assert ours == pytest.approx(ref, rel=1e-3)
    for (name, a), b in zip(model.named_parameters(), ref_model.parameters()):
        assert bf16_ulp_distance(a, b).max().item() <= 2, name


@pytest.mark.parametrize("precision", ["bf16", "mixed"])
@pytest.mark.parametrize("backend", ["python", "native"])
def test_gradient_accumulation_equals_torch_accumulating_grads(backend, precision) -> None:
    base = tiny_llama(layers=4)
    data = batches(6)
    ref_losses, ref_model = reference_training(base, data, precision, LR, WD, micro_batches=3)
    model = copy.deepcopy(base)
    off = offload_ext.Offloader(model, lr=LR, weight_decay=WD, precision=precision, backend=backend, device="cpu",
                                grad_accum=3, grad_slots=2)
    if backend == "native":
        off._backend.engine.set_debug_delay_us(1000)
    losses = offloaded_training(off, model, data)
    off.close()
    assert losses == ref_losses
    for (name, a), b in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(a, b), name


def test_step_before_all_micro_batches_is_refused() -> None:
    model = tiny_llama(layers=2)
    off = offload_ext.Offloader(model, backend="native", device="cpu", grad_accum=2)
    x = batches(1)[0]
    off.backward(model(input_ids=x, labels=x).loss)
    with pytest.raises(RuntimeError, match="step\\(\\) after 1 backward\\(\\) calls, with grad_accum=2"):
        off.step()


def _clipped_run(base, data, backend, precision) -> tuple[list[float], list[float], nn.Module]:
    model = copy.deepcopy(base)
    off = offload_ext.Offloader(model, lr=LR, weight_decay=WD, precision=precision, backend=backend, device="cpu",
                                grad_accum=2, max_grad_norm=0.5, grad_slots=2)
    norms: list[float] = []
    losses = offloaded_training(off, model, data, norms=norms)
    off.close()
    return losses, norms, model


@pytest.mark.parametrize("precision", ["bf16", "mixed"])
@pytest.mark.parametrize("backend", ["python", "native"])
def test_gradient_clipping_is_exact_and_agrees_with_torch_clip_grad_norm(backend, precision) -> None:
    base, data = tiny_llama(layers=4), batches(8)
    losses, norms, model = _clipped_run(base, data, backend, precision)
    exact_norms: list[float] = []
    exact_losses, exact_model = reference_training(base, data, precision, LR, WD, micro_batches=2,
                                                   max_grad_norm=0.5, norms=exact_norms, exact_clip=True)
    assert min(exact_norms) > 0.5  # clipping was active on every step
    assert losses == exact_losses and norms == pytest.approx(exact_norms, rel=1e-12)
    for (name, a), b in zip(model.named_parameters(), exact_model.parameters()):
        assert torch.equal(a, b), name
    # torch's own clip_grad_norm_ sums the norm in bf16: the same rule, to bf16 precision.
    torch_norms: list[float] = []
    torch_losses, _ = reference_training(base, data, precision, LR, WD, micro_batches=2, max_grad_norm=0.5,
                                         norms=torch_norms)
    assert norms == pytest.approx(torch_norms, rel=1e-2)
    assert losses == pytest.approx(torch_losses, rel=1e-3)
