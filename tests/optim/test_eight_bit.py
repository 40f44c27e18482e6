"""bf16-8bit's rule in torch ops (offload_ext.optim.eight_bit): the dynamic maps, block-wise quantization to the
nearest code within its derived error bound, the step's first update being AdamW's exactly, and the correctly
rounded fma and sqrt its update is written with."""
from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from offload_ext.optim import eight_bit
from offload_ext.optim.stochastic_rounding import round_nearest

U = 2.0**-24  # fp32's unit roundoff
MAPS = {"signed": (eight_bit.signed_dynamic_map, -1.0), "unsigned": (eight_bit.unsigned_dynamic_map, 0.0)}


@pytest.mark.parametrize("kind", MAPS)
def test_each_dynamic_map_has_256_sorted_distinct_codes_in_its_range_including_0_and_1(kind: str) -> None:
    make, low = MAPS[kind]
    code = make()
    assert code.dtype == torch.float32 and code.numel() == 256
    assert bool((code[1:] > code[:-1]).all())  # sorted and distinct
    assert code.min().item() >= low and code.max().item() == 1.0
    assert 0.0 in code.tolist()
    assert (code < 0).any().item() == (kind == "signed")


def test_the_signed_map_is_symmetric_and_both_span_six_decades() -> None:
    signed, unsigned = eight_bit.signed_dynamic_map(), eight_bit.unsigned_dynamic_map()
    positive = signed[signed > 0]
    assert torch.equal(positive[:-1], -signed[signed < 0].flip(0))  # every code but 1 has its negative
    for code in (signed, unsigned):
        smallest = code[code > 0].min().item()
        assert 1e-7 < smallest < 1e-6


def _values(n: int, seed: int, signed: bool) -> torch.Tensor:
    """n values over seven decades within each block, as moments are; past 512 elements, a block all zero and one
    with a single value."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(max(n, 1024), generator=gen) * 10 ** (torch.rand(max(n, 1024), generator=gen) * -7)
    x[512:1024] = 0.0
    x[800] = 3e-3
    return (x if signed else x.abs())[:n]


def _largest_gap(code: torch.Tensor) -> float:
    return (code[1:] - code[:-1]).max().item()


@pytest.mark.parametrize("kind", MAPS)
@pytest.mark.parametrize("n", [1, 255, 257, 4099, 1 << 16])
def test_round_trip_error_is_within_half_the_largest_gap_of_its_blocks_absmax(kind: str, n: int) -> None:
    # x -> code[q] * absmax errs by half a gap of the normalized value, plus three fp32 roundings, each within U
    # of a value of at most absmax: x / absmax (two: the reciprocal, the product), the midpoint, the decode.
    code = MAPS[kind][0]()
    x = _values(n, n, kind == "signed")
    q, absmax = eight_bit.quantize_blockwise(x, code)
    assert q.dtype == torch.uint8 and q.numel() == n and absmax.numel() == eight_bit.num_blocks(n)
    back = eight_bit.dequantize_blockwise(q, absmax, code)
    bound = (_largest_gap(code) / 2 + 4 * U) * absmax.repeat_interleave(256)[:n].double()
    assert bool(((x.double() - back.double()).abs() <= bound).all())
    assert torch.equal(absmax, torch.stack([x[b:b + 256].abs().max() for b in range(0, n, 256)]))


@pytest.mark.parametrize("kind", MAPS)
def test_each_value_is_encoded_to_its_nearest_code(kind: str) -> None:
    code = MAPS[kind][0]()
    x = _values(1 << 14, 1, kind == "signed")
    q, absmax = eight_bit.quantize_blockwise(x, code)
    normalized = x.double() / absmax.repeat_interleave(256).double().clamp_min(1e-30)
    chosen = (normalized - code.double()[q.long()]).abs()
    nearest = (normalized[:, None] - code.double()[None, :]).abs().min(dim=1).values
    assert bool((chosen <= nearest + 4 * U).all())


def test_a_tie_goes_to_the_lower_code_and_a_nan_to_the_last() -> None:
    code = eight_bit.signed_dynamic_map()
    mid = eight_bit.midpoints(code)
    k = torch.arange(255)
    assert torch.equal(eight_bit.encode(mid, code).long(), k)
    assert torch.equal(eight_bit.encode(mid.nextafter(torch.tensor(2.0)), code).long(), k + 1)
    assert torch.equal(eight_bit.encode(code, code).long(), torch.arange(256))
    assert eight_bit.encode(torch.tensor([float("nan")]), code).item() == 255


def test_a_nan_makes_its_blocks_absmax_nan_and_leaves_the_others() -> None:
    x = torch.ones(600)
    x[300] = float("nan")
    q, absmax = eight_bit.quantize_blockwise(x, eight_bit.signed_dynamic_map())
    assert absmax.isnan().tolist() == [False, True, False]
    assert q[300].item() == 255


def test_zero_state_decodes_to_zero_moments() -> None:
    exp_avg, exp_avg_sq, m_absmax, v_absmax = eight_bit.zero_state(1000)
    assert m_absmax.numel() == v_absmax.numel() == 4
    assert bool((eight_bit.dequantize_blockwise(exp_avg, m_absmax, eight_bit.signed_dynamic_map()) == 0).all())
    assert bool((eight_bit.dequantize_blockwise(exp_avg_sq, v_absmax, eight_bit.unsigned_dynamic_map()) == 0).all())


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_a_first_step_from_zero_moments_moves_the_param_as_adamw_does(wd: float) -> None:
    # The moments start exactly zero, so step 1's update is fp32 AdamW's, rounded to bf16 once.
    gen = torch.Generator().manual_seed(0)
    param, grad = torch.randn(4099, generator=gen).bfloat16(), torch.randn(4099, generator=gen)
    master = param.float().requires_grad_()
    master.grad = grad.clone()
    torch.optim.AdamW([master], lr=1e-2, weight_decay=wd, fused=True).step()
    ours = param.clone()
    eight_bit.reference_adamw8bit_step(ours, grad, *eight_bit.zero_state(4099), lr=1e-2, beta1=0.9, beta2=0.999,
                                       eps=1e-8, weight_decay=wd, step=1)
    assert torch.equal(ours, round_nearest(master.detach()))


def test_sqrt_is_correctly_rounded() -> None:
    # math.sqrt is IEEE's correctly rounded float64 root, and rounding it to fp32 is too (53 >= 2 * 24 + 2 bits).
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(20_000, generator=gen) * 10 ** (torch.rand(20_000, generator=gen) * -60 + 20)
    x[:4] = torch.tensor([0.0, float("inf"), 1e-45, 3.4e38])
    want = torch.tensor([math.sqrt(v) for v in x.double().tolist()], dtype=torch.float64).float()
    assert torch.equal(eight_bit.sqrt(x), want)


def _nearest(r: float, exact: Fraction) -> bool:
    """Whether fp32 r is exact rounded to nearest fp32, ties to even."""
    t = torch.tensor([r])
    below, above = float(t.nextafter(torch.tensor(-math.inf))), float(t.nextafter(torch.tensor(math.inf)))
    d = abs(Fraction(r) - exact)
    even = int(t.view(torch.int32)) % 2 == 0
    return all(d < abs(Fraction(n) - exact) or (d == abs(Fraction(n) - exact) and even) for n in (below, above))


def test_fma_rounds_once_where_a_float64_sum_would_round_twice() -> None:
    # 1 + 2^-23 + 2^-24 - 2^-70: just under a midpoint between floats, exactly on it once summed in float64.
    a, b, c = torch.tensor([1 + 2**-23]), torch.tensor([2**-24 * (1 - 2**-23)]), torch.tensor([1 + 2**-23])
    assert (a.double() * b.double() + c.double()).float().item() == 1 + 2**-22
    assert eight_bit.fma(a, b, c).item() == 1 + 2**-23
    gen = torch.Generator().manual_seed(1)
    a, b, c = (torch.randn(2000, generator=gen) * 10 ** (torch.rand(2000, generator=gen) * 8 - 4) for _ in range(3))
    for x, y, z, r in zip(a.tolist(), b.tolist(), c.tolist(), eight_bit.fma(a, b, c).tolist()):
        assert _nearest(r, Fraction(x) * Fraction(y) + Fraction(z))


def test_the_maps_are_bitsandbytes_dynamic_maps_bit_for_bit() -> None:
    bnb = pytest.importorskip("bitsandbytes.functional")
    signed, unsigned = eight_bit.signed_dynamic_map(), eight_bit.unsigned_dynamic_map()
    assert torch.equal(signed, bnb.create_dynamic_map(signed=True).float().sort().values)
    assert torch.equal(unsigned, bnb.create_dynamic_map(signed=False).float().sort().values)
