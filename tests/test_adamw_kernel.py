"""The native AdamW kernel equals torch.optim.AdamW in every precision mode, size, ISA and thread count."""
from __future__ import annotations

import pytest
import torch

import offload_ext
from conftest import bf16_ulp_distance

SIZES = [1, 2, 3, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 1023, 1024, 4097,
         65535, 65537, 131073, 1_000_003]
LRS = [1e-2, 5e-3, 2e-3, 1e-3]  # a changing lr: the kernel takes it per call
BETAS = (0.9, 0.999)
EPS = 1e-8


def _torch_adamw(p: torch.Tensor, grads: list[torch.Tensor], wd: float, fused: bool) -> tuple[torch.Tensor, dict]:
    ref = p.clone().requires_grad_()
    opt = torch.optim.AdamW([ref], lr=LRS[0], betas=BETAS, eps=EPS, weight_decay=wd, fused=fused)
    for lr, g in zip(LRS, grads):
        opt.param_groups[0]["lr"] = lr
        ref.grad = g.clone()
        opt.step()
    return ref.detach(), opt.state[ref]


def _ours(param, grads, exp_avg, exp_avg_sq, wd, param_out=None) -> None:
    for step, (lr, g) in enumerate(zip(LRS, grads), start=1):
        offload_ext.adamw_step(param, g, exp_avg, exp_avg_sq, lr=lr, beta1=BETAS[0], beta2=BETAS[1],
                               eps=EPS, weight_decay=wd, step=step, param_out=param_out)


def _assert_close_fp32(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Within 1e-6 relative: norm-wise, and no element off by more than 1e-6 of the largest."""
    ours, ref = ours.double(), ref.double()
    scale = ref.abs().max().clamp_min(1e-30)
    assert ((ours - ref).norm() / ref.norm().clamp_min(1e-30)).item() <= 1e-6
    assert ((ours - ref).abs().max() / scale).item() <= 1e-6


@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("n", SIZES)
def test_fp32_mode_matches_torch_adamw(n: int, wd: float) -> None:
    gen = torch.Generator().manual_seed(n)
    p = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen) for _ in LRS]
    ref, state = _torch_adamw(p, grads, wd, fused=False)
    param, m, v = p.clone(), torch.zeros(n), torch.zeros(n)
    _ours(param, grads, m, v, wd)
    _assert_close_fp32(param, ref)
    _assert_close_fp32(m, state["exp_avg"])
    _assert_close_fp32(v, state["exp_avg_sq"])


@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("n", SIZES)
def test_bf16_mode_within_one_ulp_of_torch_fused(n: int, wd: float) -> None:
    gen = torch.Generator().manual_seed(n + 1)
    p = torch.randn(n, generator=gen).bfloat16()
    grads = [torch.randn(n, generator=gen).bfloat16() for _ in LRS]
    ref, state = _torch_adamw(p, grads, wd, fused=True)
    param = p.clone()
    m, v = torch.zeros_like(param), torch.zeros_like(param)
    _ours(param, grads, m, v, wd)
    assert bf16_ulp_distance(param, ref).max().item() <= 1
    assert bf16_ulp_distance(m, state["exp_avg"]).max().item() <= 1
    assert bf16_ulp_distance(v, state["exp_avg_sq"]).max().item() <= 1


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("n", SIZES)
def test_mixed_mode_matches_fp32_adamw_and_writes_rounded_param(n: int, wd: float, grad_dtype) -> None:
    gen = torch.Generator().manual_seed(n + 2)
    p = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen).to(grad_dtype) for _ in LRS]
    ref, state = _torch_adamw(p, [g.float() for g in grads], wd, fused=False)
    master, m, v = p.clone(), torch.zeros(n), torch.zeros(n)
    out = torch.full((n,), float("nan"), dtype=torch.bfloat16)  # poisoned: every element must be written
    _ours(master, grads, m, v, wd, param_out=out)
    _assert_close_fp32(master, ref)
    _assert_close_fp32(m, state["exp_avg"])
    _assert_close_fp32(v, state["exp_avg_sq"])
    assert torch.equal(out, master.bfloat16())


def _run_modes(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    results = []
    for dtype in (torch.bfloat16, torch.float32):
        p = torch.randn(n, generator=gen).to(dtype)
        grads = [torch.randn(n, generator=gen).to(dtype) for _ in LRS]
        m, v = torch.zeros_like(p), torch.zeros_like(p)
        out = torch.empty(n, dtype=torch.bfloat16) if dtype == torch.float32 else None
        _ours(p, grads, m, v, 0.1, param_out=out)
        results += [p, m, v] + ([out] if out is not None else [])
    return results


@pytest.mark.usefixtures("restore_kernel_settings")
def test_result_is_identical_with_one_thread_and_many() -> None:
    n = 3_000_017  # large enough to be split into many chunks
    offload_ext.set_num_threads(1)
    single = _run_modes(n)
    offload_ext.set_num_threads(6)
    assert offload_ext.get_num_threads() == 6
    many = _run_modes(n)
    offload_ext.set_num_threads(3, pin=True)
    pinned = _run_modes(n)
    for a, b, c in zip(single, many, pinned):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.usefixtures("restore_kernel_settings")
def test_every_simd_level_gives_identical_results() -> None:
    levels = ["scalar", "avx2", "avx512"]
    supported = levels[: levels.index(offload_ext.supported_simd_level()) + 1]
    results = []
    for level in supported:
        offload_ext.set_simd_level(level)
        results.append(_run_modes(100_003))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


@pytest.mark.usefixtures("restore_kernel_settings")
def test_memory_tuning_never_changes_results() -> None:
    native = offload_ext.ops.native()
    native.set_memory_tuning(0, False)
    plain = _run_modes(100_003)
    native.set_memory_tuning(256, True)
    tuned = _run_modes(100_003)
    for a, b in zip(plain, tuned):
        assert torch.equal(a, b)


def test_unaligned_param_out_is_written_exactly() -> None:
    n = 70_001
    master = torch.randn(n)
    g = torch.randn(n).bfloat16()
    m, v = torch.zeros(n), torch.zeros(n)
    backing = torch.full((n + 1,), float("nan"), dtype=torch.bfloat16)
    out = backing[1:]  # 2 bytes off the allocation's alignment: no non-temporal stores possible
    offload_ext.adamw_step(master, g, m, v, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                           step=1, param_out=out)
    assert torch.equal(out, master.bfloat16())


def test_unsupported_simd_level_is_refused(restore_kernel_settings) -> None:
    with pytest.raises(ValueError, match="one of scalar, avx2, avx512"):
        offload_ext.set_simd_level("sse9")


def _args(n=16, dtype=torch.float32):
    return [torch.zeros(n, dtype=dtype) for _ in range(4)]


def _step(p, g, m, v, **kw):
    params = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
    params.update(kw)
    offload_ext.adamw_step(p, g, m, v, **params)


def test_non_contiguous_input_is_rejected_with_the_fix() -> None:
    p, g, m, v = _args(32)
    with pytest.raises(RuntimeError, match=r"grad to be contiguous.*\.contiguous\(\)"):
        _step(p[:16], g[::2], m[:16], v[:16])


def test_mismatched_sizes_are_rejected() -> None:
    p, g, m, v = _args(16)
    with pytest.raises(RuntimeError, match="exp_avg_sq to have 16 elements like param, got 15"):
        _step(p, g, m, v[:15])


@pytest.mark.parametrize(
    "dtypes, pattern",
    [
        ((torch.float16,) * 4, "param of dtype bfloat16 .* or float32"),
        ((torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16), "bf16 .* exp_avg of dtype BFloat16"),
        ((torch.float32, torch.float16, torch.float32, torch.float32), "grad of dtype float32 or bfloat16"),
        ((torch.float32, torch.float32, torch.bfloat16, torch.float32), "exp_avg of dtype Float"),
    ],
)
def test_wrong_dtypes_are_rejected(dtypes, pattern) -> None:
    tensors = [torch.zeros(8, dtype=d) for d in dtypes]
    with pytest.raises(RuntimeError, match=pattern):
        _step(*tensors)


def test_param_out_must_be_bf16_and_only_for_fp32_params() -> None:
    p, g, m, v = _args(8)
    with pytest.raises(RuntimeError, match="param_out of dtype BFloat16"):
        _step(p, g, m, v, param_out=torch.zeros(8))
    pb, gb, mb, vb = _args(8, torch.bfloat16)
    with pytest.raises(RuntimeError, match="only for fp32 master params"):
        _step(pb, gb, mb, vb, param_out=torch.zeros(8, dtype=torch.bfloat16))


@pytest.mark.parametrize("kw, pattern", [(dict(step=0), "step >= 1"), (dict(beta2=1.0), "beta2 < 1"),
                                         (dict(lr=-1.0), "lr >= 0")])
def test_bad_hyperparameters_are_rejected(kw, pattern) -> None:
    with pytest.raises(RuntimeError, match=pattern):
        _step(*_args(8), **kw)
