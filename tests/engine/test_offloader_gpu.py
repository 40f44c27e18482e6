"""Offloader on a real GPU: equivalence with GPU-resident training, copy races, recompute, torch.compile."""
from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import offload_ext
from helpers import offloaded_training, reference_training
from offload_ext import testing

pytestmark = pytest.mark.gpu


def small_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128)
    return LlamaForCausalLM(cfg)


def repeating_batches(steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    pool = [torch.randint(0, 512, (4, 64), generator=gen) for _ in range(4)]
    return [pool[k % 4] for k in range(steps)]


@pytest.mark.parametrize("precision", ["bf16", "mixed"])
def test_loss_curves_match_gpu_resident_training_over_30_steps(precision) -> None:
    base, data = small_llama(), repeating_batches(30)
    ref, _ = reference_training(base, data, precision, lr=3e-3, wd=0.0, device="cuda")
    curves = {}
    for backend in ("python", "native"):
        model = copy.deepcopy(base)
        off = offload_ext.Offloader(model, lr=3e-3, precision=precision, backend=backend, device="cuda")
        curves[backend] = offloaded_training(off, model, data, device="cuda")
        off.close()
    assert curves["python"] == curves["native"]  # same host arithmetic, same order
    for ours, theirs in zip(curves["native"], ref):
        assert abs(ours - theirs) <= 0.02 * abs(theirs) + 0.02, (curves["native"], ref)
    assert curves["native"][-1] < curves["native"][0] - 0.5  # it learns


@pytest.mark.parametrize("on_device", [False, True])  # micro-batches summed on the host or on the GPU
@pytest.mark.parametrize("backend", ["python", "native"])
def test_offload_all_and_gradient_accumulation_match_gpu_resident_training(backend, on_device) -> None:
    base, data = small_llama(), repeating_batches(24)
    ref, _ = reference_training(base, data, "mixed", lr=3e-3, wd=0.0, device="cuda", micro_batches=2)
    model = copy.deepcopy(base)
    off = offload_ext.Offloader(model, lr=3e-3, precision="mixed", backend=backend, device="cuda",
                                offload_all=True, grad_accum=2, grad_slots=2, accumulate_on_device=on_device)
    losses = offloaded_training(off, model, data, device="cuda")
    off.close()
    for ours, theirs in zip(losses, ref):
        assert abs(ours - theirs) <= 0.02 * abs(theirs) + 0.02, (losses, ref)
    assert losses[-1] < losses[0] - 0.5


@pytest.mark.parametrize("resident_layers", [0, 1])  # all layers streamed, or the lowest kept on the GPU
@pytest.mark.parametrize("max_grad_norm", [0.3, 1e6])  # triggering every step (redone), never (committed)
@pytest.mark.parametrize("backend", ["python", "native"])
def test_gradient_clipping_matches_gpu_resident_training(backend, max_grad_norm, resident_layers) -> None:
    base, data = small_llama(), repeating_batches(12)
    ref_norms: list[float] = []
    ref, _ = reference_training(base, data, "bf16", lr=3e-3, wd=0.0, device="cuda", max_grad_norm=max_grad_norm,
                                norms=ref_norms, exact_clip=True)
    model = copy.deepcopy(base)
    off = offload_ext.Offloader(model, lr=3e-3, backend=backend, device="cuda", max_grad_norm=max_grad_norm,
                                resident_layers=resident_layers)
    actions: list[str | None] = []
    losses = []
    for k in range(len(data)):
        losses += offloaded_training(off, model, data[k:k + 1], device="cuda")
        actions.append(off.last_clip_action)
    norms = [off.last_grad_norm]
    off.close()
    triggered = max_grad_norm < 1.0
    assert (min(ref_norms) > max_grad_norm) if triggered else (max(ref_norms) < max_grad_norm)
    speculative = {"redone"} if triggered else {"committed"}
    assert set(actions) == (speculative if backend == "native" else {"clipped" if triggered else "unclipped"})
    assert norms[-1] == pytest.approx(ref_norms[-1], rel=0.05)
    for ours, theirs in zip(losses, ref):
        assert abs(ours - theirs) <= 0.02 * abs(theirs) + 0.02, (losses, ref)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class TransferHeavy(nn.Module):
    """Big layers, little compute: copies dominate, so an unawaited copy shows."""

    def __init__(self, layers: int = 8, width: int = 3072) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _train_transfer_heavy(backend: str, delay: bool, steps: int = 4, step_delay_us: int = 0,
                          slice_elements: int | None = None, stats: dict | None = None,
                          **kw) -> tuple[list[float], dict]:
    model = TransferHeavy()
    off = offload_ext.Offloader(model, lr=1e-3, backend=backend, device="cuda", slice_elements=slice_elements, **kw)
    if delay:
        testing.delayed_copies(off, 2000)
    if step_delay_us:
        testing.slow_host_steps(off, step_delay_us)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        for _ in range(off.grad_accum):
            x = torch.randn(2, 3072, generator=gen).to("cuda", torch.bfloat16)
            loss = model(x).float().pow(2).mean()
            off.backward(loss)
            losses.append(loss.item())
        off.step()
    weights = off.model_state_dict()
    if stats is not None:
        stats.update(off.stats())
    off.close()
    return losses, weights


def _assert_same_weights(expected: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> None:
    for name, w in expected.items():
        assert torch.equal(w, weights[name]), name


def _checkpoint_round_trip(precision: str, save: Callable[[offload_ext.Offloader], Any],
                           load: Callable[[offload_ext.Offloader, Any], None]) -> Any:
    """Train two steps on the GPU, checkpoint with `save` (asserting it allocates nothing on the device), train
    two more; then a fresh Offloader restored by `load` must train those two the same. Returns what save gave."""
    base, data = small_llama(), repeating_batches(4)
    kw = dict(lr=1e-3, precision=precision, backend="native", device="cuda", resident_layers=1)
    model = copy.deepcopy(base)
    off = offload_ext.Offloader(model, **kw)
    offloaded_training(off, model, data[:2], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    saved = save(off)
    assert torch.cuda.max_memory_allocated() == before
    expected = offloaded_training(off, model, data[2:], device="cuda")
    off.close()
    resumed = copy.deepcopy(base)
    off2 = offload_ext.Offloader(resumed, **kw)
    load(off2, saved)
    assert offloaded_training(off2, resumed, data[2:], device="cuda") == expected
    off2.close()
    return saved


@pytest.mark.parametrize("precision", ["bf16", "mixed"])
def test_state_dict_copies_the_device_state_to_the_host_and_takes_no_device_memory(precision) -> None:
    # The plan leaves no device room for a checkpoint (it goes to more resident layers): state_dict() must
    # allocate nothing on the GPU, and its host copies must continue the same run once loaded back.
    saved = _checkpoint_round_trip(precision, lambda off: off.state_dict(), lambda off, s: off.load_state_dict(s))
    moments = [t for entry in saved["outer"]["optimizer"]["state"].values() for t in entry.values()
               if isinstance(t, torch.Tensor) and t.numel() > 1]
    assert moments and all(t.device.type == "cpu" for t in moments)


@pytest.mark.parametrize("precision", ["bf16", "mixed"])
def test_save_state_streams_the_device_state_without_device_memory_and_load_state_continues_the_run(
        tmp_path, precision) -> None:
    # save_state copies the device optimizer's tensors out one at a time and load_state reads them back into
    # CUDA tensors through one staged tensor.
    _checkpoint_round_trip(precision, lambda off: off.save_state(str(tmp_path)),
                           lambda off, _: off.load_state(str(tmp_path)))


@pytest.mark.parametrize("backend", ["python", "native"])
def test_randomised_copy_timing_changes_nothing(backend) -> None:
    plain_losses, plain_weights = _train_transfer_heavy(backend, delay=False)
    losses, weights = _train_transfer_heavy(backend, delay=True)
    assert losses == plain_losses
    _assert_same_weights(plain_weights, weights)


def test_async_step_on_a_slow_host_trains_exactly_like_the_synchronous_step() -> None:
    # 10 ms per layer step: the host steps outlast backward, so the next forward must wait per layer.
    sync_losses, sync_weights = _train_transfer_heavy("native", delay=False, async_step=False)
    losses, weights = _train_transfer_heavy("native", delay=True, step_delay_us=10_000)
    assert losses == sync_losses
    _assert_same_weights(sync_weights, weights)


@pytest.mark.parametrize("precision", ["bf16", "mixed", "bf16-8bit", "bf16-8bit-sr"])
def test_clipped_redos_on_the_gpu_under_randomised_timing_train_exactly_like_host_redos(precision) -> None:
    # Clipping triggers every step: the top half's redos run in the CUDA kernel, from state copied in on a
    # side stream, while copies stall at random and the host is slow; the host redoing everything is the
    # reference, bit for bit.
    clip = dict(max_grad_norm=1e-4, steps=6, precision=precision)
    host_losses, host_weights = _train_transfer_heavy("native", delay=False, device_redo_layers=0, **clip)
    stats: dict = {}
    losses, weights = _train_transfer_heavy("native", delay=True, step_delay_us=2000, device_redo_layers=4,
                                            stats=stats, **clip)
    assert stats["device_redos"] == 4 * 6
    assert losses == host_losses
    _assert_same_weights(host_weights, weights)


@pytest.mark.parametrize("precision", ["bf16", "bf16-8bit"])
def test_the_measured_device_redo_counts_train_exactly_like_host_redos_under_randomised_timing(precision) -> None:
    # device_redo_layers left to the engine: the redone steps switch between counts of device-redone layers (a
    # unit redone on the GPU one step, on the host the next), copies stall at random, the host is slow; the
    # host redoing everything is the reference, bit for bit.
    from offload_ext.engine.redo_tuning import SAMPLES, WARMUP

    steps = WARMUP + 5 * SAMPLES + 2  # every candidate measured (8 layers: 2, 4, [5,] 1, 0), then the choice
    clip = dict(max_grad_norm=1e-4, steps=steps, precision=precision)
    host_losses, host_weights = _train_transfer_heavy("native", delay=False, device_redo_layers=0, **clip)
    stats: dict = {}
    losses, weights = _train_transfer_heavy("native", delay=True, step_delay_us=2000, stats=stats, **clip)
    assert stats["device_redo_chosen"] and stats["device_redos"] > 0
    assert losses == host_losses
    _assert_same_weights(host_weights, weights)


def test_a_traced_step_puts_the_gpu_redos_on_the_timeline_in_order() -> None:
    model = TransferHeavy()
    off = offload_ext.Offloader(model, lr=1e-3, backend="native", device="cuda", max_grad_norm=1e-4,
                                device_redo_layers=4)
    x = torch.randn(2, 3072, generator=torch.Generator().manual_seed(1)).to("cuda", torch.bfloat16)
    for traced in (False, True):
        with off.trace() if traced else contextlib.nullcontext() as timeline:
            off.backward(model(x).float().pow(2).mean())
            off.step()
            testing.settle(off)
    off.close()
    redos = [(name, begin, end, unit) for lane, name, begin, end, unit in timeline.events if lane == "device redo"]
    step = [(begin, end) for lane, name, begin, end, _ in timeline.events if (lane, name) == ("python", "step")]
    assert {u for *_, u in redos} == {4, 5, 6, 7} and len(step) == 1
    copies_in = [(b, e) for name, b, e, _ in redos if name.startswith("copy in")]
    assert len(copies_in) == len(redos) // 2 == 4  # one piece a layer
    # on the engine's clock: issued inside step(), the copies in one after another, each before its step
    assert all(step[0][0] - 50_000 <= b <= e for b, e in copies_in)
    assert all(a[1] <= b[0] + 50_000 for a, b in zip(copies_in, copies_in[1:]))  # 50 us of clock conversion
    for name, begin, end, unit in redos:
        if name.startswith("step"):
            landed = next(e for n, b, e, u in redos if u == unit and n.startswith("copy in"))
            assert abs(begin - landed) <= 50_000 and end >= begin


@pytest.mark.parametrize("backend", ["python", "native"])
def test_layers_kept_on_the_device_for_recompute_train_exactly_like_two_buffers(backend) -> None:
    # native: each layer's new weights go up inside backward once its step is done (eager), under random delays
    plain_losses, plain_weights = _train_transfer_heavy(backend, delay=False)
    stats: dict = {}
    losses, weights = _train_transfer_heavy(backend, delay=True, device_layers=8, stats=stats)
    assert losses == plain_losses
    _assert_same_weights(plain_weights, weights)
    assert (stats["early_layer_copies"] > 0) == (backend == "native")


@pytest.mark.parametrize("accumulate_on_device", [False, True])
def test_early_copies_up_with_two_micro_batches_train_like_the_synchronous_step(accumulate_on_device) -> None:
    # A buffer per layer and two micro-batches: each layer goes up inside the last backward once its step is
    # done (1 ms a step: some during backward, some in step(), under random copy delays), never after the first
    # micro-batch (summed on the host, its copies down are not steps).
    kw = dict(device_layers=8, grad_accum=2, accumulate_on_device=accumulate_on_device)
    sync_losses, sync_weights = _train_transfer_heavy("native", delay=False, async_step=False, **kw)
    stats: dict = {}
    losses, weights = _train_transfer_heavy("native", delay=True, step_delay_us=1_000, stats=stats, **kw)
    assert losses == sync_losses
    _assert_same_weights(sync_weights, weights)
    assert stats["early_layer_copies"] > 0


def test_kept_layers_on_a_slow_host_train_exactly_like_the_synchronous_step() -> None:
    # Without recompute and with 10 ms per layer step, the host steps reach far into the next forward: the
    # prefetches find them running, mark the compute point, and the copies issued at the binds wait for it.
    sync_losses, sync_weights = _train_transfer_heavy("native", delay=False, async_step=False)
    losses, weights = _train_transfer_heavy("native", delay=True, step_delay_us=10_000, activation_checkpointing="none")
    assert losses == sync_losses
    _assert_same_weights(sync_weights, weights)


def test_host_steps_in_small_slices_on_a_slow_host_train_exactly_like_whole_steps() -> None:
    whole_losses, whole_weights = _train_transfer_heavy("native", delay=False, slice_elements=1 << 62)
    # 1 ms per 100k-element slice: ~95 slices per layer, the lower layers cut in ahead of started ones.
    losses, weights = _train_transfer_heavy("native", delay=True, step_delay_us=1_000, slice_elements=100_000)
    assert losses == whole_losses
    _assert_same_weights(whole_weights, weights)


def test_checkpoint_recompute_gives_the_gpu_resident_gradients() -> None:
    base = TransferHeavy(layers=4, width=512)
    x = torch.randn(8, 512, generator=torch.Generator().manual_seed(2)).to("cuda", torch.bfloat16)
    ref = copy.deepcopy(base).to("cuda", torch.bfloat16)
    ref(x).float().pow(2).mean().backward()
    model = copy.deepcopy(base)
    off = offload_ext.Offloader(model, lr=0.0, backend="native", device="cuda")
    off.backward(model(x).float().pow(2).mean())
    off.step()
    testing.settle(off)  # the gradient copies and host steps of this backward have finished
    host = testing.host_buffers(off)
    for i, block in enumerate(ref.blocks):
        expected = torch.cat([block.fc.weight.grad.reshape(-1), block.fc.bias.grad.reshape(-1)]).cpu()
        torch.testing.assert_close(host[i].grads, expected, rtol=0, atol=0)
    off.close()


def test_per_layer_torch_compile_trains_like_eager() -> None:
    base, data = small_llama(), repeating_batches(6)
    runs = {}
    for compiled in (False, True):
        model = copy.deepcopy(base)
        off = offload_ext.Offloader(model, lr=3e-3, backend="native", device="cuda", compile_layers=compiled)
        runs[compiled] = offloaded_training(off, model, data, device="cuda")
        off.close()
    for a, b in zip(runs[True], runs[False]):
        assert abs(a - b) <= 0.02 * abs(b) + 0.02


@pytest.mark.parametrize("spec", ["none", 4])  # every layer kept, or the top half (the bottom half recomputes)
@pytest.mark.parametrize("backend", ["python", "native"])
def test_kept_layers_under_randomised_copy_timing_train_exactly_like_checkpointed_ones(backend, spec) -> None:
    plain_losses, plain_weights = _train_transfer_heavy(backend, delay=False)
    losses, weights = _train_transfer_heavy(backend, delay=True, activation_checkpointing=spec)
    assert losses == plain_losses
    _assert_same_weights(plain_weights, weights)


@pytest.mark.parametrize("spec", ["none", 2, "auto"])
def test_kept_layers_loss_curves_match_gpu_resident_training_without_checkpointing(spec) -> None:
    base, data = small_llama(), repeating_batches(30)
    ref, _ = reference_training(base, data, "bf16", lr=3e-3, wd=0.0, device="cuda", checkpointing=False)
    model = copy.deepcopy(base)
    off = offload_ext.Offloader(model, lr=3e-3, backend="native", device="cuda", activation_checkpointing=spec)
    losses = offloaded_training(off, model, data, device="cuda")
    kept = off.kept_layers
    off.close()
    assert kept == {"none": 4, 2: 2, "auto": 4}[spec]  # auto: the whole small model's activations fit an H200
    for ours, theirs in zip(losses, ref):
        assert abs(ours - theirs) <= 0.02 * abs(theirs) + 0.02, (losses, ref)
    assert losses[-1] < losses[0] - 0.5


def test_what_auto_measures_a_kept_layer_saves_on_the_gpu_is_the_plans_term() -> None:
    # The plan's kept-layer term comes from the simulated device, where it is exact; on the GPU SDPA's kernels
    # save their own tensors: within the plan's tenth.
    from offload_ext.planning.gpu import Shape, kept_layer_bytes

    model = small_llama()
    off = offload_ext.Offloader(model, lr=0.0, backend="native", device="cuda", activation_checkpointing="auto")
    batch = repeating_batches(1)[0].cuda()
    off.backward(offload_ext.causal_lm_loss(model, batch))
    off.step()
    measured = off.auto_choice["saved_bytes_per_layer"]
    off.close()
    assert measured == pytest.approx(kept_layer_bytes(Shape.of(model), *batch.shape), rel=0.10), measured


def test_auto_counts_the_device_optimizers_state_made_at_its_first_step() -> None:
    # torch's AdamW makes its moments at its first step, after the backward that peaked: "auto" adds them.
    model = small_llama()
    off = offload_ext.Offloader(model, lr=1e-3, backend="native", device="cuda", activation_checkpointing="auto")
    outer = sum(p.numel() for p in off.layout.device_params if p.requires_grad)
    batch = repeating_batches(1)[0].cuda()
    off.backward(offload_ext.causal_lm_loss(model, batch))
    off.step()
    grown = off.auto_choice["device_step_growth_bytes"]
    off.close()
    assert 2 * 2 * outer <= grown <= 2 * 2 * outer + (1 << 20), (grown, outer)  # two bf16 moments, step counters


@pytest.mark.parametrize("backend", ["python", "native"])
def test_inputs_held_on_the_host_under_randomised_copy_timing_train_exactly_like_on_the_gpu(backend) -> None:
    plain_losses, plain_weights = _train_transfer_heavy(backend, delay=False)
    losses, weights = _train_transfer_heavy(backend, delay=True, activation_offload=True)
    assert losses == plain_losses
    _assert_same_weights(plain_weights, weights)


def test_inputs_held_on_the_host_match_gpu_resident_training_and_leave_the_gpu() -> None:
    base, data = small_llama(), repeating_batches(30)
    ref, _ = reference_training(base, data, "bf16", lr=3e-3, wd=0.0, device="cuda")
    model = copy.deepcopy(base)
    off = offload_ext.Offloader(model, lr=3e-3, backend="native", device="cuda", activation_offload=True)
    losses = offloaded_training(off, model, data, device="cuda")
    off.close()
    for ours, theirs in zip(losses, ref):
        assert abs(ours - theirs) <= 0.02 * abs(theirs) + 0.02, (losses, ref)
    assert losses[-1] < losses[0] - 0.5


def test_given_its_micro_batch_the_offloader_lays_itself_out_as_offload_train_does() -> None:
    model = small_llama().bfloat16()
    off = offload_ext.Offloader(model, lr=1e-3, device="cuda", batch_shape=(4, 64))
    # a small model on a large GPU: every layer but one resident, planned for 4 x 64 tokens
    assert off.layout_choice.resident_layers == 3 and "batch 4 x 64" in off.layout_choice.reason
    assert len(off.layout.resident) == 3
    x = repeating_batches(1)[0].cuda()
    offload_ext.causal_lm_loss(model, x).backward()
    off.step()
    off.close()


def _lora_clipped_run(base_dtype: str | None, delay: bool, device: str = "cuda") -> tuple[list[float], dict, str]:
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(small_llama(), peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                               target_modules=["q_proj", "v_proj", "gate_proj"]))
    off = offload_ext.Offloader(model, lr=3e-3, device=device, max_grad_norm=1e-3, base_dtype=base_dtype,
                                async_step=delay)
    if delay:
        testing.delayed_copies(off, 2000)
        testing.slow_host_steps(off, 2000)
    losses = offloaded_training(off, model, repeating_batches(6), device=device)
    action, weights = off.last_clip_action, off.model_state_dict()
    off.close()
    return losses, weights, action


@pytest.mark.parametrize("base_dtype", [None, "int8"])
def test_lora_with_clipping_waits_for_the_norm_and_trains_exactly_under_randomised_timing(base_dtype) -> None:
    # A frozen base's layers do not speculate: every step clips, each layer's adapters step once after the norm,
    # while copies stall at random and the host is slow; the synchronous step is the reference, bit for bit.
    sync_losses, sync_weights, sync_action = _lora_clipped_run(base_dtype, delay=False)
    losses, weights, action = _lora_clipped_run(base_dtype, delay=True)
    assert sync_action == action == "clipped"
    assert losses == sync_losses
    _assert_same_weights(sync_weights, weights)
