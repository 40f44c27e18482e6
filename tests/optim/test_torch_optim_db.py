"""CPUAdamW against PyTorch's own description of AdamW (torch.testing's optim_db, what test_optim.py's generic tests
run): every configuration it lists steps exactly as torch's fused AdamW does or is refused by name, and every
construction error it lists for AdamW is raised by CPUAdamW too, with the same type."""
from __future__ import annotations

import copy

import pytest
import torch

from offload_ext import CPUAdamW

common_optimizers = pytest.importorskip("torch.testing._internal.common_optimizers")
ADAMW = next(o for o in common_optimizers.optim_db if o.optim_cls is torch.optim.AdamW)
INPUTS = ADAMW.optim_inputs_func(device="cpu")
ERRORS = [e for e in ADAMW.optim_error_inputs_func(device="cpu", dtype=torch.float32)
          if e.error_on == common_optimizers.OptimizerErrorEnum.CONSTRUCTION_ERROR]
REFUSED = {"maximize": "maximize", "amsgrad": "amsgrad"}  # rules the host kernel does not run: refused by name


def _params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(n, generator=g).to(dtype)) for n in (257, 64, 1000)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("optim_input", INPUTS, ids=[i.desc for i in INPUTS])
def test_each_adamw_configuration_steps_as_torchs_fused_adamw_or_is_refused_by_name(optim_input, dtype) -> None:
    kwargs = dict(optim_input.kwargs)
    refused = [name for name in REFUSED if kwargs.get(name)]
    ours, theirs = _params(dtype), _params(dtype)
    if refused:
        with pytest.raises((TypeError, ValueError), match=refused[0]):
            CPUAdamW(ours, **kwargs)
        return
    opt, ref = CPUAdamW(ours, **kwargs), torch.optim.AdamW(theirs, fused=True, **kwargs)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        grads = [torch.randn(p.shape, generator=g).to(dtype) for p in ours]
        for p, q, grad in zip(ours, theirs, grads):
            p.grad, q.grad = grad.clone(), grad.clone()
        opt.step()
        ref.step()
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)  # the same rule, the same rounding: every element


# torch refuses tensor hyperparameters with foreach=True because its foreach kernels cannot read them; the host kernel
# can, whatever foreach says (foreach only names torch's implementation): accepted, and stepping as fused AdamW does.
IMPLEMENTATION_ONLY = "not supported for capturable=False and foreach=True"


@pytest.mark.parametrize("error_input", ERRORS, ids=[e.error_regex[:40] for e in ERRORS])
def test_each_construction_error_of_adamw_is_raised_by_cpu_adamw_too(error_input) -> None:
    given = error_input.optimizer_error_input
    params = copy.deepcopy(given.params) if given.params is not None else _params(torch.float32)
    if IMPLEMENTATION_ONLY in error_input.error_regex:
        CPUAdamW(params, **given.kwargs)
        return
    check = pytest.warns if issubclass(error_input.error_type, Warning) else pytest.raises
    with check(error_input.error_type, match=error_input.error_regex):
        CPUAdamW(params, **given.kwargs)
