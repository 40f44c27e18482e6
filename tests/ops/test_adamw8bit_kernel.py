"""The native 8-bit AdamW kernel (torch.ops.offload_ext.adamw8bit_step) equals the torch-op reference of its rule
(offload_ext.optim.eight_bit) bit for bit: params, code indices and absmaxes, on every ISA this CPU has, with one
thread and two, for sizes no block or vector divides, to nearest and with stochastic rounding; and refuses bad
arguments in one line each."""
from __future__ import annotations

import pytest
import torch

import offload_ext
from offload_ext.optim import eight_bit

LRS = [1e-2, 5e-3, 2e-3, 1e-3]
HYPER = dict(beta1=0.9, beta2=0.999, eps=1e-8)
SIZES = [1, 255, 256, 257, 4099, 1 << 20]


def _levels() -> tuple[str, ...]:
    return offload_ext.ops.supported_simd_levels()


def _problem(n: int, grad_dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A bf16 param and one gradient per step, spread over seven decades within each block (as moments are)."""
    gen = torch.Generator().manual_seed(seed)
    param = torch.randn(n, generator=gen).bfloat16()
    grads = [(torch.randn(n, generator=gen) * 10 ** (torch.rand(n, generator=gen) * -7)).to(grad_dtype)
             for _ in LRS]
    return param, grads


def _run(step_fn, param: torch.Tensor, grads: list[torch.Tensor], wd: float, **kw) -> list[torch.Tensor]:
    """[param, exp_avg, exp_avg_sq, exp_avg_absmax, exp_avg_sq_absmax] after a step per gradient from zero moments
    (those of the dynamic maps, whose zero codes are also a crowded map's)."""
    state = [param.clone(), *eight_bit.zero_state(param.numel())]
    for step, (lr, g) in enumerate(zip(LRS, grads), start=1):
        step_fn(*state[:1], g, *state[1:], lr=lr, weight_decay=wd, step=step, **HYPER, **kw)
    return state


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers: NaNs compare too (both sides store the same NaN)."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()]) if t.is_floating_point() else t


def _assert_equal(ours: list[torch.Tensor], ref: list[torch.Tensor], where: str) -> None:
    names = ["param", "exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax"]
    for name, a, b in zip(names, ours, ref):
        assert torch.equal(_bits(a), _bits(b)), f"{name} differs ({where})"


@pytest.mark.usefixtures("restore_kernel_settings")
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("n", SIZES)
def test_kernel_equals_the_reference_bit_for_bit_on_every_isa_and_thread_count(n: int, wd: float,
                                                                               grad_dtype: torch.dtype) -> None:
    param, grads = _problem(n, grad_dtype, n)
    ref = _run(eight_bit.reference_adamw8bit_step, param, grads, wd)
    assert not torch.equal(ref[0], param)  # the steps moved it
    for level in _levels():
        offload_ext.set_simd_level(level)
        for threads in (1, 2):
            offload_ext.set_num_threads(threads)
            _assert_equal(_run(eight_bit.adamw8bit_step, param, grads, wd), ref, f"{level}, {threads} threads")


@pytest.mark.gpu
@pytest.mark.parametrize("n, grad_dtype, sr_seed, maps_on", [
    *((n, g, s, "cuda") for n in (257, 4099) for g in (torch.bfloat16, torch.float32) for s in (None, 7)),
    (4099, torch.bfloat16, 7, "cpu"),  # maps on the CPU: passed to the kernel by value, nothing read back
    ((1 << 24) + 5, torch.bfloat16, 7, "cpu"),  # more blocks than the grid's 65535: a thread block steps several
])
def test_the_cuda_kernel_equals_the_reference_bit_for_bit(n: int, grad_dtype: torch.dtype, sr_seed: int | None,
                                                          maps_on: str) -> None:
    param, grads = _problem(n, grad_dtype, n)
    kw = dict(sr_seed=sr_seed, sr_stream=3, sr_offset=(1 << 32) - 1000) if sr_seed is not None else {}
    ref = _run(eight_bit.reference_adamw8bit_step, param, grads, 0.1, **kw)
    cuda = [g.cuda() for g in grads]
    maps = tuple(m.to(maps_on) for m in (eight_bit.signed_dynamic_map(), eight_bit.unsigned_dynamic_map()))
    state = [param.cuda(), *(t.cuda() for t in eight_bit.zero_state(n))]
    for step, (lr, g) in enumerate(zip(LRS, cuda), start=1):
        eight_bit.adamw8bit_step(state[0], g, *state[1:], lr=lr, weight_decay=0.1, step=step, maps=maps, **HYPER,
                                 **kw)
    _assert_equal([t.cpu() for t in state], ref, f"cuda, {n} elements")


def _crowded(code: torch.Tensor) -> torch.Tensor:
    """The map with codes 201 .. 205 moved to just above code 200: five midpoints share one bucket of floats."""
    crowded = code.clone()
    crowded[201:206] = crowded[200] + torch.arange(1, 6) * 2.0**-20
    return crowded


@pytest.mark.usefixtures("restore_kernel_settings")
@pytest.mark.parametrize("n", [257, 100_003])
def test_a_map_the_bucket_table_cannot_serve_is_searched_to_the_same_bits(n: int) -> None:
    maps = (_crowded(eight_bit.signed_dynamic_map()), _crowded(eight_bit.unsigned_dynamic_map()))
    assert (maps[0][1:] > maps[0][:-1]).all() and (maps[1][1:] > maps[1][:-1]).all()
    param, grads = _problem(n, torch.float32, 3)
    ref = _run(eight_bit.reference_adamw8bit_step, param, grads, 0.1, maps=maps)
    assert not torch.equal(ref[1], _run(eight_bit.reference_adamw8bit_step, param, grads, 0.1)[1])
    for level in _levels():
        offload_ext.set_simd_level(level)
        _assert_equal(_run(eight_bit.adamw8bit_step, param, grads, 0.1, maps=maps), ref, level)


@pytest.mark.usefixtures("restore_kernel_settings")
def test_maps_of_another_structure_are_encoded_by_the_bucket_table_to_the_same_bits() -> None:
    # Even steps fit no decimal runs: the AVX-512 arithmetic encoder leaves them to the table.
    maps = (torch.linspace(-1, 1, 256), torch.linspace(0, 1, 256))
    param, grads = _problem(4099, torch.float32, 4)
    ref = _run(eight_bit.reference_adamw8bit_step, param, grads, 0.1, maps=maps)
    for level in _levels():
        offload_ext.set_simd_level(level)
        _assert_equal(_run(eight_bit.adamw8bit_step, param, grads, 0.1, maps=maps), ref, level)


_ROWS = 1 << 16  # blocks a call: 255 floats under test and a 1 each


@pytest.mark.usefixtures("restore_kernel_settings")
@pytest.mark.skipif("avx512" not in offload_ext.ops.supported_simd_levels(),
                    reason="the arithmetic encoder is AVX-512's")
@pytest.mark.parametrize("kind", ["signed", "unsigned"])
def test_the_arithmetic_encoder_gives_the_reference_index_of_every_float_in_minus_one_to_one(kind: str) -> None:
    # With beta1 = 0 and lr = 0 the step stores the encoding of the fp32 gradient itself (exp_avg = grad exactly),
    # and a 1 in each block makes its absmax 1 and its scale 1. Each map is exp_avg's in turn, so the unsigned one
    # sees negative x too. Every bit pattern of [-1, 1]: ties, zeros of both signs, subnormals, the anchors.
    code = {"signed": eight_bit.signed_dynamic_map, "unsigned": eight_bit.unsigned_dynamic_map}[kind]()
    offload_ext.set_simd_level("avx512")
    offload_ext.set_num_threads(2)
    grad = torch.ones(_ROWS, 256)
    param = torch.zeros(_ROWS * 256, dtype=torch.bfloat16)
    state = eight_bit.zero_state(_ROWS * 256)
    one = 0x3F800000  # the bits of 1.0
    for start in range(0, one + 1, _ROWS * 255):
        bits = torch.arange(start, min(start + _ROWS * 255, one + 1), dtype=torch.int32)
        for sign in (0, -(1 << 31)):
            x = (bits | sign).view(torch.float32)
            grad[:, :255] = torch.nn.functional.pad(x, (0, _ROWS * 255 - x.numel())).view(_ROWS, 255)
            offload_ext.ops.adamw8bit_step(param, grad.view(-1), *state, code, eight_bit.unsigned_dynamic_map(),
                                           lr=0.0, beta1=0.0, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
            assert bool((state[2] == 1).all())
            got = state[0].view(_ROWS, 256)[:, :255].reshape(-1)[: x.numel()]
            want = eight_bit.encode(x, code)
            if not torch.equal(got, want):
                wrong = (got != want).nonzero()[0].item()
                pytest.fail(f"{x[wrong].item()!r} (bits {int(bits[wrong]) | sign:#x}): index {got[wrong]}, "
                            f"the rule's {want[wrong]}")


@pytest.mark.usefixtures("restore_kernel_settings")
@pytest.mark.parametrize("offset", [0, 5, (1 << 32) - 777])
@pytest.mark.parametrize("n", [1, 257, 4099, 100_003])
def test_stochastic_rounding_equals_the_reference_on_every_isa_whatever_the_offset(n: int, offset: int) -> None:
    # An offset no block divides cuts blocks across the stream's multiples of 2^32, where the key changes.
    param, grads = _problem(n, torch.bfloat16, n + 1)
    sr = dict(sr_seed=5, sr_stream=3, sr_offset=offset)
    ref = _run(eight_bit.reference_adamw8bit_step, param, grads, 0.1, **sr)
    offload_ext.set_num_threads(2)
    for level in _levels():
        offload_ext.set_simd_level(level)
        _assert_equal(_run(eight_bit.adamw8bit_step, param, grads, 0.1, **sr), ref, level)


def test_stochastic_rounding_stores_other_params_than_round_to_nearest_and_the_same_moments() -> None:
    param, grads = _problem(4099, torch.bfloat16, 2)
    nearest = _run(eight_bit.adamw8bit_step, param, grads, 0.0)
    stochastic = _run(eight_bit.adamw8bit_step, param, grads, 0.0, sr_seed=1)
    assert (nearest[0] != stochastic[0]).float().mean().item() > 0.1
    # the moments never read the param: they are the same whichever way it rounds
    _assert_equal(stochastic[1:], nearest[1:], "moments")


@pytest.mark.usefixtures("restore_kernel_settings")
def test_a_moment_on_a_midpoint_takes_the_lower_code_on_every_isa() -> None:
    # beta1 = 0 makes exp_avg the fp32 gradient exactly, and a 1 in the block makes its absmax 1: each midpoint
    # is encoded as itself, a tie, and the float above it as the code above.
    mid = eight_bit.midpoints(eight_bit.signed_dynamic_map())
    grad = torch.cat([mid, torch.ones(1), mid.nextafter(torch.tensor(2.0)), torch.ones(1)])
    want = torch.cat([torch.arange(255), torch.tensor([255]), torch.arange(1, 256), torch.tensor([255])])
    for level in _levels():
        offload_ext.set_simd_level(level)
        param, (exp_avg, exp_avg_sq, m_absmax, v_absmax) = torch.zeros(512).bfloat16(), eight_bit.zero_state(512)
        eight_bit.adamw8bit_step(param, grad, exp_avg, exp_avg_sq, m_absmax, v_absmax, lr=0.0, beta1=0.0, beta2=0.999,
                                 eps=1e-8, weight_decay=0.0, step=1)
        assert torch.equal(exp_avg.long(), want), level
        assert m_absmax.tolist() == [1.0, 1.0]


@pytest.mark.usefixtures("restore_kernel_settings")
def test_a_nan_gradient_poisons_its_block_alone_as_the_reference_says() -> None:
    param, grads = _problem(1000, torch.float32, 0)
    grads[1][300] = float("nan")
    ref = _run(eight_bit.reference_adamw8bit_step, param, grads, 0.0)
    assert ref[3].isnan().tolist() == [False, True, False, False]
    for level in _levels():
        offload_ext.set_simd_level(level)
        _assert_equal(_run(eight_bit.adamw8bit_step, param, grads, 0.0), ref, level)


def _args(n: int = 300) -> dict[str, torch.Tensor]:
    exp_avg, exp_avg_sq, m_absmax, v_absmax = eight_bit.zero_state(n)
    return dict(param=torch.zeros(n, dtype=torch.bfloat16), grad=torch.zeros(n), exp_avg=exp_avg,
                exp_avg_sq=exp_avg_sq, exp_avg_absmax=m_absmax, exp_avg_sq_absmax=v_absmax,
                exp_avg_code=eight_bit.signed_dynamic_map(), exp_avg_sq_code=eight_bit.unsigned_dynamic_map())


def _step(step: int = 1, **changes: torch.Tensor) -> None:
    args = {**_args(), **changes}
    offload_ext.ops.adamw8bit_step(*args.values(), lr=1e-3, weight_decay=0.0, step=step, **HYPER)


@pytest.mark.parametrize("changes, pattern", [
    (dict(param=torch.zeros(300)), r"param of dtype BFloat16 \(bf16-8bit steps bf16 params\), got Float"),
    (dict(grad=torch.zeros(300, dtype=torch.float16)), "grad of dtype bfloat16 or float32, got Half"),
    (dict(exp_avg=torch.zeros(300, dtype=torch.bfloat16)), "exp_avg of dtype Byte, got BFloat16"),
    (dict(exp_avg_sq_absmax=torch.zeros(2, dtype=torch.float64)), "exp_avg_sq_absmax of dtype Float"),
    (dict(exp_avg_code=torch.zeros(256, dtype=torch.float64)), "exp_avg_code of dtype Float"),
])
def test_wrong_dtypes_are_refused_naming_the_argument(changes, pattern) -> None:
    with pytest.raises(RuntimeError, match=pattern):
        _step(**changes)


@pytest.mark.parametrize("changes, pattern", [
    (dict(grad=torch.zeros(299)), "grad to have 300 elements like param, got 299"),
    (dict(exp_avg_sq=torch.zeros(301, dtype=torch.uint8)), "exp_avg_sq to have 300 elements like param, got 301"),
    (dict(exp_avg_absmax=torch.zeros(3)), r"exp_avg_absmax to have 2 elements \(one a block of 256\), got 3"),
    (dict(exp_avg_sq_code=torch.zeros(255)), r"exp_avg_sq_code to have 256 elements \(the map's codes\), got 255"),
])
def test_mismatched_sizes_are_refused(changes, pattern) -> None:
    with pytest.raises(RuntimeError, match=pattern):
        _step(**changes)


def test_non_contiguous_tensors_are_refused_with_the_fix() -> None:
    with pytest.raises(RuntimeError, match=r"exp_avg to be contiguous.*\.contiguous\(\)"):
        _step(exp_avg=torch.zeros(600, dtype=torch.uint8)[::2])


def test_a_map_out_of_order_or_not_finite_and_bad_hyperparameters_are_refused() -> None:
    with pytest.raises(RuntimeError, match="exp_avg_code strictly increasing, but code 0 is not below code 1"):
        _step(exp_avg_code=eight_bit.signed_dynamic_map().flip(0))
    with pytest.raises(RuntimeError, match="exp_avg_sq_code finite, but code 255 is inf"):
        _step(exp_avg_sq_code=torch.cat([eight_bit.unsigned_dynamic_map()[:255], torch.tensor([float("inf")])]))
    with pytest.raises(RuntimeError, match="adamw8bit_step: expected step >= 1"):
        _step(step=0)
    with pytest.raises(RuntimeError, match="sr_offset >= 0"):
        offload_ext.ops.adamw8bit_step(*_args().values(), lr=1e-3, weight_decay=0.0, step=1, sr_seed=1, sr_offset=-1,
                                       **HYPER)
