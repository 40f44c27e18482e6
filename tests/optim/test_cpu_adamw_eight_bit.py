"""CPUAdamW(eight_bit=True): 8-bit moments by offload_ext.optim.eight_bit's rule, stepped exactly as its reference,
kept in their dtypes through a state_dict round trip, and exact under clipping with the steps taken in backward."""
from __future__ import annotations

import copy

import pytest
import torch

from offload_ext import CPUAdamW
from offload_ext.optim import eight_bit

HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8)


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g).bfloat16()) for shape in ((300,), (17, 33), (256,))]


def _grads(params: list[torch.nn.Parameter], step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).bfloat16()


@pytest.mark.parametrize("sr", [False, True])
def test_each_step_is_the_rules_reference_bit_for_bit(sr) -> None:
    params = _params()
    opt = CPUAdamW([{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}],
                   eight_bit=True, stochastic_rounding=sr, sr_seed=7, **HYPER)
    ref = [p.detach().clone() for p in params]
    states = [eight_bit.zero_state(p.numel()) for p in params]
    for step in range(1, 5):
        _grads(params, step)
        opt.step()
        for k, (p, r, s) in enumerate(zip(params, ref, states)):
            eight_bit.reference_adamw8bit_step(r.view(-1), p.grad.view(-1), *s, beta1=0.9, beta2=0.99, eps=1e-8,
                                               lr=1e-2, weight_decay=0.1 if k < 2 else 0.0, step=step,
                                               sr_seed=7 if sr else None, sr_stream=k)
            assert torch.equal(p.detach(), r), (step, k)
            assert all(torch.equal(a, b) for a, b in zip(
                (opt.state[p][key] for key in ("exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax")), s))
    assert opt.state[params[0]]["exp_avg"].dtype == torch.uint8


def test_a_state_dict_round_trip_keeps_the_codes_and_continues_exactly() -> None:
    params, twin = _params(), _params()
    opt = CPUAdamW(params, eight_bit=True, **HYPER)
    other = CPUAdamW(twin, eight_bit=True, **HYPER)
    for step in range(1, 3):
        _grads(params, step)
        _grads(twin, step)
        opt.step()
        other.step()
    fresh = _params()
    for f, t in zip(fresh, twin):
        f.data.copy_(t.data)
    loaded = CPUAdamW(fresh, eight_bit=True, **HYPER)
    loaded.load_state_dict(copy.deepcopy(other.state_dict()))
    state = loaded.state[fresh[0]]
    assert state["exp_avg"].dtype == torch.uint8 and state["exp_avg_absmax"].dtype == torch.float32
    for step in range(3, 5):
        _grads(params, step)
        _grads(fresh, step)
        opt.step()
        loaded.step()
    assert all(torch.equal(a, b) for a, b in zip(params, fresh))


def test_a_full_width_state_from_torchs_adamw_is_refused_by_name() -> None:
    params = _params()
    full = torch.optim.AdamW(params, **HYPER)  # its groups carry no eight_bit: the group's own choice stands
    _grads(params, 1)
    full.step()
    with pytest.raises(ValueError, match="the state has full-width moments and this group eight_bit=True"):
        CPUAdamW(_params(), eight_bit=True, **HYPER).load_state_dict(full.state_dict())


def test_clipping_with_steps_in_backward_redoes_the_8_bit_steps_exactly() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8)).bfloat16()
    twin = copy.deepcopy(model)
    overlapped = CPUAdamW(model.parameters(), eight_bit=True, overlap=True, max_grad_norm=0.05, **HYPER)
    after = CPUAdamW(twin.parameters(), eight_bit=True, max_grad_norm=0.05, **HYPER)
    for step in range(3):
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(step)).bfloat16()
        for m, opt in ((model, overlapped), (twin, after)):
            m(x).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        assert overlapped.last_clip_action == "redone" and after.last_clip_action == "clipped"
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


def test_eight_bit_is_refused_with_master_weights_and_for_fp32_parameters() -> None:
    with pytest.raises(ValueError, match="a group takes master_weights or eight_bit, not both"):
        CPUAdamW(_params(), eight_bit=True, master_weights=True)
    with pytest.raises(ValueError, match=r"eight_bit steps plain bf16 parameters \(got torch.float32\)"):
        CPUAdamW([torch.nn.Parameter(torch.zeros(4))], eight_bit=True)
