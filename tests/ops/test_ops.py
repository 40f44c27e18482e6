"""torch.library.opcheck on every native op: schema mutation annotations, fake kernels, autograd registration
and AOT dispatch; on the CPU always, on CUDA (the AdamW, cross-entropy and sum-of-squares kernels) where a GPU
is present. Then the CUDA AdamW step against the CPU kernel's bits, the sum of squares against an exact
reference, and the bf16-sr stores against the torch-op rule, bit for bit (the base's dequantization against its
rule: tests/models/test_quantized_base.py)."""
from __future__ import annotations

import math

import pytest
import torch

import offload_ext
from offload_ext import ops
from offload_ext.optim import eight_bit

GPU = pytest.mark.gpu
DEVICES = ["cpu", pytest.param("cuda", marks=GPU)]
IGNORE = -100


def _rows(device: str, dtype: torch.dtype, rows: int = 7, vocab: int = 37,
          requires_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rows * vocab)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(device, dtype).requires_grad_(requires_grad)
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    labels[1] = IGNORE
    return logits, labels.to(device)


@pytest.mark.parametrize("mode", ["bf16", "bf16-sr", "fp32", "mixed"])
def test_adamw_step_passes_opcheck(mode: str) -> None:
    gen = torch.Generator().manual_seed(0)
    n = 1000
    state = torch.bfloat16 if mode.startswith("bf16") else torch.float32
    grad = torch.randn(n, generator=gen).to(torch.float32 if mode == "fp32" else torch.bfloat16)
    param_out = torch.empty(n, dtype=torch.bfloat16) if mode == "mixed" else None
    args = (torch.randn(n, generator=gen).to(state), grad, torch.randn(n, generator=gen).to(state),
            torch.rand(n, generator=gen).to(state), param_out, 1e-3, 0.9, 0.999, 1e-8, 0.01, 3)
    if mode == "bf16-sr":  # sr_seed, sr_stream, sr_offset
        args += (7, 2, 1 << 33)
    torch.library.opcheck(torch.ops.offload_ext.adamw_step.default, args)


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("sr", [(None, 0, 0), (7, 2, 1 << 33)])  # sr_seed, sr_stream, sr_offset
def test_adamw8bit_step_passes_opcheck(grad_dtype: torch.dtype, sr: tuple) -> None:
    gen = torch.Generator().manual_seed(0)
    n = 1000
    args = (torch.randn(n, generator=gen).bfloat16(), torch.randn(n, generator=gen).to(grad_dtype),
            torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8),
            torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8), torch.rand(4, generator=gen),
            torch.rand(4, generator=gen) * 1e-3, eight_bit.signed_dynamic_map(), eight_bit.unsigned_dynamic_map(),
            1e-3, 0.9, 0.999, 1e-8, 0.01, 3, *sr)
    torch.library.opcheck(torch.ops.offload_ext.adamw8bit_step.default, args)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, but a NaN's sign and payload: in fp32 they follow whichever operand the hardware
    propagates (bf16 stores canonicalize NaN, as c10::BFloat16 does)."""
    nan = a.isnan()
    if not torch.equal(nan, b.isnan()):
        return False
    view = torch.int16 if a.element_size() == 2 else torch.int32
    return torch.equal(a[~nan].view(view), b[~nan].view(view))


def _adamw_span(mode: str, n: int, device: str, seed: int = 0) -> dict[str, torch.Tensor | None]:
    """A span's tensors for adamw_step: `mode` bf16, mixed (bf16 grad) or mixed-fp32grad. The values span
    what a step meets: zeros, denormals, large magnitudes, a NaN and infinities among random ones."""
    gen = torch.Generator().manual_seed(seed)
    state = torch.bfloat16 if mode == "bf16" else torch.float32
    grad = torch.randn(n, generator=gen) * 3
    param = torch.randn(n, generator=gen)
    exp_avg = torch.randn(n, generator=gen) * 1e-2
    exp_avg_sq = torch.rand(n, generator=gen) * 1e-3
    if n >= 11:
        grad[:6] = torch.tensor([0.0, -0.0, 1e-40, -3e38, float("nan"), float("inf")])
        param[6:9] = torch.tensor([0.0, 1e-39, -2e30])
        exp_avg_sq[9:11] = torch.tensor([0.0, 1e-41])
    return {"param": param.to(device, state), "exp_avg": exp_avg.to(device, state),
            "exp_avg_sq": exp_avg_sq.to(device, state),
            "grad": grad.to(device, torch.float32 if mode == "mixed-fp32grad" else torch.bfloat16),
            "param_out": torch.empty(n, dtype=torch.bfloat16, device=device) if mode != "bf16" else None}


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["bf16", "mixed", "mixed-fp32grad"])
def test_adamw_step_passes_opcheck_on_cuda(mode: str) -> None:
    t = _adamw_span(mode, 1000, "cuda")
    args = (t["param"], t["grad"], t["exp_avg"], t["exp_avg_sq"], t["param_out"], 1e-3, 0.9, 0.999, 1e-8, 0.01, 3,
            None, 0, 0, 0.37)
    torch.library.opcheck(torch.ops.offload_ext.adamw_step.default, args)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["bf16", "mixed", "mixed-fp32grad"])
@pytest.mark.parametrize("grad_scale", [1.0, 0.3718])
@pytest.mark.parametrize("weight_decay, step", [(0.0, 1), (0.1, 7)])
@pytest.mark.parametrize("n", [1, 1000, 300_001])
def test_adamw_step_on_cuda_gives_the_cpu_kernels_bits(mode: str, grad_scale: float, weight_decay: float, step: int,
                                                       n: int) -> None:
    # The device redo of a clipped step (offload_ext.engine.device_redo) stands in for the host's: it must be the
    # same arithmetic, not merely close.
    cpu, cuda = _adamw_span(mode, n, "cpu", seed=n), _adamw_span(mode, n, "cuda", seed=n)
    hyper = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=weight_decay, step=step,
                 grad_scale=grad_scale)
    for t in (cpu, cuda):
        ops.adamw_step(t["param"], t["grad"], t["exp_avg"], t["exp_avg_sq"], param_out=t["param_out"], **hyper)
    torch.cuda.synchronize()
    for name in ("param", "exp_avg", "exp_avg_sq", "param_out"):
        if cpu[name] is not None:
            assert _same_bits(cpu[name], cuda[name].cpu()), name


@pytest.mark.usefixtures("restore_kernel_settings")
@pytest.mark.parametrize("level", ops.SIMD_LEVELS)
@pytest.mark.parametrize("mode", ["bf16", "mixed", "mixed-fp32grad"])
def test_a_scaled_gradient_steps_as_its_product_rounded_to_its_dtype(mode: str, level: str) -> None:
    # torch.nn.utils.clip_grad_norm_ multiplies a .grad by the coefficient in place: bf16(grad * coef) for a bf16
    # gradient, the fp32 product for an fp32 one; 5001 elements: whole vectors and a tail at every width.
    if level not in ops.supported_simd_levels():
        pytest.skip(f"this CPU lacks {level}")
    offload_ext.set_simd_level(level)
    a, b = _adamw_span(mode, 5001, "cpu"), _adamw_span(mode, 5001, "cpu")
    hyper = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=4)
    ops.adamw_step(a["param"], a["grad"], a["exp_avg"], a["exp_avg_sq"], param_out=a["param_out"], grad_scale=0.3718,
                   **hyper)
    ops.adamw_step(b["param"], b["grad"].mul(0.3718), b["exp_avg"], b["exp_avg_sq"], param_out=b["param_out"],
                   **hyper)
    for name in ("param", "exp_avg", "exp_avg_sq", "param_out"):
        if a[name] is not None:
            assert _same_bits(a[name], b[name]), name


def test_adamw_step_refuses_a_scale_it_cannot_apply() -> None:
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
    b = _adamw_span("bf16", 20, "cpu")
    for bad in (float("inf"), -0.5):
        with pytest.raises(RuntimeError, match="expected a finite grad_scale >= 0"):
            ops.adamw_step(b["param"], b["grad"], b["exp_avg"], b["exp_avg_sq"], grad_scale=bad, **hyper)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("overwrite", [False, True])
def test_cross_entropy_rows_passes_opcheck(device: str, dtype: torch.dtype, overwrite: bool) -> None:
    # The logits require grad, so the checks include the registered autograd formula (with overwrite, a
    # backward that writes the gradient over the saved logits).
    logits, labels = _rows(device, dtype, requires_grad=True)
    torch.library.opcheck(torch.ops.offload_ext.cross_entropy_rows.default, (logits, labels, IGNORE, overwrite))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_rows_backward_passes_opcheck(device: str, dtype: torch.dtype) -> None:
    logits, labels = _rows(device, dtype)
    _, lse = ops.cross_entropy_rows(logits, labels, IGNORE)
    grad = torch.rand(logits.shape[0], device=device)
    # A separate grad_logits only: with grad_logits=logits (the overwriting backward's call) the op writes an
    # argument the schema marks read-only, which no schema can say; test_schema would rightly flag it.
    args = (logits, lse, labels, grad, IGNORE, torch.empty_like(logits))
    torch.library.opcheck(torch.ops.offload_ext.cross_entropy_rows_backward.default, args)


def test_fake_kernels_give_shapes_and_dtypes_without_running_the_kernels() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        logits = torch.empty(5, 11, dtype=torch.bfloat16)
        loss, lse = ops.cross_entropy_rows(logits, torch.zeros(5, dtype=torch.long))
        assert loss.shape == lse.shape == (5,) and loss.dtype == lse.dtype == torch.float32
        with pytest.raises(RuntimeError, match="one label per row"):
            ops.cross_entropy_rows(logits, torch.zeros(4, dtype=torch.long))
        p = torch.empty(8)
        with pytest.raises(RuntimeError, match="expected exp_avg to have as many elements as param"):
            ops.adamw_step(p, p, torch.empty(7), p, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                           step=1)


def test_cross_entropy_rows_compiles_with_fullgraph() -> None:
    logits, labels = _rows("cpu", torch.float32, requires_grad=True)
    ref = logits.detach().clone().requires_grad_()

    def loss_of(x: torch.Tensor) -> torch.Tensor:
        return ops.cross_entropy_rows(x, labels, IGNORE)[0].sum()

    compiled = torch.compile(loss_of, fullgraph=True, backend="aot_eager")
    compiled(logits).backward()
    loss_of(ref).backward()
    torch.testing.assert_close(logits.grad, ref.grad)


@pytest.mark.parametrize("device", DEVICES)
def test_sum_squares_passes_opcheck(device: str) -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1)).bfloat16().to(device)
    torch.library.opcheck(torch.ops.offload_ext.sum_squares.default, (x,))
    if device == "cpu":
        torch.library.opcheck(torch.ops.offload_ext.sum_squares.default, (x.float(),))


def _bf16_data(n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(n)
    # Magnitudes over 2^-20 .. 2^4, as gradients spread, and some exact zeros.
    x = torch.randn(n, generator=gen) * torch.pow(2.0, torch.randint(-20, 5, (n,), generator=gen).float())
    x[::97] = 0.0
    return x.bfloat16()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n, offset", [(0, 0), (1, 0), (7, 3), (4099, 0), (300_001, 1), (300_001, 5)])
def test_sum_squares_is_the_float64_sum_of_exact_squares(device: str, n: int, offset: int) -> None:
    # `offset` starts the data off the 16-byte boundary: the CUDA kernel's unaligned head and tail.
    x = _bf16_data(n + offset).to(device)[offset:]
    exact = math.fsum(v * v for v in x.double().cpu().tolist())  # each square of a bf16 is exact in float64
    got = ops.sum_squares(x)
    assert got.dtype == torch.float64 and got.shape == () and got.device == x.device
    # n - 1 float64 additions of non-negative terms, in any order: relative error at most
    # gamma(n - 1) = (n - 1) u / (1 - (n - 1) u), u = 2^-53 (Higham, Accuracy and Stability, 4.2).
    k = max(n - 1, 0) * 2.0 ** -53
    assert abs(got.item() - exact) <= k / (1 - k) * exact


@pytest.mark.parametrize("n, offset", [(0, 0), (1, 0), (7, 3), (4099, 0), (300_001, 1), (300_001, 5)])
def test_sum_squares_of_fp32_on_the_cpu_is_the_float64_sum_of_exact_squares(n: int, offset: int) -> None:
    gen = torch.Generator().manual_seed(n)
    x = (torch.randn(n + offset, generator=gen) * torch.pow(2.0, torch.randint(-20, 5, (n + offset,), generator=gen)))
    x = x[offset:]
    exact = math.fsum(v * v for v in x.double().tolist())  # an fp32 value squared is exact in float64 (48 bits)
    got = ops.sum_squares(x)
    assert got.dtype == torch.float64 and got.shape == ()
    k = max(n - 1, 0) * 2.0 ** -53  # as for bf16 above
    assert abs(got.item() - exact) <= k / (1 - k) * exact


@pytest.mark.parametrize("device", DEVICES)
def test_sum_squares_of_bf16_values_whose_squares_overflow_a_float_is_finite(device: str) -> None:
    # 3e19 squared is 9e38, past fp32's largest (3.4e38): a square taken in fp32 would make the norm infinite, and
    # clipping would refuse a step that the float64 rule clips
    x = torch.full((40,), 3e19, dtype=torch.bfloat16, device=device)
    assert ops.sum_squares(x).item() == math.fsum(v * v for v in x.double().cpu().tolist())


@pytest.mark.parametrize("device", DEVICES)
def test_sum_squares_gives_the_same_bits_every_run(device: str) -> None:
    x = _bf16_data(1 << 20).to(device)
    assert len({ops.sum_squares(x).item() for _ in range(5)}) == 1


def test_sum_squares_refuses_what_it_cannot_sum() -> None:
    with pytest.raises(RuntimeError, match="expected a bf16 or fp32 tensor, got Double"):
        ops.sum_squares(torch.ones(4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="expected a contiguous tensor"):
        ops.sum_squares(torch.ones(4, 4, dtype=torch.bfloat16).t())


@GPU
def test_sum_squares_on_cuda_refuses_fp32() -> None:
    with pytest.raises(RuntimeError, match="expected a bf16 tensor on this device, got Float"):
        ops.sum_squares(torch.ones(4, device="cuda"))


def _sr_inputs(n: int, device: str) -> tuple[torch.Tensor, ...]:
    """fp32 results as an AdamW step leaves them, with the values the rule treats apart: NaNs of both signs,
    infinities, the largest finite floats (which may round to an infinity), zeros of both signs, subnormals."""
    gen = torch.Generator().manual_seed(n)
    p = torch.randn(n, generator=gen) * torch.pow(2.0, torch.randint(-30, 30, (n,), generator=gen).float())
    m = torch.randn(n, generator=gen) * 1e-3
    v = torch.rand(n, generator=gen) * 1e-6
    special = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 3.4028235e38, -3.4028235e38,
                            0.0, -0.0, 1e-40, -1e-40])
    for t in (p, m, v):
        t[: min(n, len(special))] = special[: min(n, len(special))]
    return tuple(t.to(device) for t in (p, m, v))


@pytest.mark.parametrize("device", DEVICES)
def test_sr_round_bf16_passes_opcheck(device: str) -> None:
    p, m, v = _sr_inputs(1000, device)
    outs = tuple(torch.empty(1000, dtype=torch.bfloat16, device=device) for _ in range(3))
    torch.library.opcheck(torch.ops.offload_ext.sr_round_bf16.default, (p, m, v, *outs, 7, 2, 3, (1 << 33) + 5))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n, index", [(0, 0), (1, 0), (10, 3), (70_001, 0), (70_001, (1 << 32) - 70_001),
                                      (4099, 5 << 32)])
@pytest.mark.parametrize("seed, stream", [(0, 0), (1, 1 << 32), ((1 << 64) - 1, (1 << 63) + 3)])
def test_sr_round_bf16_stores_the_bits_of_the_torch_op_rule(device: str, n: int, index: int, seed: int,
                                                           stream: int) -> None:
    from offload_ext.optim import stochastic_rounding

    p, m, v = _sr_inputs(n, device)
    ours = [torch.full((n,), 7.0, dtype=torch.bfloat16, device=device) for _ in range(3)]
    ref = [torch.full((n,), 7.0, dtype=torch.bfloat16, device=device) for _ in range(3)]
    ops.sr_round_bf16(p, m, v, *ours, seed=seed, stream=stream, step=11, offset=index)
    stochastic_rounding.store_sr_torch(p, m, v, *ref, seed=seed, stream=stream, step=11, index=index)
    for a, b in zip(ours, ref):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_sr_round_bf16_refuses_a_span_across_a_key_block_and_mismatched_buffers() -> None:
    p, m, v = _sr_inputs(8, "cpu")
    outs = [torch.empty(8, dtype=torch.bfloat16) for _ in range(3)]
    with pytest.raises(RuntimeError, match="cross a multiple of 2\\^32; cut the span there"):
        ops.sr_round_bf16(p, m, v, *outs, seed=0, stream=0, step=1, offset=(1 << 32) - 4)
    with pytest.raises(RuntimeError, match="expected exp_avg_sq of dtype BFloat16, got Float"):
        ops.sr_round_bf16(p, m, v, outs[0], outs[1], v.clone(), seed=0, stream=0, step=1, offset=0)
    with pytest.raises(RuntimeError, match="expected param to have 8 elements"):
        ops.sr_round_bf16(p, m, v, outs[0][:4], outs[1], outs[2], seed=0, stream=0, step=1, offset=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["int8", "fp8", "nf4"])
def test_dequantize_base_passes_opcheck(device: str, fmt: str) -> None:
    from offload_ext.models.quantized_base import quantize_into, stored_elements
    w = (torch.randn(6, 128, generator=torch.Generator().manual_seed(3)) * 0.02).bfloat16()
    storage = torch.empty(stored_elements(fmt, w.shape), dtype=torch.bfloat16)
    quantize_into(fmt, w, storage)
    out = torch.empty(w.numel(), dtype=torch.bfloat16, device=device)
    torch.library.opcheck(torch.ops.offload_ext.dequantize_base.default, (storage.to(device), fmt, 6, 128, out))
