"""The native AdamW kernel equals torch.optim.AdamW in every precision mode, size, ISA and thread count; with
stochastic rounding ("bf16-sr") it equals the torch-op reference bit for bit, on any slicing of its stream."""
from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
import torch

import offload_ext
from conftest import bf16_ulp_distance
from offload_ext.optim import stochastic_rounding

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


def _ours(param, grads, exp_avg, exp_avg_sq, wd, param_out=None, **sr) -> None:
    for step, (lr, g) in enumerate(zip(LRS, grads), start=1):
        offload_ext.adamw_step(param, g, exp_avg, exp_avg_sq, lr=lr, beta1=BETAS[0], beta2=BETAS[1],
                               eps=EPS, weight_decay=wd, step=step, param_out=param_out, **sr)


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
    for dtype, sr in ((torch.bfloat16, {}), (torch.bfloat16, dict(sr_seed=11, sr_stream=2)), (torch.float32, {})):
        p = torch.randn(n, generator=gen).to(dtype)
        grads = [torch.randn(n, generator=gen).to(dtype) for _ in LRS]
        m, v = torch.zeros_like(p), torch.zeros_like(p)
        out = torch.empty(n, dtype=torch.bfloat16) if dtype == torch.float32 else None
        _ours(p, grads, m, v, 0.1, param_out=out, **sr)
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
    results = []
    for level in offload_ext.ops.supported_simd_levels():
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
    for level in ("l1", "l2", "nta"):
        native.set_memory_tuning(256, True, level)
        assert native.memory_tuning() == (256, True, level)
        tuned = _run_modes(100_003)
        for a, b in zip(plain, tuned):
            assert torch.equal(a, b)


@pytest.mark.usefixtures("restore_kernel_settings")
def test_memory_tuning_refuses_an_unknown_prefetch_level_and_keeps_the_current_one() -> None:
    native = offload_ext.ops.native()
    native.set_memory_tuning(512, True, "l2")
    with pytest.raises(ValueError, match="prefetch level must be one of l1, l2, nta; got 'l3'"):
        native.set_memory_tuning(512, True, "l3")
    native.set_memory_tuning(1024, False)  # no level: the current one stays
    assert native.memory_tuning() == (1024, False, "l2")


def test_a_bad_prefetch_level_in_the_environment_raises_at_first_use_not_at_import() -> None:
    code = ("import offload_ext, offload_ext.ops\n"
            "try:\n    offload_ext.ops.native().memory_tuning()\nexcept ValueError as e:\n    print('raised:', e)")
    env = {**os.environ, "OFFLOAD_EXT_PREFETCH_LEVEL": "L2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "raised: prefetch level must be one of l1, l2, nta; got 'L2'" in out.stdout


# The reference: the rule in torch ops alone (adamw_step_sr's stores through the extension's op otherwise).
_torch_rule = functools.partial(stochastic_rounding.adamw_step_sr, native=False)


def _sr_run(n: int, step_fn, seed: int = 5, stream: int = 3, offset: int = 0, wd: float = 0.1,
            pieces: tuple[int, ...] = ()) -> list[torch.Tensor]:
    """bf16-sr steps over LRS by step_fn (the op or the reference); with `pieces`, the span is stepped in
    parts cut there, each with its offset in the stream."""
    gen = torch.Generator().manual_seed(n)
    p = torch.randn(n, generator=gen).bfloat16()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    cuts = [0, *pieces, n]
    for step, lr in enumerate(LRS, start=1):
        g = torch.randn(n, generator=gen).bfloat16()
        for b, e in zip(cuts, cuts[1:]):
            step_fn(p[b:e], g[b:e], m[b:e], v[b:e], lr=lr, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=wd,
                    step=step, sr_seed=seed, sr_stream=stream, sr_offset=offset + b)
    return [p, m, v]


@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("n", [1, 7, 16, 17, 33, 1023, 65537, 131073])
def test_bf16_sr_equals_the_torch_reference_bit_for_bit(n: int, wd: float) -> None:
    ours = _sr_run(n, offload_ext.adamw_step, wd=wd)
    ref = _sr_run(n, _torch_rule, wd=wd)
    for a, b in zip(ours, ref):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_bf16_sr_across_a_multiple_of_2_to_the_32_of_the_stream_equals_the_reference() -> None:
    # The keys change where index >> 32 does: the kernel cuts its span there, the reference too.
    start = (1 << 32) - 777
    ours = _sr_run(2000, offload_ext.adamw_step, offset=start)
    for a, b in zip(ours, _sr_run(2000, _torch_rule, offset=start)):
        assert torch.equal(a, b)
    assert not torch.equal(ours[0], _sr_run(2000, offload_ext.adamw_step, offset=start + (1 << 32))[0])


def test_bf16_sr_in_pieces_with_their_stream_offsets_equals_one_pass() -> None:
    # Slices of an engine unit and its group ranges step this way: the bits follow the index, not the cut.
    whole = _sr_run(50_001, offload_ext.adamw_step)
    for a, b in zip(whole, _sr_run(50_001, offload_ext.adamw_step, pieces=(5, 1000, 1001, 40_000))):
        assert torch.equal(a, b)


def test_bf16_sr_depends_on_seed_stream_and_step_only() -> None:
    first = _sr_run(10_000, offload_ext.adamw_step)
    again = _sr_run(10_000, offload_ext.adamw_step)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    for other in (_sr_run(10_000, offload_ext.adamw_step, seed=6), _sr_run(10_000, offload_ext.adamw_step, stream=4)):
        assert not torch.equal(first[0], other[0]) and not torch.equal(first[2], other[2])
        assert torch.equal(first[1], other[1])  # exp_avg rounds to nearest: the same in every stream
    key = stochastic_rounding.stream_key
    assert key(5, 3, 1, 0) != key(5, 3, 2, 0)
    assert len({int(w) for w in stochastic_rounding.random_words(5, 3, 1, 0, 1 << 16)}) > 0.99 * (1 << 16)


def test_bf16_sr_is_unbiased_where_round_to_nearest_is_not() -> None:
    # One step from p = 1 with a gradient of 1 everywhere: fp32 gives p = 1 - lr (Adam's first step is lr
    # times the gradient's sign) and exp_avg_sq = 1e-3, each between two bf16 neighbours. Rounded to
    # nearest, every element takes the nearer one; stochastically, each takes the upper one with the
    # probability of its distance, so the mean of n elements lies within the binomial spread of the fp32
    # value: a Bernoulli choice between neighbours u apart has standard deviation at most u / 2, the mean
    # of n independent ones at most u / (2 sqrt(n)); 6 of those bound it (a chance of ~2e-9 per check).
    n, lr = 1 << 20, 1e-3
    exact = [torch.ones(n), torch.ones(n), torch.zeros(n), torch.zeros(n)]
    offload_ext.adamw_step(exact[0], exact[1], exact[2], exact[3], lr=lr, beta1=0.9, beta2=0.999, eps=1e-8,
                           weight_decay=0.0, step=1)
    for sr in ({}, dict(sr_seed=1)):
        p, g = torch.ones(n, dtype=torch.bfloat16), torch.ones(n, dtype=torch.bfloat16)
        m, v = torch.zeros_like(p), torch.zeros_like(p)
        offload_ext.adamw_step(p, g, m, v, lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1, **sr)
        for got, fp32 in ((p, exact[0]), (v, exact[3])):
            x = fp32[0].item()
            truncated = fp32[:1].view(torch.int32) & -65536  # the bf16 neighbours of a positive x
            below, above = truncated.view(torch.float32).item(), (truncated + 65536).view(torch.float32).item()
            assert below < x < above
            assert set(got.float().unique().tolist()) <= {below, above}
            error = abs(got.double().mean().item() - x)
            bound = 6 * (above - below) / (2 * n**0.5)
            assert (error <= bound) if sr else (error > 10 * bound)


def test_bf16_sr_keeps_nan_as_round_to_nearest_does_and_infinities_infinite() -> None:
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0, -0.0] * 7)
    p = specials.bfloat16()
    g, m, v = torch.zeros_like(p), torch.zeros_like(p), torch.zeros_like(p)
    offload_ext.adamw_step(p, g, m, v, lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1, sr_seed=0)
    assert p.view(torch.int16).tolist() == [0x7FC0, 0x7F80, 0xFF80 - 0x10000, 0x3F80, 0x8000 - 0x10000] * 7
    # A NaN gradient makes every state NaN: the reference stores each as the kernel does.
    results = []
    for step_fn in (offload_ext.adamw_step, _torch_rule):
        p, m, v = torch.ones(35).bfloat16(), torch.zeros(35).bfloat16(), torch.zeros(35).bfloat16()
        step_fn(p, specials.roll(3).bfloat16(), m, v, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                step=1, sr_seed=0, sr_stream=0)
        results.append([t.view(torch.int16) for t in (p, m, v)])
    assert all(torch.equal(a, b) for a, b in zip(*results)) and results[0][1].eq(0x7FC0).sum() == 7
    bits = torch.tensor([0x3F800000, 0x3F80FFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0x7FC00001, 0xFFC00000]) \
        .to(torch.int32)  # 1, just under the next bf16 above 1, the largest finite floats, inf, two NaNs
    x = bits.view(torch.float32)
    rounded = stochastic_rounding.round_sr(x, torch.tensor([0xFFFF, 1, 1, 1, 0xFFFF, 0, 0]))
    assert rounded.view(torch.int16).tolist() == [0x3F80, 0x3F81, 0x7F80, 0xFF80 - 0x10000, 0x7F80, 0x7FC0, 0x7FC0]


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


def test_stochastic_rounding_is_refused_for_fp32_params_and_negative_offsets() -> None:
    with pytest.raises(RuntimeError, match="stochastic rounding .* is for bf16 params"):
        _step(*_args(8), sr_seed=0)
    with pytest.raises(RuntimeError, match="sr_offset >= 0"):
        _step(*_args(8, torch.bfloat16), sr_seed=0, sr_offset=-1)


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
