"""offload_ext.plan: its host figures are the engine's pools, its activation terms a checkpointed layer's
live tensors; a run that cannot fit is refused before anything is allocated, naming what would fit."""
from __future__ import annotations

import os

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

import offload_ext
from helpers import tiny_llama
from offload_ext import testing
from offload_ext.engine.backends.native import NativeBackend
from offload_ext.engine.backends.python import PythonBackend
from offload_ext.models.losses import lm_head_loss
from offload_ext.planning.gpu import Shape, kept_layer_bytes, layer_activation_bytes, loss_rows
from offload_ext.train import cli as train

HOST_KNOBS = [dict(), dict(precision="mixed"), dict(max_grad_norm=1.0), dict(max_grad_norm=1.0, precision="mixed"),
              dict(max_grad_norm=1.0, speculative_clip=False), dict(grad_accum=2),
              dict(grad_accum=2, max_grad_norm=1.0), dict(resident_layers=1), dict(offload_all=True),
              dict(grad_slots=2, precision="mixed"), dict(precision="bf16-sr"),
              dict(precision="bf16-sr", max_grad_norm=1.0), dict(precision="bf16-8bit"),
              dict(precision="bf16-8bit-sr", max_grad_norm=1.0), dict(precision="bf16-8bit", grad_accum=2,
                                                                        no_decay=("norm",))]


@pytest.mark.parametrize("knobs", HOST_KNOBS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()) or "defaults")
def test_the_plans_host_figures_are_the_native_engines_pools(knobs) -> None:
    model = tiny_llama(layers=4)
    memory = offload_ext.plan(model, device="cpu", **knobs)
    off = offload_ext.Offloader(model, backend="native", device="cpu", **knobs)
    stats = off.stats()
    off.close()
    assert (memory.host_pinned, memory.host_pageable) == (stats["pinned_reserved"], stats["host_reserved"])
    assert stats["pinned_in_use"] <= stats["pinned_reserved"] and stats["host_in_use"] <= stats["host_reserved"]


@pytest.mark.parametrize("precision", ["bf16", "mixed"])
def test_close_gives_the_optimizer_state_back_before_copying_the_weights_out(precision) -> None:
    # Copied out on top of the whole engine, a 14 B model's weights took the host from 84 to 113 GB at
    # close() (run 66). The moments (and mixed's masters) go first: the pageable pool is unmapped whole.
    from offload_ext.planning.memory import process_rss

    model = tiny_llama(layers=8, hidden=512)
    off = offload_ext.Offloader(model, backend="native", device="cpu", precision=precision)
    x = torch.randint(0, 128, (1, 16))
    off.backward(model(input_ids=x, labels=x).loss)
    off.step()
    expected = {n: t.clone() for n, t in off.model_state_dict().items()}
    pageable, rss = off.stats()["host_reserved"], process_rss()
    off.close()
    assert off.stats()["host_reserved"] == 0 < pageable
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert process_rss() <= rss - pageable + 2 * weights  # the copy out, with room for the allocator's slack
    for name, t in model.state_dict().items():
        assert torch.equal(t, expected[name]), name


@pytest.mark.parametrize("spec", ["all", "none", 4, "auto"])
def test_kept_layers_get_a_gradient_slot_each_and_the_plan_counts_them(spec) -> None:
    # Without recompute a layer's backward is quicker than its host step: the top layers' steps wait while
    # the lower ones cycle, so a ring of 6 slots would stall backward on slot reuse (run 47).
    model = tiny_llama(layers=8)
    kw = dict(activation_checkpointing=spec, gpu_memory_budget=1 << 30 if spec == "auto" else None)
    memory = offload_ext.plan(model, device="cpu", **kw)
    off = offload_ext.Offloader(model, backend="native", device="cpu", **kw)
    stats = off.stats()
    off.close()
    assert (memory.host_pinned, memory.host_pageable) == (stats["pinned_reserved"], stats["host_reserved"])
    slot = memory.host_by_what[("params", True)] // 8  # one layer's bf16 weights: a slot's size here
    assert memory.host_by_what[("gradient staging", True)] // slot == (6 if spec == "all" else 8)


def test_the_plans_host_figures_are_the_engines_pools_under_lora() -> None:
    peft = pytest.importorskip("peft")
    base = tiny_llama(layers=3, hidden=256)
    whole = offload_ext.plan(base, device="cpu", max_grad_norm=1.0)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                      target_modules=["q_proj", "v_proj"]))
    memory = offload_ext.plan(model, device="cpu", max_grad_norm=1.0)
    off = offload_ext.Offloader(model, backend="native", device="cpu", max_grad_norm=1.0)
    stats = off.stats()
    off.close()
    assert (memory.host_pinned, memory.host_pageable) == (stats["pinned_reserved"], stats["host_reserved"])
    assert memory.host_by_what[("moments", False)] < whole.host_by_what[("moments", False)] / 5  # adapters only


@pytest.mark.parametrize("knobs", [dict(), dict(precision="mixed", grad_accum=2)], ids=["bf16", "mixed-accum"])
def test_the_plans_host_figures_are_the_python_backends_buffers(knobs) -> None:
    model = tiny_llama(layers=3)
    memory = offload_ext.plan(model, backend="python", device="cpu", **knobs)
    off = offload_ext.Offloader(model, backend="python", device="cpu", **knobs)
    start, end = testing.pinned_arena_bounds(off)
    buffers = testing.host_buffers(off)
    state = [t for b in buffers for t in (b.exp_avg, b.exp_avg_sq, b.master, b.accum) if t is not None]
    # "mixed" also keeps an fp32 copy of each layer's gradient (4 bytes per trainable parameter).
    fp32 = 4 * sum(b.trainable for b in buffers) if knobs.get("precision") == "mixed" else 0
    off.close()
    assert memory.host_pinned == end - start
    assert memory.host_pageable == sum(t.nbytes for t in state) + fp32


def _meta_llama(layers: int = 8, hidden: int = 1024) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=16, num_key_value_heads=4)
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


@pytest.mark.parametrize("backend", ["native", "python"])
def test_a_model_the_host_cannot_hold_is_refused_before_any_buffer(backend, monkeypatch) -> None:
    model = _meta_llama()  # 0.12 B streamed parameters: ~1 GB of host buffers in bf16, ~2 GB in mixed
    memory = offload_ext.plan(model, device="cpu", backend=backend, precision="mixed", host_memory="1.5GB")
    assert not memory.fits and memory.host_available == 1.5e9 - 1.5e9 // 8  # an eighth kept as headroom
    bf16 = "precision='bf16' (saves"
    assert any(o.startswith("host: " + bf16) and "which fits" in o for o in memory.options), memory.options
    prepared = []
    for cls in (NativeBackend, PythonBackend):
        monkeypatch.setattr(cls, "prepare", lambda self, *a, **k: prepared.append(a))
    monkeypatch.setenv("OFFLOAD_EXT_HOST_MEMORY", "1.5GB")
    with pytest.raises(MemoryError, match=rf"need {memory.host_total / 1e9:.1f} GB .* 1\.3 GB available.*nothing "
                                          rf"was allocated.*{bf16[:-7]}.*which fits"):
        offload_ext.Offloader(model, backend=backend, device="cpu", precision="mixed")
    assert not prepared  # no host buffer was asked for


def test_a_lora_base_the_host_cannot_hold_in_bf16_is_offered_in_int8_and_nf4_with_their_figures() -> None:
    from offload_ext.models.lora import add_lora

    model = add_lora(_meta_llama(), 4, 8, ("q_proj", "v_proj"))  # ~0.12 B streamed: ~0.24 GB of bf16 base
    bf16 = offload_ext.plan(model, device="cpu", host_memory="10GB")
    memory = offload_ext.plan(model, device="cpu", host_memory=int(bf16.host_total * 0.8 * 8 / 7))
    assert not memory.fits
    host = [o for o in memory.options if o.startswith("host: ")]
    assert not any(o.startswith("host: LoRA ") for o in host), host  # it is LoRA already
    for fmt in ("int8", "nf4"):
        held = offload_ext.plan(model, device="cpu", host_memory="10GB", base_dtype=fmt)
        line = f"host: base_dtype='{fmt}' (saves {(memory.host_total - held.host_total) / 1e9:.1f} GB: " \
               f"{held.host_total / 1e9:.1f} GB in all, which fits;"
        assert any(o.startswith(line) for o in host), (line, host)
    full = offload_ext.plan(_meta_llama(), device="cpu", host_memory="0.5GB")  # a full fine-tune: no base to hold
    assert not full.fits and not any("base_dtype" in o for o in full.options)


def test_a_lora_run_that_keeps_layers_is_offered_a_quantized_base_with_the_recompute_it_needs() -> None:
    from offload_ext.models.lora import add_lora

    model = add_lora(_meta_llama(), 4, 8, ("q_proj", "v_proj"))
    kept = dict(activation_checkpointing=1, device="cpu")
    memory = offload_ext.plan(model, host_memory=int(offload_ext.plan(model, host_memory="10GB", **kept).host_total
                                                     * 0.8 * 8 / 7), **kept)
    assert not memory.fits
    for fmt in ("int8", "nf4"):
        held = offload_ext.plan(model, device="cpu", host_memory="10GB", base_dtype=fmt)  # recomputes every layer
        line = f"host: base_dtype='{fmt}', activation_checkpointing='all' (saves " \
               f"{(memory.host_total - held.host_total) / 1e9:.1f} GB: {held.host_total / 1e9:.1f} GB in all"
        assert any(o.startswith(line) for o in memory.options), (line, memory.options)


def test_speculation_is_planned_as_high_up_as_the_host_holds_it() -> None:
    model = _meta_llama(layers=8)
    full = offload_ext.plan(model, device="cpu", max_grad_norm=1.0, host_memory="100GB")
    assert full.speculating == (8, 8)
    second = full.host_by_what[("second buffers", True)] + full.host_by_what[("second buffers", False)]
    tight = int((full.host_total - second / 2) * 8 / 7) + 1  # a machine whose available memory holds half of them
    memory = offload_ext.plan(model, device="cpu", max_grad_norm=1.0, host_memory=tight)
    assert memory.fits and memory.speculating[1] == 8 and 0 < memory.speculating[0] < 8


def test_a_gpu_too_small_is_refused_with_the_batch_that_fits() -> None:
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                      num_attention_heads=16, num_key_value_heads=4)
    roomy = offload_ext.plan(cfg, batch_size=2, seq_len=2048, gpu_memory="40GB", host_memory="100GB")
    assert roomy.fits and roomy.largest_batch > 2 and roomy.largest_seq > 2 * 2048
    need = roomy.gpu_terms
    assert need["params outside the stacks (bf16)"] == 2 * (2 * 32000 + 1) * 2048  # untied embedding, head, norm
    assert sum(need.values()) == roomy.gpu_needed
    small = offload_ext.plan(cfg, batch_size=64, seq_len=2048, gpu_memory="8GB", host_memory="100GB")
    assert not small.fits and "the GPU needs" in small.refusal()
    batch = small.largest_batch
    assert 0 < batch < 64 and any(o.startswith(f"GPU: batch_size={batch} ") and o.endswith(", both fit)")
                                  for o in small.options)
    assert offload_ext.plan(cfg, batch_size=batch, seq_len=2048, gpu_memory="8GB", host_memory="100GB").fits
    assert not offload_ext.plan(cfg, batch_size=batch + 1, seq_len=2048, gpu_memory="8GB", host_memory="100GB").fits


def test_the_offloaders_device_check_refuses_what_stays_on_the_gpu(monkeypatch) -> None:
    # The check runs on the figures alone: a CUDA device is described here by the memory it has free.
    from offload_ext.planning import plan as planning
    from offload_ext.planning.choices import Settings, choose

    model = _meta_llama(layers=4, hidden=2048)  # embeddings and head of 32000 x 2048: 0.26 GB, 0.52 GB of state
    device = torch.device("cuda", 0)
    choices = choose(model, Settings(), device, lambda p: 0)
    monkeypatch.setattr(planning, "_free_for", lambda model, device: 1_600_000_000)
    with pytest.raises(MemoryError, match=r"the device needs 1\.9 GB before any activation \(params outside the "
                                          r"stacks \(bf16\) 0\.26 GB.* 1\.6 GB is free.*nothing was allocated.*"
                                          r"offload_all=True [^;]*both fit\)"):
        planning.check_device_memory(model, Settings(), choices, device, lambda p: 0)
    monkeypatch.setattr(planning, "_free_for", lambda model, device: 4_000_000_000)
    planning.check_device_memory(model, Settings(), choices, device, lambda p: 0)


def test_plan_builds_a_config_directory_on_the_meta_device(tmp_path) -> None:
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2).save_pretrained(tmp_path)
    memory = offload_ext.plan(str(tmp_path), device="cpu", batch_size=1, seq_len=64)
    assert memory.fits and memory.host_by_what[("params", True)] > 3 * 2 * 256 * 256
    assert "memory plan: LlamaForCausalLM" in str(memory) and "fits" in str(memory).splitlines()[-1]


# ------------------------------------------------------------------ activation terms against live tensors


class _LiveBytes(TorchDispatchMode):
    """The peak of the bytes held by tensors made inside (storages that existed before do not count)."""

    def __init__(self, before: list[torch.Tensor]) -> None:
        super().__init__()
        self.before = {t.untyped_storage()._cdata for t in before}
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if st._cdata not in self.live and st._cdata not in self.before:
                    self.live[st._cdata] = (StorageWeakRef(st), st.nbytes())
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


@pytest.mark.parametrize("arch,hidden,inter,heads,kv,batch,seq", [
    ("llama", 256, 704, 8, 2, 2, 512), ("llama", 512, 1792, 8, 2, 1, 1024), ("qwen2", 320, 864, 5, 1, 1, 768),
    ("llama", 512, 1792, 8, 8, 1, 96)])
def test_a_layers_activation_term_is_its_live_tensors_at_the_peak(arch, hidden, inter, heads, kv, batch, seq) -> None:
    # A checkpointed layer's recompute and backward on the CPU, with each weight gradient dropped by a hook as
    # the gradient path's does: the term holds within 2 % of what its tensors add up to at their peak.
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config, model_cls = (Qwen2Config, Qwen2ForCausalLM) if arch == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    torch.manual_seed(0)
    model = model_cls(config(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                             num_key_value_heads=kv, num_hidden_layers=1, vocab_size=100)).to(torch.bfloat16)
    layer = model.model.layers[0]
    x = torch.randn(batch, seq, hidden, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(seq)[None].expand(batch, seq)
    cos, sin = model.model.rotary_emb(x, positions)
    grad = torch.randn_like(x)
    for p in layer.parameters():
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    tracker = _LiveBytes([*layer.parameters(), x, grad, cos, sin])
    with tracker:
        out = checkpoint(lambda h: layer(h, attention_mask=None, position_embeddings=(cos, sin)), x,
                         use_reentrant=False)
        out.backward(grad)
    largest = max(p.numel() for p in layer.parameters())
    assert layer_activation_bytes(Shape.of(model), batch * seq, largest) == pytest.approx(tracker.peak, rel=0.02)


@pytest.mark.parametrize("backend,chunk", [("native", 4096), ("native", 256), ("torch", 4096), ("torch", 256)])
def test_the_loss_term_is_the_chunked_losss_live_tensors_at_the_peak(backend, chunk) -> None:
    if backend == "native" and not offload_ext._ext.available():
        pytest.skip("needs the extension's cross-entropy kernels")
    hidden, vocab, batch, seq = 256, 4000, 2, 512
    head = torch.nn.Linear(hidden, vocab, bias=False).to(torch.bfloat16)
    x = torch.randn(batch, seq, hidden, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (batch, seq))
    tracker = _LiveBytes([head.weight, x, labels])
    with tracker:
        lm_head_loss(head, x, labels, chunk_tokens=chunk, kernel=backend).backward()
    shape = Shape(hidden, 4 * hidden, 4, 4, hidden // 4, vocab)
    rows = dict(loss_rows(shape, batch, seq, chunk, backend == "native", 2 * head.weight.numel()))
    norm = 6 * batch * seq * hidden  # the final norm's saved tensors: not in this graph
    assert sum(rows.values()) - norm == pytest.approx(tracker.peak, rel=0.05)


# ------------------------------------------------------------------ against the GPU machine's measurements


def _shape_config(name: str):
    from transformers import LlamaConfig, Qwen2Config

    if name == "b1":  # bench_train's B1: the Llama-3.2-1B shape, tied
        return LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                           num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True, use_cache=False)
    if name == "qwen-14b":
        return Qwen2Config(vocab_size=152064, hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                           num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False, use_cache=False)
    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False, use_cache=False)


@pytest.mark.parametrize("arch,hidden,inter,heads,kv,batch,seq", [
    ("llama", 256, 688, 8, 4, 2, 256), ("llama", 128, 352, 4, 1, 3, 64), ("qwen2", 320, 864, 5, 1, 1, 96)])
def test_a_kept_layers_term_is_what_auto_measures_it_saves(arch, hidden, inter, heads, kv, batch, seq) -> None:
    # What "auto" counts as a kept layer's saved tensors beyond its input in the first step, to the byte.
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config, model_cls = (Qwen2Config, Qwen2ForCausalLM) if arch == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    torch.manual_seed(0)
    model = model_cls(config(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                             num_key_value_heads=kv, num_hidden_layers=2, vocab_size=100))
    off = offload_ext.Offloader(model, device="cpu", backend="native", activation_checkpointing="auto",
                                gpu_memory_budget=1)
    off.backward(offload_ext.causal_lm_loss(model, torch.randint(0, 100, (batch, seq))))
    off.step()
    measured = off.auto_choice["saved_bytes_per_layer"]
    off.close()
    assert kept_layer_bytes(Shape.of(model), batch, seq) == measured


def test_the_plan_counts_kept_layers_saved_tensors_instead_of_their_inputs() -> None:
    config = _shape_config("b1")
    plans = {spec: offload_ext.plan(config, batch_size=4, seq_len=2048, gpu_memory="139GiB", host_memory="125GB",
                                    activation_checkpointing=spec) for spec in ("all", "none", 10, "auto")}
    shape, tokens = Shape(hidden=2048, intermediate=8192, heads=32, kv_heads=8, head_dim=64, vocab=128256), 4 * 2048
    kept = kept_layer_bytes(shape, 4, 2048) - 2 * tokens * shape.hidden  # each kept layer: its saved, not its input
    loss = {spec: plans[spec].gpu.phase_bytes("loss") for spec in plans}
    assert loss["none"] - loss["all"] == 16 * kept and loss[10] - loss["all"] == 6 * kept
    assert loss["auto"] == loss["all"]  # auto keeps what its budget holds at run time: planned as "all"
    held = offload_ext.plan(config, batch_size=4, seq_len=2048, gpu_memory="139GiB", host_memory="125GB",
                            activation_offload=True)
    inputs = dict(held.gpu_phases["loss"])["checkpointed layer inputs"]
    assert inputs == 2 * 2 * tokens * shape.hidden  # on the host but the one in use and the next one down
    assert held.host_activations == 16 * 2 * tokens * shape.hidden  # every checkpointed input, on the host
    base = plans["all"]  # the interpreter's share is read when each plan is made: it may have grown between
    assert held.host_peak_rss - held.host_process == base.host_peak_rss - base.host_process + held.host_activations


ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("name,batch,lora,measured", [
    # benchmarks/results/2026-12-01_b997b85: metrics_8b.jsonl (offload-train, step 2's peak), train_b2.md
    # (native-bf16), train_b2_lora.md, console_call_b.log (qwen).
    ("llama-8b", 1, None, 11.46e9), ("llama-8b", 2, None, 13.79e9), ("llama-8b", 2, 16, 7.25e9),
    ("qwen-14b", 1, None, 16.7e9)])
def test_the_gpu_figures_are_within_a_tenth_of_the_gpu_machines(name, batch, lora, measured) -> None:
    if lora:
        pytest.importorskip("peft")
    memory = offload_ext.plan(_shape_config(name), batch_size=batch, seq_len=4096, gpu_memory="139GiB",
                              host_memory="125GB", lora_r=lora, lora_targets=ALL_PROJECTIONS)
    assert memory.gpu.peak == pytest.approx(measured, rel=0.10)


@pytest.mark.parametrize("precision,per_element", [("bf16", 2), ("mixed", 4)])
def test_a_checkpoint_adds_one_device_tensor_to_the_host_and_nothing_to_the_gpu(precision, per_element) -> None:
    # save_state streams the device's tensors out one at a time: the largest (the embedding; its fp32 moment or
    # master in "mixed") is what a checkpoint adds to the host's peak, however many layers are resident, and no
    # phase of the GPU's plan holds a copy. On the simulated device they are written where they lie.
    config = _shape_config("llama-8b")
    plans = {r: offload_ext.plan(config, batch_size=1, seq_len=4096, gpu_memory="139GiB",
                                 host_memory="125GB", precision=precision, resident_layers=r) for r in (0, 2)}
    embedding = config.vocab_size * config.hidden_size
    assert plans[0].host_checkpoint == plans[2].host_checkpoint == per_element * embedding
    assert "checkpoint: the largest device tensor, copied out alone" in str(plans[2])
    assert set(plans[2].gpu_phases) == {"embedding backward", "optimizer step", "layer backward", "loss"}
    assert offload_ext.plan(config, precision=precision, device="cpu", host_memory="125GB").host_checkpoint == 0


@pytest.mark.parametrize("knobs,micro,measured", [
    # train_b1_recipes.log of the same call (batch 4 x 2048; with accumN, N micro-batches of 4 / N)
    (dict(), 4, 5.0e9), (dict(max_grad_norm=1e6), 4, 5.0e9), (dict(precision="mixed"), 4, 7.1e9),
    (dict(precision="mixed", max_grad_norm=1e-3), 4, 7.1e9), (dict(grad_accum=2), 2, 6.3e9),
    (dict(grad_accum=4), 1, 5.9e9), (dict(resident_layers=4), 4, 6.4e9)])
def test_the_b1_recipes_gpu_figures_are_within_a_tenth_of_the_gpu_machines(knobs, micro, measured) -> None:
    memory = offload_ext.plan(_shape_config("b1"), batch_size=micro, seq_len=2048, gpu_memory="24GB", **knobs)
    assert memory.gpu.peak == pytest.approx(measured, rel=0.10)


@pytest.mark.parametrize("name,engine", [("llama-8b", 44.5e9), ("qwen-14b", 84.2e9 - 1.6e9)])
def test_the_host_figures_are_the_gpu_machines(name, engine) -> None:
    # 8B: the engine's state in the B2 runs; qwen-14b: host_memory_qwen.log's plateau through training less the
    # process's 1.6 GB before its buffers (its 113 GB peak is close() copying the model back to the CPU).
    memory = offload_ext.plan(_shape_config(name), batch_size=1, seq_len=4096, gpu_memory="139GiB",
                              host_memory="125GB")
    assert memory.fits and memory.host_total == pytest.approx(engine, rel=0.02)


# ------------------------------------------------------------------ offload-train


def test_dry_run_plans_the_8b_and_14b_shapes_for_an_h200_without_one(tmp_path, capsys) -> None:
    for model in ("llama-8b", "qwen-14b"):
        out = tmp_path / model
        result = train.run(train.parse_args(["--model", model, "--device", "cuda", "--gpu-memory", "139GiB",
                                             "--host-memory", "125GB", "--batch-size", "1", "--seq-len", "4096",
                                             "--out", str(out), "--dry-run"]))
        printed = capsys.readouterr().out
        assert result["plan"].fits and "memory plan:" in printed and printed.rstrip().endswith("fits")
        assert not out.exists()  # nothing written


def _fails(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        train.main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_dry_run_that_does_not_fit_exits_2_with_the_options(tmp_path, capsys) -> None:
    err = _fails(["--model", "qwen-14b", "--device", "cpu-sim", "--host-memory", "40GB", "--batch-size", "1",
                  "--seq-len", "4096", "--out", str(tmp_path / "o"), "--dry-run"], capsys)
    assert "does not fit cpu: the host buffers need 82.6 GB" in err and "LoRA (saves" in err
    assert not (tmp_path / "o").exists()


def test_dry_run_for_cuda_without_a_gpu_asks_for_its_size(tmp_path, capsys) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is here to measure")
    err = _fails(["--model", "tiny", "--device", "cuda", "--dry-run", "--out", str(tmp_path)], capsys)
    assert "--gpu-memory SIZE" in err


def test_a_run_that_cannot_fit_stops_before_the_engine(tmp_path, capsys, monkeypatch) -> None:
    built = []
    monkeypatch.setattr(offload_ext.Offloader, "__init__", lambda self, *a, **k: built.append(a))
    monkeypatch.setenv("OFFLOAD_EXT_HOST_MEMORY", "1MB")
    err = _fails(["--model", "tiny", "--device", "cpu-sim", "--precision", "mixed", "--steps", "1",
                  "--out", str(tmp_path)], capsys)
    assert "does not fit cpu: the host buffers need" in err and not built


def test_a_planned_run_trains_as_planned(tmp_path) -> None:
    # The real run's engine reserves what its dry run printed.
    args = ["--model", "tiny", "--device", "cpu-sim", "--steps", "1", "--max-grad-norm", "1.0", "--out",
            str(tmp_path)]
    memory = train.run(train.parse_args([*args, "--dry-run"]))["plan"]
    seen = {}
    original = offload_ext.Offloader.step

    def step(self, *a, **k):
        seen.update(self.stats())
        return original(self, *a, **k)

    try:
        offload_ext.Offloader.step = step
        train.run(train.parse_args(args))
    finally:
        offload_ext.Offloader.step = original
    assert (seen["pinned_reserved"], seen["host_reserved"]) == (memory.host_pinned, memory.host_pageable)
    assert os.path.exists(tmp_path / "metrics.jsonl")


def test_plan_takes_the_offloaders_config_and_its_keywords() -> None:
    config = offload_ext.OffloadConfig(device="cpu", max_grad_norm=1.0)
    by_config = offload_ext.plan(tiny_llama(layers=2), config, batch_size=2, seq_len=16)
    by_keywords = offload_ext.plan(tiny_llama(layers=2), device="cpu", max_grad_norm=1.0, batch_size=2, seq_len=16)
    assert by_config.fits and by_config.settings == by_keywords.settings
    assert by_config.host_pinned == by_keywords.host_pinned and by_config.host_pageable == by_keywords.host_pageable
    with pytest.raises(TypeError, match="plan: unknown option 'device_layer'"):
        offload_ext.plan(tiny_llama(layers=2), device="cpu", device_layer=3)


def test_the_plan_gives_the_host_bytes_per_parameter_of_each_precision_with_and_without_clipping() -> None:
    model = _meta_llama(layers=4, hidden=256)
    params = sum(p.numel() for p in model.parameters())
    memory = offload_ext.plan(model, device="cpu", host_memory="100GB")
    rows = {precision: (plain, clip) for precision, plain, clip in memory.host_per_param}
    assert list(rows) == ["bf16", "bf16-sr", "mixed", "bf16-8bit", "bf16-8bit-sr"]
    assert rows["bf16"][0] == memory.host_total / params  # the plan's own setting is its buffers' total
    clipped = offload_ext.plan(model, device="cpu", host_memory="100GB", precision="mixed", max_grad_norm=1.0)
    assert rows["mixed"][1] == clipped.host_total / params  # every unit speculating: the host has room for all
    assert all(plain < clip for plain, clip in rows.values()) and rows["bf16"][0] < rows["mixed"][0]
    # a streamed parameter's two moments take a byte each and an absmax per 256 instead of two bytes each (with
    # clipping twice: speculation's second buffers); within 2 % for the pages each block is rounded to
    streamed = sum(p.numel() for p in model.model.layers.parameters()) / params
    saved = (2 - 2 * 4 / 256) * streamed
    assert rows["bf16"][0] - rows["bf16-8bit"][0] == pytest.approx(saved, rel=0.02)
    assert rows["bf16"][1] - rows["bf16-8bit"][1] == pytest.approx(2 * saved, rel=0.02)
    assert "engine buffers per parameter (bytes), by precision" in str(memory)
