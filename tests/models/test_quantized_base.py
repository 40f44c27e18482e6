"""A quantized frozen base for LoRA: each format holds a weight as bitsandbytes does (int8 row-wise, NF4 in blocks
of 64) and dequantizes as it does; the Offloader streams the base in that form and trains exactly as it does on the
same base dequantized to bf16, in fewer host bytes."""
from __future__ import annotations

import copy

import pytest
import torch

import offload_ext
from helpers import base_dequantized, batches, held_in, offloaded_training, tiny_llama
from offload_ext.models import quantized_base
from offload_ext.models.quantized_base import BASE_DTYPES, dequantize, quantize_into, stored_elements

peft = pytest.importorskip("peft")
SHAPES = [torch.Size((128, 256)), torch.Size((64, 64)), torch.Size((96, 320))]


def _weight(shape: torch.Size, seed: int = 0) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.02).bfloat16()


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_nf4_holds_bitsandbytes_codes_and_absmax_and_dequantizes_as_it_does(shape) -> None:
    bnb = pytest.importorskip("bitsandbytes.functional")
    w = _weight(shape)
    storage, ours = held_in("nf4", w)
    codes, state = bnb.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=False)
    raw = storage.view(torch.uint8)
    blocks = w.numel() // 64
    assert torch.equal(raw[:4 * blocks].view(torch.float32), state.absmax)
    assert torch.equal(raw[4 * blocks:4 * blocks + w.numel() // 2], codes.view(-1))
    assert torch.equal(ours, bnb.dequantize_4bit(codes, state).bfloat16())


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_int8_holds_llm_int8s_row_wise_codes_and_dequantizes_as_it_does(shape) -> None:
    bnb = pytest.importorskip("bitsandbytes.functional")
    w = _weight(shape)
    storage, ours = held_in("int8", w)
    codes, absmax, _ = torch.ops.bitsandbytes.int8_vectorwise_quant(w.clone())
    raw = storage.view(torch.uint8)
    assert torch.equal(raw[:4 * shape[0]].view(torch.float32), absmax)
    assert torch.equal(raw[4 * shape[0]:4 * shape[0] + w.numel()].view(torch.int8), codes.view(-1))
    assert torch.equal(ours, bnb.int8_vectorwise_dequant(codes, absmax).bfloat16())


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fp8_is_within_e4m3s_rounding_of_each_row_scaled_to_its_range(shape) -> None:
    w = _weight(shape)
    _, ours = held_in("fp8", w)
    scale = w.float().abs().amax(dim=1, keepdim=True) / 448
    # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 of a normal value, 2^-10 of the scale below its smallest
    # normal (2^-6); the bf16 result adds half its own ulp, 2^-9.
    bound = (2**-4 + 2**-9 + 2**-13) * w.float().abs() + 2**-10 * scale
    assert ((ours.float() - w.float()).abs() <= bound).all()


@pytest.mark.parametrize("fmt", BASE_DTYPES)
def test_the_torch_rule_dequantized_in_chunks_gives_the_ops_bits(fmt, monkeypatch) -> None:
    w = _weight(torch.Size((96, 320)))
    storage, by_op = held_in(fmt, w)
    monkeypatch.setattr(quantized_base, "DEQUANT_CHUNK", 704)  # 11 blocks of 64; rows of 320: 2 at a time
    chunked = torch.empty(w.shape, dtype=torch.bfloat16)
    dequantize(fmt, w.shape, storage, chunked, native=False)
    assert torch.equal(chunked.view(torch.int16), by_op.view(torch.int16))


def _any_storage(fmt: str, shape: torch.Size, device: str = "cpu") -> torch.Tensor:
    """A storage of every code (fp8's two NaN codes left out: torch's own float-to-bf16 casts give NaN different
    bits on different paths, and quantize_into never makes them) under scales from 2^-140 to 2^120: products
    that are bf16 subnormals, normals and overflow to infinity."""
    g = torch.Generator().manual_seed(5)
    storage = torch.randint(0, 1 << 16, (stored_elements(fmt, shape),), generator=g, dtype=torch.int32)
    storage = storage.to(torch.int16).view(torch.bfloat16)
    scales, codes = quantized_base._parts(fmt, shape, storage)
    if fmt == "fp8":
        raw = codes.view(torch.uint8)
        raw[(raw & 0x7F) == 0x7F] = 0x7E
    scales.copy_(torch.logspace(-140, 120, scales.numel(), base=2)[torch.randperm(scales.numel(), generator=g)])
    return storage.to(device)


@pytest.mark.parametrize("shape", [torch.Size((96, 320)), torch.Size((3, 64)), torch.Size((257, 192))], ids=str)
@pytest.mark.parametrize("fmt", BASE_DTYPES)
def test_the_dequantize_op_gives_the_torch_rules_bits_for_every_code_and_scale(fmt, shape) -> None:
    storage = _any_storage(fmt, shape)
    by_op, by_torch = (torch.empty(shape, dtype=torch.bfloat16) for _ in range(2))
    dequantize(fmt, shape, storage, by_op, native=True)
    dequantize(fmt, shape, storage, by_torch, native=False)
    assert torch.equal(by_op.view(torch.int16), by_torch.view(torch.int16))


def test_the_dequantize_op_refuses_a_storage_it_cannot_read_with_one_line_naming_the_fix() -> None:
    shape = torch.Size((4, 64))
    storage, out = _any_storage("nf4", shape), torch.empty(shape, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="unknown format 'int4'; expected int8, fp8 or nf4"):
        offload_ext.ops.dequantize_base(storage, "int4", shape, out.view(-1))
    with pytest.raises(RuntimeError, match=r"expected storage to have \d+ bf16 elements \(int8 scales and codes"):
        offload_ext.ops.dequantize_base(storage, "int8", shape, out.view(-1))
    with pytest.raises(RuntimeError, match="nf4 holds whole blocks of 64 elements; a 3 x 20 weight has 60"):
        offload_ext.ops.dequantize_base(storage, "nf4", torch.Size((3, 20)), out.view(-1)[:60])
    shifted = torch.empty(storage.numel() + 1, dtype=torch.bfloat16)[1:]
    with pytest.raises(RuntimeError, match="expected storage to start 4-byte aligned"):
        offload_ext.ops.dequantize_base(shifted, "nf4", shape, out.view(-1))


# More rows than the kernel's grid has along y; the rows' eight-a-thread path (codes after an odd count of scales:
# 4-byte aligned, not 8) and the element-a-thread one (rows not of whole groups of eight; an output one element off)
@pytest.mark.gpu
@pytest.mark.parametrize("shape, out_at", [((65537, 320), 0), ((64, 196), 0), ((65537, 320), 1)], ids=str)
@pytest.mark.parametrize("fmt", BASE_DTYPES)
def test_the_dequantize_op_gives_the_same_bits_on_the_gpu_as_on_the_host(fmt, shape, out_at) -> None:
    shape = torch.Size(shape)
    storage = _any_storage(fmt, shape)
    host = torch.empty(shape, dtype=torch.bfloat16)
    device = torch.empty(out_at + shape.numel(), dtype=torch.bfloat16, device="cuda")[out_at:]
    dequantize(fmt, shape, storage, host, native=True)
    dequantize(fmt, shape, storage.cuda(), device, native=True)
    assert torch.equal(device.cpu().view(torch.int16), host.view(-1).view(torch.int16))


@pytest.mark.parametrize("fmt", BASE_DTYPES)
def test_a_weight_quantized_in_chunks_is_held_the_same_as_at_once(fmt, monkeypatch) -> None:
    w = _weight(torch.Size((96, 320)))
    whole, _ = held_in(fmt, w)
    monkeypatch.setattr(quantized_base, "QUANT_CHUNK", 704)  # 11 blocks of 64; rows of 320: 2 at a time
    chunked, _ = held_in(fmt, w)
    assert torch.equal(chunked.view(torch.uint8), whole.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", BASE_DTYPES)
def test_a_weight_is_held_in_the_same_bits_quantized_on_the_gpu_as_on_the_host(fmt) -> None:
    # rows of every magnitude (fp8's subnormal scales, NF4's ties at the bounds come with them), over several chunks
    w = _weight(torch.Size((1536, 2048)))
    w = (w.float() * torch.logspace(-30, 30, w.shape[0], base=2).unsqueeze(1)).bfloat16()
    w[7] = 0
    host, _ = held_in(fmt, w)
    device = torch.empty(stored_elements(fmt, w.shape), dtype=torch.bfloat16, device="cuda")
    quantize_into(fmt, w.cuda(), device)
    assert torch.equal(device.cpu().view(torch.uint8), host.view(torch.uint8))


def test_a_row_of_zeros_stays_zero_in_every_format() -> None:
    w = _weight(torch.Size((64, 64)))
    w[3] = 0
    for fmt in BASE_DTYPES:
        assert torch.equal(held_in(fmt, w)[1][3], w[3]), fmt


def _lora(layers: int = 3) -> torch.nn.Module:
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
    torch.manual_seed(1)
    model = peft.get_peft_model(tiny_llama(layers=layers), config)
    for name, p in model.named_parameters():  # lora_B starts at zero: make the first steps see the adapters
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model


@pytest.mark.parametrize("precision", ["bf16", "mixed"])
@pytest.mark.parametrize("fmt", BASE_DTYPES)
def test_a_quantized_base_trains_exactly_as_its_dequantized_weights_in_bf16(fmt, precision) -> None:
    model = _lora()
    same = base_dequantized(model, fmt)
    off = offload_ext.Offloader(model, lr=1e-2, precision=precision, device="cpu", base_dtype=fmt)
    ref = offload_ext.Offloader(same, lr=1e-2, precision=precision, device="cpu")
    held = [s for u in off.layout.units for s in u.spans if s.quant]
    assert len(held) == 3 * 7 and all(s.quant == fmt for s in held)  # each layer's 7 frozen projections
    assert sum(u.numel for u in off.layout.units) < sum(u.numel for u in ref.layout.units)
    assert offloaded_training(off, model, batches(4)) == offloaded_training(ref, same, batches(4))
    off.close()
    ref.close()
    for (name, a), b in zip(model.named_parameters(), same.parameters()):
        assert torch.equal(a, b), name  # adapters stepped alike; the base reads back as its dequantized values


def test_a_quantized_bases_state_round_trip_continues_exactly() -> None:
    data = batches(4)
    model = _lora()
    twin = copy.deepcopy(model)
    off = offload_ext.Offloader(model, lr=1e-2, device="cpu", base_dtype="nf4")
    straight = offloaded_training(off, model, data)
    first = offload_ext.Offloader(twin, lr=1e-2, device="cpu", base_dtype="nf4")
    offloaded_training(first, twin, data[:2])
    state = first.state_dict()
    again = copy.deepcopy(_lora())
    second = offload_ext.Offloader(again, lr=1e-2, device="cpu", base_dtype="nf4")
    second.load_state_dict(state)
    assert straight[2:] == offloaded_training(second, again, data[2:])
    for o in (off, first, second):
        o.close()


def _host_of(room: int) -> str:
    """OFFLOAD_EXT_HOST_MEMORY for a host whose buffers may take `room` bytes (an eighth is kept free)."""
    total = room
    while total - total // 8 < room:
        total += 1
    return f"{total}B"


def test_close_refuses_a_bf16_copy_of_the_base_the_host_cannot_hold_and_detaches_without_it(monkeypatch) -> None:
    model = _lora()
    twin = copy.deepcopy(model)
    off = offload_ext.Offloader(model, lr=1e-2, device="cpu", base_dtype="int8")
    ref = offload_ext.Offloader(twin, lr=1e-2, device="cpu", base_dtype="int8")
    trained = offloaded_training(off, model, batches(2))
    assert trained == offloaded_training(ref, twin, batches(2))
    ref.close()
    copied = sum(p.numel() * p.element_size() for p in twin.parameters())  # the base dequantized: bf16
    assert copied > sum(u.numel for u in off.layout.units) * 2  # more than the host holds of it, quantized
    monkeypatch.setenv("OFFLOAD_EXT_HOST_MEMORY", _host_of(copied - 1))
    with pytest.raises(MemoryError, match=r"close\(copy_out=False\)"):
        off.close()
    # refused before any copy: the weights still read back, as the twin's did
    kept = off.model_state_dict()
    for name, p in twin.named_parameters():
        assert torch.equal(kept[name], p), name
    off.close(copy_out=False)
    assert all(p.is_meta for p in model.parameters())
    assert [p.shape for p in model.parameters()] == [p.shape for p in twin.parameters()]
    off.close()  # detached: nothing more to do
    monkeypatch.delenv("OFFLOAD_EXT_HOST_MEMORY")
    other = _lora()
    again = offload_ext.Offloader(other, lr=1e-2, device="cpu", base_dtype="int8")
    monkeypatch.setenv("OFFLOAD_EXT_HOST_MEMORY", _host_of(copied))
    again.close()  # exactly room for the copy: made
    assert not any(p.is_meta for p in other.parameters())


def test_base_dtype_is_refused_where_nothing_is_frozen_or_layers_are_kept() -> None:
    with pytest.raises(ValueError, match="base_dtype='int8' holds the frozen linear weights .* it is for LoRA"):
        offload_ext.Offloader(tiny_llama(layers=2), device="cpu", base_dtype="int8")
    with pytest.raises(ValueError, match="base_dtype='nf4' needs activation_checkpointing='all'"):
        offload_ext.Offloader(_lora(2), device="cpu", base_dtype="nf4", activation_checkpointing="none")


def test_the_plan_counts_the_quantized_base_in_fewer_host_bytes() -> None:
    model = _lora(2)
    plain = offload_ext.plan(model, device="cpu", host_memory="10GB").host_by_what
    held = offload_ext.plan(model, device="cpu", host_memory="10GB", base_dtype="nf4").host_by_what
    assert 0 < held[("params", True)] < plain[("params", True)]
    gpu = offload_ext.plan(model, device="cuda", gpu_memory="24GB", host_memory="10GB", base_dtype="nf4").gpu
    layer = model.base_model.model.model.layers[0]
    frozen = sum(m.weight.numel() for m in layer.modules()
                 if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad)
    gpu = dict(gpu.static)
    assert gpu["quantized base dequantized (one layer per stack, bf16, and any temporaries)"] == \
        2 * frozen + quantized_base.dequantize_temp_bytes()
