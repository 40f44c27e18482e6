"""CPUAdamW(overlap=True): parameters stepped in backward as their gradients land train exactly as the steps
after backward do, plain and as FSDP2's shards (two gloo processes on the CPU), with torch's schedulers."""
from __future__ import annotations

import contextlib
import copy
import math
import os

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import offload_ext
from helpers import gloo_mesh, shard_linears, spawn_ranks


def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(33, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 17)).to(dtype)


def _groups(model: nn.Module) -> list[dict]:
    return [{"params": list(model[0].parameters()) + list(model[2].parameters()), "lr": 3e-3, "weight_decay": 0.1},
            {"params": list(model[4].parameters()), "lr": 1e-3, "weight_decay": 0.0}]


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, micro: int = 1) -> list[float]:
    gen = torch.Generator().manual_seed(1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    dtype = next(model.parameters()).dtype
    losses = []
    for _ in range(steps):
        for k in range(micro):
            x = torch.randn(8, 33, generator=gen).to(dtype)
            loss = model(x).float().pow(2).mean()
            last = k == micro - 1
            with opt.no_overlap() if not last else contextlib.nullcontext():
                loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
        sched.step()
    return losses


@pytest.mark.parametrize("kw", [dict(), dict(master_weights=True), dict(stochastic_rounding=True)],
                         ids=["plain", "master", "sr"])
@pytest.mark.parametrize("micro", [1, 3])
def test_steps_in_backward_are_bit_exact_with_steps_after_it(kw, micro) -> None:
    dtype = torch.float32 if not kw else torch.bfloat16
    base = _model(dtype)
    runs = {}
    for overlap in (False, True):
        model = copy.deepcopy(base)
        opt = offload_ext.CPUAdamW(_groups(model), overlap=overlap, sr_seed=5, **kw)
        runs[overlap] = (_train(model, opt, 4, micro), model, opt.state_dict())
    assert runs[True][0] == runs[False][0]
    for a, b in zip(runs[True][1].parameters(), runs[False][1].parameters()):
        assert torch.equal(a, b)
    ours, theirs = runs[True][2]["state"], runs[False][2]["state"]
    assert ours.keys() == theirs.keys()
    for index, state in ours.items():
        assert all(torch.equal(v, theirs[index][k]) for k, v in state.items()), index


def _clip_by_the_rule(model: nn.Module, max_norm: float) -> None:
    # global_clip's rule, written out: float64 squares summed per parameter, then over parameters in order
    sums = [float(torch.sum(torch.square(p.grad.to(torch.float64)))) for p in model.parameters()]
    scale = min(1.0, max_norm / (math.sqrt(sum(sums, 0.0)) + 1e-6))
    if scale < 1.0:
        for p in model.parameters():
            p.grad.mul_(scale)


@pytest.mark.parametrize("max_norm", [1e6, 1e-2], ids=["never", "always"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clipping_in_backward_commits_or_redoes_exactly_the_rule(dtype, max_norm) -> None:
    base = _model(dtype)
    runs = {}
    for overlap in (False, True):
        model = copy.deepcopy(base)
        opt = offload_ext.CPUAdamW(_groups(model), overlap=overlap, max_grad_norm=max_norm)
        runs[overlap] = (_train(model, opt, 4, micro=2), model, opt.last_clip_action, opt.last_grad_norm)
    model = copy.deepcopy(base)  # the reference: the rule applied by hand, then the plain step
    ref_opt = offload_ext.CPUAdamW(_groups(model))
    gen = torch.Generator().manual_seed(1)
    sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0 / (1 + s))
    for _ in range(4):
        for _ in range(2):
            model(torch.randn(8, 33, generator=gen).to(dtype)).float().pow(2).mean().backward()
        _clip_by_the_rule(model, max_norm)
        ref_opt.step()
        ref_opt.zero_grad()
        sched.step()
    for ours in (runs[False][1], runs[True][1]):
        for a, b in zip(ours.parameters(), model.parameters()):
            assert torch.equal(a, b)
    assert runs[True][0] == runs[False][0]
    assert (runs[False][2], runs[True][2]) == (("unclipped", "committed") if max_norm > 1 else ("clipped", "redone"))
    assert runs[True][3] == runs[False][3]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_non_finite_norm_raises_and_leaves_the_optimizer_as_before_the_step(overlap) -> None:
    # clip_grad_norm_(error_if_nonfinite=True)'s rule, the Offloader's: no step is applied, the steps taken in
    # backward are undone, and the next batch trains as if the refused one had never come.
    base = _model()
    runs = []
    for refused in (False, True):
        model = copy.deepcopy(base)
        opt = offload_ext.CPUAdamW(_groups(model), overlap=overlap, max_grad_norm=1.0)
        _train(model, opt, 1)
        if refused:
            before = copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in model.parameters()]
            (model(torch.randn(8, 33)).pow(2).mean() * float("nan")).backward()
            with pytest.raises(FloatingPointError, match="CPUAdamW: the total gradient norm is nan .*not applied"):
                opt.step()
            assert math.isnan(opt.last_grad_norm)
            opt.zero_grad()
            assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before[1]))
            for index, state in opt.state_dict()["state"].items():
                assert all(torch.equal(v, before[0]["state"][index][k]) for k, v in state.items()), index
        _train(model, opt, 2)
        runs.append((model, opt.last_clip_action))
    for a, b in zip(runs[0][0].parameters(), runs[1][0].parameters()):
        assert torch.equal(a, b)
    assert runs[0][1] == runs[1][1]


def test_steps_in_backward_take_the_groups_a_loaded_state_dict_brings() -> None:
    # load_state_dict replaces the groups: a step in backward must read the new ones (a schedule sets their lr)
    model = _model()
    opt = offload_ext.CPUAdamW(_groups(model), overlap=True)
    _train(model, opt, 1)
    saved = copy.deepcopy(opt.state_dict())
    opt.load_state_dict(saved)
    for group in opt.param_groups:
        group["lr"] = 0.0
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(2, 33)).pow(2).mean().backward()
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


def test_a_second_backward_without_no_overlap_is_refused() -> None:
    model = _model()
    opt = offload_ext.CPUAdamW(model.parameters(), overlap=True)
    model(torch.randn(2, 33)).sum().backward()
    with pytest.raises(RuntimeError, match="second gradient before step"):
        model(torch.randn(2, 33)).sum().backward()
    opt.zero_grad()  # waits for the first backward's steps: each parameter was stepped once, on it
    assert [int(s["step"]) for s in opt.state.values()] == [1] * len(list(model.parameters()))


def test_a_host_that_cannot_hold_the_state_kept_for_redos_is_refused_before_any_state_exists(monkeypatch) -> None:
    # 2^20 bf16 parameters: moments 4.2 MB, the state kept for a redo (param and moments) 6.3 MB more. A host of
    # 11 MB (9.6 MB available: an eighth is headroom) holds the moments but not both.
    params = [nn.Parameter(torch.zeros(1 << 20, dtype=torch.bfloat16))]
    monkeypatch.setenv("OFFLOAD_EXT_HOST_MEMORY", "11MB")
    with pytest.raises(MemoryError, match=r"CPUAdamW: the host buffers need 0\.0 GB .*overlap=False"):
        offload_ext.CPUAdamW(params, overlap=True, max_grad_norm=1.0)
    for fits in (dict(overlap=True), dict(max_grad_norm=1.0), dict(overlap=True, max_grad_norm=1.0, host="16MB")):
        monkeypatch.setenv("OFFLOAD_EXT_HOST_MEMORY", fits.pop("host", "11MB"))  # 16 MB: 14 MB available
        opt = offload_ext.CPUAdamW(params, **fits)
        assert not opt.state  # the check allocated nothing
        if opt.overlap is not None:
            opt.overlap.close()
    monkeypatch.setenv("OFFLOAD_EXT_HOST_MEMORY", "2MB")
    with pytest.raises(MemoryError, match="CPUAdamW: the host buffers need"):  # the moments alone do not fit
        offload_ext.CPUAdamW(params)


def _fsdp_worker(rank: int, world: int, store: str, dtype: torch.dtype, out: str) -> None:
    with gloo_mesh(rank, world, store) as mesh:
        results = {}
        for name in ("torch", "after", "overlap", "after-clip", "overlap-clip"):
            model = shard_linears(_model(dtype), mesh)
            if name == "torch":
                opt = torch.optim.AdamW(_groups(model), foreach=False)
            else:
                opt = offload_ext.CPUAdamW(_groups(model), overlap=name.startswith("overlap"),
                                           max_grad_norm=1e-2 if name.endswith("clip") else None)
            gen = torch.Generator().manual_seed(2 + rank)  # each rank its own data, as data parallelism has
            losses, first, norms = [], None, []
            for _ in range(4):
                x = torch.randn(4, 33, generator=gen).to(dtype)
                loss = model(x).float().pow(2).mean()
                loss.backward()
                if name == "torch":  # torch's global norm of the sharded gradients (1e9: it never clips)
                    norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).full_tensor()))
                opt.step()
                if name.endswith("clip"):
                    norms.append((opt.last_grad_norm, opt.last_clip_action))
                opt.zero_grad()
                losses.append(loss.item())
                first = first or [p.to_local().detach().clone() for p in model.parameters()]
            results[name] = (losses, first, [p.to_local().detach().clone() for p in model.parameters()], norms)
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))


def _run_fsdp(dtype: torch.dtype, out: str, world: int = 2) -> dict[int, dict]:
    spawn_ranks(_fsdp_worker, world, dtype, out)
    return {rank: torch.load(os.path.join(out, f"rank{rank}.pt")) for rank in range(world)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fsdp2_shards_stepped_in_backward_match_torch_adamw_and_the_steps_after_it(dtype, tmp_path) -> None:
    for rank, results in _run_fsdp(dtype, str(tmp_path)).items():
        (ours_losses, ours_first, ours, _), (after_losses, _, after, _) = results["overlap"], results["after"]
        torch_losses, ref_first, ref, torch_norms = results["torch"]
        assert ours_losses == after_losses, rank
        for a, b in zip(ours, after):
            assert torch.equal(a, b), rank  # the same kernel on the same shards, in backward or after it
        if dtype == torch.float32:
            # torch's single-tensor AdamW rounds its fp32 arithmetic in another order: the last bits differ
            for a, b in zip(ours, ref):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
            assert ours_losses == pytest.approx(torch_losses, rel=1e-6)
        else:
            # One step from the same bf16 state (later steps start from states that differ). The kernel forms
            # the update in fp32 and rounds the parameter once; torch's single-tensor bf16 AdamW rounds the
            # decayed parameter, then each op of the update to bf16: the numerator and four of the
            # denominator (sqrt, bias correction, eps), 2^-9 of the update each, and the update of a first
            # step is ~lr. Bound: 2 ulps of the parameter + lr * 5 * 2^-9 (< lr * 2^-6). Measured on the CPU
            # machine, one step of this model: at most 1 ulp + 0.0095 lr.
            lrs = [g["lr"] for g in _groups(_model(dtype)) for _ in g["params"]]
            for a, b, lr in zip(ours_first, ref_first, lrs):
                _, exponent = torch.frexp(b.float())
                ulp = torch.ldexp(torch.ones_like(b, dtype=torch.float32), exponent - 8)
                assert ((a.float() - b.float()).abs() <= 2 * ulp + lr * 2 ** -6).all(), rank


def test_fsdp2_clipping_in_backward_takes_the_global_norm_across_ranks_and_redoes_exactly(tmp_path) -> None:
    out = _run_fsdp(torch.float32, str(tmp_path))
    for rank, results in out.items():
        ours_losses, _, ours, ours_norms = results["overlap-clip"]
        after_losses, _, after, after_norms = results["after-clip"]
        assert ours_losses == after_losses, rank
        assert [n for n, _ in ours_norms] == [n for n, _ in after_norms], rank
        for a, b in zip(ours, after):
            assert torch.equal(a, b), rank
        assert [a for _, a in ours_norms] == ["redone"] * 4 and [a for _, a in after_norms] == ["clipped"] * 4
        # The first step's norm is that of the same gradients under torch's clip_grad_norm_ (fp32 sums)
        assert ours_norms[0][0] == pytest.approx(results["torch"][3][0], rel=1e-5)
    assert out[0]["overlap-clip"][3] == out[1]["overlap-clip"][3]  # one norm for all ranks



class _Made(TorchDispatchMode):
    """The element counts of the tensors torch ops other than views (detach) return while active, and of the
    float64 ones among them."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []
        self.float64: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and not func.is_view:
            self.sizes.append(out.numel())
            if out.dtype == torch.float64:
                self.float64.append(out.numel())
        return out


def _clipped_second_step(dtype: torch.dtype) -> _Made:
    """What torch ops a clipped step after backward makes (the first step, which makes the state, not watched)."""
    model = _model(dtype)
    opt = offload_ext.CPUAdamW(_groups(model), max_grad_norm=1e-2)
    for k in range(2):
        model(torch.randn(8, 33).to(dtype)).float().pow(2).mean().backward()
        with _Made() if k else contextlib.nullcontext() as made:
            opt.step()
        opt.zero_grad()
    assert opt.last_clip_action == "clipped"
    return made


def test_a_clipped_step_reads_each_bf16_gradient_in_the_kernels_alone() -> None:
    # torch's float64 norm copies a gradient to float64 and squares it (two allocations of 8 bytes an element,
    # tens of seconds a step over an 8 B model's gradients on the host), and an in-place scale is one more pass
    # over it: the extension's sum_squares takes the squares and the AdamW kernel reads the gradient scaled.
    # (Steps after backward: a dispatch mode does not follow the in-backward steps' thread; both take local_sq.)
    made = _clipped_second_step(torch.bfloat16)
    assert made.sizes and max(made.sizes) <= 1  # the sums and step counts, never a gradient's size


def test_the_norm_of_fp32_gradients_makes_no_float64_copy() -> None:
    made = _clipped_second_step(torch.float32)  # fp32 gradients take the extension's one-pass sum too
    assert made.float64 and max(made.float64) <= 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_clipped_step_leaves_each_gradient_as_backward_made_it(dtype) -> None:
    # the kernel reads the gradient scaled (no pass of its own over it); the rule's arithmetic is the tests above'
    model = _model(dtype)
    opt = offload_ext.CPUAdamW(_groups(model), max_grad_norm=1e-2)
    model(torch.randn(8, 33).to(dtype)).float().pow(2).mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    assert opt.last_clip_action == "clipped"
    for p, g in zip(model.parameters(), grads):
        assert torch.equal(p.grad, g)


def _offload_worker(rank: int, world: int, store: str, max_norm: float | None, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # before cuBLAS starts: deterministic GEMMs
    torch.use_deterministic_algorithms(True, warn_only=True)  # FSDP2's own copies need no error to stop on
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        mesh, results = init_device_mesh("cuda", (world,)), {}
        for overlap in (False, True):
            torch.manual_seed(0)
            # layers large enough that each gradient's copy to the host takes a while behind backward's kernels
            model = nn.Sequential(*(nn.Linear(2048, 2048, device="cuda", dtype=torch.bfloat16) for _ in range(6)))
            for layer in model:
                fully_shard(layer, mesh=mesh, offload_policy=CPUOffloadPolicy())
            fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy())
            opt = offload_ext.CPUAdamW(model.parameters(), lr=1e-3, overlap=overlap, max_grad_norm=max_norm)
            gen = torch.Generator(device="cuda").manual_seed(1)
            for _ in range(3):
                x = torch.randn(256, 2048, generator=gen, device="cuda", dtype=torch.bfloat16)
                model(x).float().pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            results[overlap] = ([p.to_local().clone() for p in model.parameters()], opt.last_clip_action)
        torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.parametrize("max_norm", [None, 1e-9], ids=["unclipped", "clipped"])  # 1e-9: every step clips
def test_steps_in_backward_read_host_gradients_fsdp2_copied_from_the_gpu_whole(max_norm, tmp_path) -> None:
    # CPUOffloadPolicy copies each reduced gradient to the host; a step in backward that read one before its copy
    # landed would step on stale or partial bytes. With deterministic kernels the overlapped run and the one
    # stepping after backward must agree bit for bit.
    spawn_ranks(_offload_worker, 1, max_norm, str(tmp_path))
    results = torch.load(tmp_path / "rank0.pt")
    (after, after_action), (ours, ours_action) = results[False], results[True]
    for a, b in zip(ours, after):
        assert torch.equal(a, b)
    assert (ours_action, after_action) == (("redone", "clipped") if max_norm else (None, None))
