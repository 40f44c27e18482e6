"""CPUAdamW is a drop-in torch.optim.AdamW for CPU parameters: groups, schedules, master weights, state_dict."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import offload_ext


def _model(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(33, 64), nn.GELU(), nn.Linear(64, 17)).to(dtype)


def _groups(model: nn.Module) -> list[dict]:
    first, last = model[0], model[2]
    return [
        {"params": list(first.parameters()), "lr": 3e-3, "weight_decay": 0.1},
        {"params": list(last.parameters()), "lr": 1e-3, "weight_decay": 0.0},
    ]


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 1) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    losses = []
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        x = torch.randn(8, 33, generator=gen).to(dtype)
        loss = model(x).float().pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def test_matches_torch_adamw_with_param_groups_and_lr_schedule() -> None:
    ours_model, ref_model = _model(), _model()
    ours = offload_ext.CPUAdamW(_groups(ours_model))
    ref = torch.optim.AdamW(_groups(ref_model), fused=True)
    assert _train(ours_model, ours, 6) == pytest.approx(_train(ref_model, ref, 6), rel=1e-6)
    for a, b in zip(ours_model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_master_weights_keep_fp32_state_and_round_into_bf16_params() -> None:
    model = _model(torch.bfloat16)
    opt = offload_ext.CPUAdamW(model.parameters(), lr=1e-2, master_weights=True)
    ref_params = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    ref = torch.optim.AdamW(ref_params, lr=1e-2)
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        loss = model(torch.randn(8, 33, generator=gen).bfloat16()).float().pow(2).mean()
        opt.zero_grad()
        loss.backward()
        for p, r in zip(model.parameters(), ref_params):
            r.grad = p.grad.float()
        opt.step()
        ref.step()
    for p, r in zip(model.parameters(), ref_params):
        state = opt.state[p]
        assert state["master_param"].dtype == state["exp_avg"].dtype == torch.float32
        torch.testing.assert_close(state["master_param"], r.detach(), rtol=1e-6, atol=1e-7)
        assert torch.equal(p.detach(), state["master_param"].bfloat16())


@pytest.mark.parametrize("dtype, master, sr", [(torch.float32, False, False), (torch.bfloat16, False, False),
                                              (torch.bfloat16, True, False), (torch.bfloat16, False, True)])
def test_state_dict_round_trip_continues_identically(dtype, master, sr) -> None:
    # With stochastic rounding, the restored step count and the seed give the resumed steps the same bits.
    model = _model(dtype)
    opt = offload_ext.CPUAdamW(_groups(model), master_weights=master, stochastic_rounding=sr, sr_seed=3)
    _train(model, opt, 3)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    expected = _train(model, opt, 3, seed=9)

    restored = _model(dtype)
    restored.load_state_dict(saved_model)
    opt2 = offload_ext.CPUAdamW(_groups(restored), master_weights=master, stochastic_rounding=sr, sr_seed=3)
    opt2.load_state_dict(saved_opt)
    for p in restored.parameters():
        state_dtype = torch.float32 if master else dtype
        assert opt2.state[p]["exp_avg"].dtype == state_dtype
        assert set(opt2.state[p]) >= {"step", "exp_avg", "exp_avg_sq"}
    assert _train(restored, opt2, 3, seed=9) == expected
    for a, b in zip(model.parameters(), restored.parameters()):
        assert torch.equal(a, b)


def test_a_stochastic_rounding_state_is_refused_by_an_optimizer_of_another_seed() -> None:
    model = _model(torch.bfloat16)
    opt = offload_ext.CPUAdamW(_groups(model), stochastic_rounding=True, sr_seed=3)
    _train(model, opt, 1)
    saved = opt.state_dict()
    for make in (lambda: offload_ext.CPUAdamW(_groups(model), stochastic_rounding=True, sr_seed=4),
                 lambda: offload_ext.StochasticAdamW(_groups(model), seed=4)):
        with pytest.raises(ValueError, match="sr_seed=3 to continue"):
            make().load_state_dict(saved)
    offload_ext.StochasticAdamW(_groups(model), seed=3).load_state_dict(saved)  # the same seed continues


def test_loads_a_torch_adamw_state_dict() -> None:
    ref_model = _model()
    ref = torch.optim.AdamW(_groups(ref_model), fused=True)
    _train(ref_model, ref, 3)
    ours_model = _model()
    ours_model.load_state_dict(ref_model.state_dict())
    ours = offload_ext.CPUAdamW(_groups(ours_model))
    ours.load_state_dict(copy.deepcopy(ref.state_dict()))  # state_dict() aliases live tensors
    assert _train(ours_model, ours, 3, seed=5) == pytest.approx(_train(ref_model, ref, 3, seed=5), rel=1e-6)


def test_a_group_with_master_weights_and_stochastic_rounding_is_refused() -> None:
    with pytest.raises(ValueError, match="master_weights or stochastic_rounding, not both"):
        offload_ext.CPUAdamW(_model(torch.bfloat16).parameters(), master_weights=True, stochastic_rounding=True)


def test_rejects_parameters_the_kernel_cannot_step() -> None:
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        offload_ext.CPUAdamW([nn.Parameter(torch.zeros(4, dtype=torch.float16))])
    with pytest.raises(ValueError, match="contiguous"):
        offload_ext.CPUAdamW([nn.Parameter(torch.zeros(4, 4).t())])
    with pytest.raises(ValueError, match="must live on the CPU"):
        offload_ext.CPUAdamW([nn.Parameter(torch.zeros(4, device="meta"))])
