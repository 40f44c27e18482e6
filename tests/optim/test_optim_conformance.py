"""CPUAdamW behaves as torch.optim.AdamW does where a user's code relies on it: copies, old state dicts,
AdamW's own keywords, and refusals that leave nothing half done."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch

from offload_ext import CPUAdamW


def _params(seed: int = 0, n: int = 3) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(64, generator=g)) for _ in range(n)]


def _set_grads(params: list[torch.nn.Parameter], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def _run(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: range) -> list[torch.Tensor]:
    for k in steps:
        _set_grads(params, 100 + k)
        opt.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("duplicate", [copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))],
                         ids=["deepcopy", "pickle"])
def test_a_copied_optimizer_keeps_its_settings_and_steps_like_the_original(duplicate) -> None:
    params = _params()
    opt = CPUAdamW(params, lr=1e-2, max_grad_norm=0.5, sr_seed=7, overlap=True)
    _run(opt, params, range(2))
    twin = duplicate(opt)
    twin_params = [p for group in twin.param_groups for p in group["params"]]
    assert (twin.sr_seed, twin.max_grad_norm, twin.overlap is not None) == (7, 0.5, True)
    assert twin.last_grad_norm == opt.last_grad_norm and twin.last_clip_action == opt.last_clip_action
    expected = _run(opt, params, range(2, 4))
    got = _run(twin, twin_params, range(2, 4))
    for a, b in zip(expected, got):
        assert torch.equal(a, b)


def test_a_state_dict_whose_step_is_a_plain_number_loads_and_continues_exactly() -> None:
    params = _params()
    opt = CPUAdamW(params, lr=1e-2)
    _run(opt, params, range(2))
    saved = copy.deepcopy(opt.state_dict())
    for state in saved["state"].values():
        state["step"] = int(state["step"].item())  # as older checkpoints keep it
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = CPUAdamW(resumed_params, lr=1e-2)
    resumed.load_state_dict(saved)
    for a, b in zip(_run(opt, params, range(2, 4)), _run(resumed, resumed_params, range(2, 4))):
        assert torch.equal(a, b)


def test_a_tensor_lr_must_have_one_element_and_then_steps_like_the_float() -> None:
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
        CPUAdamW(_params(), lr=torch.tensor([0.01, 0.01]))
    a, b = _params(), _params()
    got = _run(CPUAdamW(a, lr=torch.tensor(0.01)), a, range(2))
    for x, y in zip(got, _run(CPUAdamW(b, lr=0.01), b, range(2))):
        assert torch.equal(x, y)


@pytest.mark.parametrize("rule", ["maximize", "amsgrad"])
def test_a_state_saved_by_an_adamw_with_another_rule_is_refused(rule: str) -> None:
    params = _params()
    adamw = torch.optim.AdamW(params, lr=1e-2, **{rule: True})
    _run(adamw, params, range(1))
    opt = CPUAdamW(params, lr=1e-2)
    with pytest.raises(ValueError, match=f"{rule}=True, which CPUAdamW does not implement"):
        opt.load_state_dict(adamw.state_dict())
    assert all(not s for s in opt.state.values())


def test_a_state_saved_by_torchs_adamw_with_its_defaults_loads() -> None:
    params = _params()
    adamw = torch.optim.AdamW(params, lr=1e-2)
    _run(adamw, params, range(1))
    opt = CPUAdamW(params, lr=1e-2)
    opt.load_state_dict(adamw.state_dict())
    _run(opt, params, range(1, 2))
    assert all(int(opt.state[p]["step"]) == 2 for p in params)


def test_a_sparse_gradient_is_refused_before_any_parameter_is_stepped() -> None:
    params = _params()
    before = [p.detach().clone() for p in params]
    opt = CPUAdamW(params, lr=1e-2)
    _set_grads(params, 0)
    params[-1].grad = params[-1].grad.to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    for p, b in zip(params, before):
        assert torch.equal(p.detach(), b)


def test_adamws_own_keywords_at_their_defaults_are_accepted_and_others_refused_by_name() -> None:
    CPUAdamW(_params(), amsgrad=False, maximize=False, foreach=None, fused=True, capturable=False,
             differentiable=False)
    with pytest.raises(ValueError, match="amsgrad=True is not supported"):
        CPUAdamW(_params(), amsgrad=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'nesterov'"):
        CPUAdamW(_params(), nesterov=True)
