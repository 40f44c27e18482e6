"""bf16-sr where it matters: updates under half a bf16 ulp never move a round-to-nearest bf16 parameter, while
stochastic rounding moves it as far as an fp32 master moves, on average; and the native optimizer (CPUAdamW)
and the torch-op one (StochasticAdamW, what steps the device-kept parameters) agree bit for bit."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import offload_ext
from offload_ext import StochasticAdamW

N, STEPS, LR = 16384, 500, 1e-5
ULP = 2.0**-7  # of bf16 values in [1, 2)


def _drift(optimizer: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(start, end) of N weights in [1.25, 1.75] after STEPS AdamW steps at LR with positive gradients
    drawn in [0.5, 1.5): Adam's step is then about LR, far under half an ulp (2^-8) of the weights. The
    end is the fp32 master under "mixed"."""
    gen = torch.Generator().manual_seed(0)
    start = (1.25 + 0.5 * torch.rand(N, generator=gen)).bfloat16()
    p = nn.Parameter(start.clone())
    kw = dict(lr=LR, weight_decay=0.0)
    opt = {"bf16": lambda: offload_ext.CPUAdamW([p], **kw),
           "mixed": lambda: offload_ext.CPUAdamW([p], master_weights=True, **kw),
           "bf16-sr native": lambda: offload_ext.CPUAdamW([p], stochastic_rounding=True, sr_seed=1, **kw),
           "bf16-sr torch": lambda: StochasticAdamW([p], seed=1, **kw)}[optimizer]()
    for _ in range(STEPS):
        p.grad = (0.5 + torch.rand(N, generator=gen)).bfloat16()
        opt.step()
    end = opt.state[p]["master_param"] if optimizer == "mixed" else p.detach()
    return start.float(), end.float()


@pytest.mark.parametrize("optimizer", ["bf16-sr native", "bf16-sr torch"])
def test_updates_under_half_an_ulp_freeze_bf16_and_bf16_sr_moves_as_far_as_fp32_masters(optimizer: str) -> None:
    start, frozen = _drift("bf16")
    assert torch.equal(frozen, start)  # round to nearest: not one weight moved
    _, master = _drift("mixed")
    _, rounded = _drift(optimizer)
    moved = (start - master).double().mean().item()  # ~STEPS * LR: about 5e-3, well over half the ulp
    assert 0.9 * STEPS * LR < moved < 1.1 * STEPS * LR
    # Each step moves a bf16-sr weight down one ulp with the probability (its fp32 step) / ULP, or not at
    # all: a sum of STEPS Bernoulli choices, variance at most STEPS * LR * ULP (the step is at most ~LR),
    # so the mean over N weights has standard deviation at most sqrt(STEPS * LR * ULP / N) (~5e-5); 6 of
    # those bound the noise. Its fp32 steps differ from the master's through its bf16 moments (exp_avg
    # to nearest, within 2^-9 of its value; exp_avg_sq rounded stochastically): 2 % of the drift covers it.
    noise = 6 * (STEPS * LR * ULP / N) ** 0.5
    assert abs((start - rounded).double().mean().item() - moved) <= noise + 0.02 * moved
    assert (rounded != start).float().mean() > 0.2  # and it is many weights moving, not a few far


def test_cpu_adamw_with_stochastic_rounding_equals_the_torch_optimizer_bit_for_bit() -> None:
    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(33, 64), nn.GELU(), nn.Linear(64, 17)).bfloat16()

    def groups(m: nn.Module) -> list[dict]:
        return [{"params": list(m[0].parameters()), "lr": 3e-3, "weight_decay": 0.1},
                {"params": list(m[2].parameters()), "lr": 1e-3, "weight_decay": 0.0}]

    ours_model, ref_model = model(), model()
    ours = offload_ext.CPUAdamW(groups(ours_model), stochastic_rounding=True, sr_seed=4)
    ref = StochasticAdamW(groups(ref_model), seed=4)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        x = torch.randn(8, 33, generator=gen).bfloat16()
        for m, opt in ((ours_model, ours), (ref_model, ref)):
            opt.zero_grad()
            m(x).float().pow(2).mean().backward()
            opt.step()
    for a, b in zip(ours_model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ours.state[a][key], ref.state[b][key])
