"""The native Engine on the simulated device: pool memory, the step scheduler's order and slicing, the typed
job and direction enums, a copy that fails to enqueue; and the testing aids both backends give
offload_ext.testing (delays, injected failures, pending steps), driven through the Backend interface."""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from offload_ext import ops
from offload_ext.engine.backends import Backend, Hyper, LayerBuffers, make_backend

Direction, Job = ops.Direction, ops.Job
GPU = pytest.mark.gpu


def _engine(num_threads: int = 1) -> Any:  # an ops.Engine on the simulated device
    return ops.Engine(-1, num_threads, False, 1 << 20)


def test_host_zeros_reads_zero_also_when_memory_is_reused() -> None:
    engine = _engine()
    first = engine.host_zeros(1000, torch.float32)
    assert torch.count_nonzero(first) == 0
    first.fill_(7.0)
    del first
    again = engine.host_zeros(1000, torch.float32)
    assert torch.count_nonzero(again) == 0
    assert engine.memory_stats()["host_in_use"] >= 4000



def test_successive_buffers_start_at_different_places_in_their_pages_without_overlapping() -> None:
    # The streams of one host pass would otherwise share cache sets (bench_host_passes: 16 vs 9 ms).
    engine = _engine()
    makers = (engine.pinned_empty, engine.host_empty, engine.host_zeros)
    bufs = [makers[k % 3](4097, torch.float32) for k in range(16)]
    starts = [b.data_ptr() % 4096 for b in bufs]
    assert len(set(starts[:8])) == 8 and all(s % 64 == 0 for s in starts), starts
    for k, b in enumerate(bufs):
        b.fill_(float(k))
    assert all(torch.all(b == float(k)) for k, b in enumerate(bufs))
    stats = engine.memory_stats()
    del bufs, b
    after = engine.memory_stats()
    assert after["pinned_in_use"] == 0 and after["host_in_use"] == 0, (stats, after)

def test_release_free_memory_unmaps_the_slabs_no_live_block_is_in_and_keeps_the_others() -> None:
    engine = ops.Engine(-1, 1, False, 1 << 20)  # 1 MB slabs
    engine.reserve_host_blocks([900 << 10] * 2)  # two blocks that do not share a slab
    kept, dropped = (engine.host_zeros((900 << 10) // 4 - 1024, torch.float32) for _ in range(2))
    kept.fill_(3.0)
    dropped.fill_(4.0)
    before = engine.memory_stats()["host_reserved"]
    del dropped
    assert engine.release_free_memory() == before // 2
    assert engine.memory_stats()["host_reserved"] == before // 2 and torch.all(kept == 3.0)
    del kept
    assert engine.release_free_memory() == before // 2 and engine.memory_stats()["host_reserved"] == 0
    again = engine.host_zeros(1 << 20, torch.float32)  # allocating after a release adds slabs again
    assert torch.count_nonzero(again) == 0


def test_reserved_blocks_larger_than_a_slab_are_where_the_buffers_go() -> None:
    # A layer larger than a slab (B2: 436 MB against 256 MB slabs) used to get a slab of its own beside
    # the reserved ones, doubling the pinned memory.
    engine = ops.Engine(-1, 1, False, 1 << 20)  # 1 MB slabs
    big, small = 3 << 20, 300 << 10
    engine.reserve_pinned_blocks([big + 8192] * 3 + [small + 8192] * 4)
    before = engine.memory_stats()
    bufs = [engine.pinned_empty(n // 2, torch.bfloat16) for n in (small, big, small, big, small, big, small)]
    after = engine.memory_stats()
    assert (after["pinned_reserved"], after["pinned_slabs"]) == (before["pinned_reserved"], before["pinned_slabs"])
    assert after["pinned_in_use"] >= 3 * big + 4 * small and len(bufs) == 7


def test_a_unit_being_waited_on_is_stepped_before_other_queued_units() -> None:
    engine = _engine()
    units = []
    for _ in range(4):
        p, g, m, v = (engine.host_zeros(1024, torch.bfloat16) for _ in range(4))
        units.append(engine.add_unit(p, g, m, v))
    engine.set_hyper(1e-3, 0.9, 0.999, 1e-8, 0.0, 1)
    engine.set_debug_step_delay_us(200_000)  # each step: 0.2 s, far longer than the calls below take
    for u in (3, 2, 1, 0):  # gradients land top-down, as in backward
        engine.notify(u)
    # The scheduler has taken one unit by now: 3 if it woke at the first notify, else 0 (the lowest).
    engine.wait_unit(1)     # unit 1 jumps ahead of the queued ones
    assert engine.ready(1) and not engine.ready(2) and sum(engine.ready(u) for u in (0, 3)) <= 1
    engine.wait_unit(0)     # then the lowest id: 0 before 2
    assert not engine.ready(2)
    engine.wait_all()
    assert engine.stats()["wait_seconds"] > 0.3


def _engine_units(engine: Any, sizes: list[int], precision: str,
                  groups: list[tuple[int, int, int]] = ()) -> tuple[list[int], list[list[torch.Tensor | None]]]:
    """Engine units over fresh random tensors (kept alive in the returned list); "bf16-sr": unit k draws
    stream k of seed 9."""
    state = torch.float32 if precision == "mixed" else torch.bfloat16
    g = torch.Generator().manual_seed(0)
    units, tensors = [], []
    for n in sizes:
        t = [torch.randn(n, generator=g).to(state), torch.randn(n, generator=g).to(torch.bfloat16),
             torch.randn(n, generator=g).to(state), torch.rand(n, generator=g).to(state),
             torch.empty(n, dtype=torch.bfloat16) if precision == "mixed" else None,
             torch.randn(n, generator=g).to(torch.bfloat16)]
        sr = dict(sr_seed=9, sr_stream=len(units)) if precision == "bf16-sr" else {}
        units.append(engine.add_unit(*t[:4], t[4], accum=t[5], groups=list(groups), **sr))
        tensors.append(t)
    engine.set_hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, 3)
    return units, tensors


@pytest.mark.parametrize("precision", ["bf16", "bf16-sr", "mixed"])
def test_a_job_stepped_in_slices_gives_the_same_result_as_in_one_go(precision: str) -> None:
    results = []
    for slice_elements in (None, 1000):  # 1000: slices end off the SIMD width, in the scalar tail
        engine = _engine(num_threads=2)
        if slice_elements:
            engine.set_slice_elements(slice_elements)
        (u,), tensors = _engine_units(engine, [10_007], precision)
        grad = tensors[0][1]
        landing = torch.randn(grad.numel(), generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        # One job at a time: a landing copy must not overwrite the gradient a step still reads.
        for submit in (lambda: engine.notify(u),                                                     # step
                       lambda: engine.copy(Direction.D2H, grad, landing, notify_unit=u,
                                           job=Job.ACCUMULATE_FIRST),                               # accum = it
                       lambda: engine.copy(Direction.D2H, grad, landing, notify_unit=u,
                                           job=Job.ACCUMULATE_STEP),                                # += it; step
                       lambda: engine.run(u, Job.SCALE_STEP, 0.5),                                   # *= 0.5; step
                       lambda: engine.run(u, Job.NORM, 1.0)):                                        # not sliced
            submit()
            engine.wait_unit(u)
        results.append([t for t in tensors[0] if t is not None] + [torch.tensor(engine.sq_norm(u))])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def _landing(n: int) -> torch.Tensor:
    """A gradient as a copy from the device brings it."""
    return torch.randn(n, generator=torch.Generator().manual_seed(1)).bfloat16()


def _job_names(events: list[tuple[str, str, int, int, int]]) -> list[tuple[str, int]]:
    """(job name, unit) of each host-step slice on the timeline, in order."""
    return [(name.rsplit(" u", 1)[0], unit) for lane, name, _, _, unit in events if lane == "host step"]


def _speculative_unit(engine: Any, n: int, sr: bool = False) -> tuple[int, list[torch.Tensor]]:
    """A bf16 unit with second buffers; its gradient lands in its accum (kept for a redo), as the backend's.
    `sr`: rounded stochastically ("bf16-sr")."""
    g = torch.Generator().manual_seed(0)
    param, m = torch.randn(n, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16()
    v, grad = torch.rand(n, generator=g).bfloat16(), torch.zeros(n, dtype=torch.bfloat16)
    alt = [torch.zeros(n, dtype=torch.bfloat16) for _ in range(3)]
    unit = engine.add_unit(param, grad, m, v, accum=grad, alt=alt, sr_seed=2 if sr else None)
    engine.set_hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, 3)
    return unit, [param, grad, m, v, *alt]


@pytest.mark.parametrize("sr", [False, True])
def test_a_redo_of_a_speculative_step_whose_copy_is_still_in_flight_goes_behind_it(sr: bool) -> None:
    # The norm was taken on the device, so the copy queues the speculative step itself; wait_norms must
    # cover the copy's landing, or the redo would be queued (and run) before the step it redoes. With
    # stochastic rounding, the redo from the second buffers draws the clipped step's bits.
    n = 4096
    landing = _landing(n)
    results = []
    for delay_us in (0, 20_000):
        engine = _engine()
        u, t = _speculative_unit(engine, n, sr)
        engine.set_debug_delay_us(delay_us)
        if delay_us:  # in flight when the norm is decided
            engine.copy(Direction.D2H, t[1], landing, notify_unit=u, job=Job.SPECULATIVE_STEP)
            engine.wait_norms()
            engine.redo(u, 0.5)
        else:  # reference: the clipped step itself
            engine.copy(Direction.D2H, t[1], landing, notify_unit=u, job=Job.NORM)
            engine.wait_norms()  # the gradient has landed
            engine.run(u, Job.SCALE_STEP, 0.5)
        engine.release_speculation()
        engine.wait_all()
        live = (t[0], t[5], t[6]) if engine.swapped(u) else (t[0], t[2], t[3])
        results.append([x.clone() for x in live])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_a_bf16_sr_unit_draws_the_bits_of_its_index_in_every_group_range_and_slice() -> None:
    # Two groups with the same hyperparameters step the unit in two pieces (and slices of 999 cut those):
    # each piece draws from its offset in the unit, so the result is the one-range unit's, and the op's
    # on the whole span from the same stream.
    n, cut = 10_007, 3_001
    results = []
    for groups, slice_elements in (((), None), (((0, 0, cut), (1, cut, n)), 999)):
        engine = _engine(num_threads=2)
        if slice_elements:
            engine.set_slice_elements(slice_elements)
        (u,), tensors = _engine_units(engine, [n], "bf16-sr", groups)
        engine.set_hyper(1e-3, 0.9, 0.999, 1e-8, 0.01, 3, group=1)
        engine.notify(u)
        engine.wait_unit(u)
        results.append(tensors[0][:4])
    (_,), (op,) = _engine_units(_engine(), [n], "bf16-sr")
    ops.adamw_step(*op[:4], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=3, sr_seed=9,
                   sr_stream=0)
    for a, b, c in zip(*results, op[:4]):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_a_lower_unit_goes_ahead_of_a_started_higher_one_at_its_next_slice() -> None:
    engine = _engine()
    engine.set_slice_elements(1024)
    (low, high), _ = _engine_units(engine, [1024, 8 * 1024], "bf16")
    engine.set_debug_step_delay_us(20_000)  # every slice: 20 ms; the high unit has 8
    engine.notify(high)                     # starts at once, as the top layer's gradients land first
    time.sleep(0.05)
    engine.notify(low)
    engine.wait_unit(low)                   # taken after the high unit's current slice
    assert not engine.ready(high)           # which still has slices left
    engine.wait_all()
    with pytest.raises(ValueError, match="slice"):
        engine.set_slice_elements(0)


@pytest.mark.parametrize("precision", ["bf16", "bf16-sr", "mixed"])
def test_a_step_after_the_norm_in_two_passes_gives_the_bits_of_one(precision: str) -> None:
    # The params pass and the moments pass each compute the whole update and store their part; in place,
    # the params pass goes first, so the moments pass still reads the moments before the step.
    results = []
    for params_first in (False, True):
        engine = _engine(num_threads=2)
        engine.set_params_first(params_first)
        units, tensors = _engine_units(engine, [10_007, 333], precision)
        for u in units:
            engine.run(u, Job.SCALE_STEP, 0.375)
        engine.wait_all()
        results.append([t for ts in tensors for t in ts if t is not None])
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("sr", [False, True])
def test_a_redo_in_two_passes_gives_the_bits_of_one(sr: bool) -> None:
    # From the state before the speculative step (the second buffers) into the live one, in two passes.
    n = 4096
    landing = _landing(n)
    results = []
    for params_first in (False, True):
        engine = _engine()
        engine.set_params_first(params_first)
        u, t = _speculative_unit(engine, n, sr)
        engine.copy(Direction.D2H, t[1], landing, notify_unit=u, job=Job.SPECULATIVE_STEP)
        engine.wait_all()  # the speculative step ran: the redo reads the state it left behind
        engine.wait_norms()
        engine.redo(u, 0.5)
        engine.release_speculation()
        engine.wait_all()
        assert engine.swapped(u)
        results.append([x.clone() for x in t])
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("clips", [False, True])
def test_a_held_speculative_step_waits_for_the_norm_then_steps_once_in_place(clips: bool) -> None:
    # hold_speculation (after a step that clipped): the speculative step queued by a landing does not run;
    # once the norm is decided it is the clipped step itself (redo) or the plain one (release), in place.
    n = 4096
    landing = _landing(n)
    results = []
    for held in (False, True):
        engine = _engine()
        u, t = _speculative_unit(engine, n)
        engine.start_trace()
        if held:
            engine.hold_speculation()
            engine.copy(Direction.D2H, t[1], landing, notify_unit=u, job=Job.SPECULATIVE_STEP)
            time.sleep(0.05)
            assert not engine.ready(u)  # landed and held
            engine.wait_norms()
            if clips:
                engine.redo(u, 0.5)
        else:  # reference: the step with the gradient in place, after the norm
            engine.copy(Direction.D2H, t[1], landing, notify_unit=u, job=Job.NORM)
            engine.wait_norms()
            engine.run(u, Job.SCALE_STEP, 0.5 if clips else 1.0)
        engine.release_speculation()
        engine.wait_all()
        names = {name for name, _ in _job_names(engine.stop_trace())}
        assert not engine.swapped(u) and "speculative step" not in names, names
        if held:  # clipped: params first, then the moments; released unclipped: one pass (the host is behind)
            assert names == ({"scale + step (params)", "scale + step (moments)"} if clips else {"scale + step"})
        results.append([x.clone() for x in t[:4]])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_the_params_of_a_step_after_the_norm_are_ready_before_its_moments_pass_which_goes_last() -> None:
    engine = _engine()
    (low, high), _ = _engine_units(engine, [1024, 1024], "bf16")
    engine.set_debug_step_delay_us(100_000)  # every pass: 0.1 s
    engine.start_trace()
    engine.run(low, Job.SCALE_STEP, 0.5)
    engine.run(high, Job.SCALE_STEP, 0.5)
    # The wait returns once the params are stored; the moments pass behind them is not raised with them.
    engine.wait_unit(low, params_only=True)
    assert engine.ready(low, params_only=True) and not engine.ready(low)
    engine.wait_all()
    order = _job_names(engine.stop_trace())
    assert order == [("scale + step (params)", low), ("scale + step (params)", high),
                     ("scale + step (moments)", low), ("scale + step (moments)", high)]


def test_a_moments_pass_goes_first_when_its_unit_has_work_behind_it() -> None:
    # The unit's next job (here its next step) waits behind its moments pass: that pass ranks as the job
    # would (the lowest unit first), not last.
    engine = _engine()
    (low, high), _ = _engine_units(engine, [1024, 1024], "bf16")
    engine.set_debug_step_delay_us(100_000)
    engine.start_trace()
    engine.run(high, Job.SCALE_STEP, 0.5)  # taken at once, before the rest is queued
    time.sleep(0.03)
    engine.run(low, Job.SCALE_STEP, 0.5)
    engine.notify(low)  # its next step
    engine.wait_all()
    order = _job_names(engine.stop_trace())
    assert order == [("scale + step (params)", high), ("scale + step (params)", low), ("scale + step (moments)", low),
                     ("step", low), ("scale + step (moments)", high)]


def _returns_within(seconds: float, fn: Callable[[], object]) -> bool:
    """Whether fn() returns within `seconds` (a wait that hangs would otherwise hang the test run)."""
    done = threading.Event()
    thread = threading.Thread(target=lambda: (fn(), done.set()), daemon=True)
    thread.start()
    return done.wait(seconds)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU)])
def test_a_copy_that_fails_to_enqueue_raises_and_leaves_nothing_expected(device: str) -> None:
    engine = _engine() if device == "cpu" else ops.Engine(torch.cuda.current_device(), 1, False, 1 << 20)
    (u,), tensors = _engine_units(engine, [4096], "bf16")
    grad = tensors[0][1]
    landing = torch.randn(grad.numel(), generator=torch.Generator().manual_seed(2)).to(device, torch.bfloat16)
    engine.fail_next_copy()
    with pytest.raises(RuntimeError, match="injected copy failure"):
        engine.copy(Direction.D2H, grad, landing, notify_unit=u, job=Job.STEP)
    assert engine.ready(u)  # the failed copy's step is no longer expected
    assert _returns_within(5.0, lambda: engine.wait_unit(u))
    assert _returns_within(5.0, engine.wait_all)
    assert engine.stats()["units_stepped"] == 0 and not torch.equal(grad, landing.cpu())
    # The failure was one-off: the next copy lands and steps its unit.
    engine.copy(Direction.D2H, grad, landing, notify_unit=u, job=Job.STEP)
    engine.wait_unit(u)
    assert torch.equal(grad, landing.cpu()) and engine.stats()["units_stepped"] == 1


def test_jobs_are_checked_against_the_call_that_queues_them() -> None:
    engine = _engine()
    (u,), tensors = _engine_units(engine, [64], "bf16")
    grad = tensors[0][1]
    with pytest.raises(RuntimeError, match="SCALE_STEP and REDO are queued by the engine"):
        engine.copy(Direction.D2H, grad, grad.clone(), notify_unit=u, job=Job.SCALE_STEP)
    with pytest.raises(RuntimeError, match="speculative step needs the unit's second state buffers"):
        engine.copy(Direction.D2H, grad, grad.clone(), notify_unit=u, job=Job.SPECULATIVE_STEP)
    with pytest.raises(RuntimeError, match="then_step .* goes with Job.NORM or Job.ACCUMULATE_NORM only"):
        engine.copy(Direction.D2H, grad, grad.clone(), notify_unit=u, job=Job.STEP, then_step=True)
    with pytest.raises(RuntimeError, match="expected Job.NORM or Job.SCALE_STEP"):
        engine.run(u, Job.STEP)
    with pytest.raises(RuntimeError, match="a job is only queued for a notify_unit"):
        engine.copy(Direction.D2H, grad, grad.clone(), job=Job.ACCUMULATE)
    with pytest.raises(RuntimeError, match="expected Direction.H2D or Direction.D2H"):
        engine.copy(Direction(7), grad, grad.clone())
    with pytest.raises(TypeError):
        engine.copy(1, grad, grad.clone())  # a bare int is no Direction
    assert engine.ready(u)  # a refused call expects nothing


# ------------------------------------------------------------------ the backends' testing aids

N = 2048  # elements per layer


def _backend(name: str, layers: int = 3, **options: object) -> tuple[Backend, list[LayerBuffers]]:
    if name == "native":
        options = {"num_threads": 1, "pin_threads": False, **options}
    backend = make_backend(name, torch.device("cpu"), "bf16", **options)
    backend.prepare([(N, N)] * layers)
    host = [backend.new_layer(N, N) for _ in range(layers)]
    for k, layer in enumerate(host):
        layer.params.copy_(torch.randn(N, generator=torch.Generator().manual_seed(k)))
    backend.begin_step([Hyper(1e-3, 0.9, 0.999, 1e-8, 0.0, 1)])
    backend.begin_micro(first=True, last=True)
    return backend, host


def _flush(backend: Backend, host: list[LayerBuffers], index: int) -> None:
    grads = torch.randn(N, generator=torch.Generator().manual_seed(100 + index)).to(torch.bfloat16)
    backend.compute_wait(backend.flush_grads(index, host[index], grads))


@pytest.mark.parametrize("name", ["python", "native"])
def test_an_injected_copy_failure_raises_once_and_leaves_nothing_pending(name: str) -> None:
    backend, host = _backend(name)
    dst = torch.empty(N, dtype=torch.bfloat16)
    backend.fail_next_copy()
    with pytest.raises(RuntimeError, match="injected copy failure"):
        _flush(backend, host, 2)
    assert backend.pending_units() == []
    backend.compute_wait(backend.load(0, host[0], dst))  # the next copy works
    assert torch.equal(dst, host[0].params)
    for i in (2, 1, 0):
        _flush(backend, host, i)
    backend.finish_step()
    backend.settle()
    backend.close()


@pytest.mark.parametrize("name", ["python", "native"])
def test_an_injected_step_failure_surfaces_by_the_end_of_the_step(name: str) -> None:
    backend, host = _backend(name)
    backend.fail_next_step()
    with pytest.raises(RuntimeError, match="injected failure"):
        for i in (2, 1, 0):  # the native one fails at the next gradient flush once the step failed
            _flush(backend, host, i)
        backend.finish_step()  # the python backend steps here; the native one may still be stepping
        backend.settle()
    backend.close()


def test_a_step_delay_leaves_native_units_pending_after_the_step_and_the_python_backend_refuses_it() -> None:
    backend, host = _backend("native")
    backend.set_step_delay(20_000)
    for i in (2, 1, 0):
        _flush(backend, host, i)
    backend.finish_step()  # asynchronous: returns with the steps still queued
    assert backend.pending_units() != [] and set(backend.pending_units()) <= {0, 1, 2}
    backend.settle()
    assert backend.pending_units() == []
    backend.close()
    python, _ = _backend("python")
    with pytest.raises(NotImplementedError, match="PythonBackend cannot delay its host steps"):
        python.set_step_delay(1000)
    assert python.pending_units() == []


@pytest.mark.parametrize("name", ["python", "native"])
def test_a_copy_delay_stalls_each_copy_and_zero_turns_it_off(name: str) -> None:
    backend, host = _backend(name)
    dst = torch.empty(N, dtype=torch.bfloat16)
    backend.set_copy_delay(10_000)  # 20 copies of a random 0..10 ms: 100 ms expected, 20 ms at the very least
    t0 = time.perf_counter()
    for _ in range(20):
        backend.compute_wait(backend.load(1, host[1], dst))
    assert time.perf_counter() - t0 > 0.02
    assert torch.equal(dst, host[1].params)
    backend.set_copy_delay(0)
    backend.compute_wait(backend.load(0, host[0], dst))
    assert torch.equal(dst, host[0].params)
    backend.close()


def test_every_python_backend_buffer_lies_in_its_pinned_arena() -> None:
    backend, host = _backend("python")
    start, end = backend.arena_bounds()
    for layer in host:
        for t in (layer.params, layer.grads):
            assert start <= t.data_ptr() and t.data_ptr() + t.nbytes <= end
    backend.close()


@pytest.mark.parametrize("slice_elements", [None, N // 8])
def test_native_slice_elements_overrides_whole_units_for_a_shared_grad_ring(slice_elements: int | None) -> None:
    # Three layers on two grad slots share the ring, where the default steps whole units.
    backend, host = _backend("native", grad_slots=2, slice_elements=slice_elements)
    backend.set_step_delay(25_000)  # per slice: a whole unit takes 25 ms, a sliced one 200 ms
    _flush(backend, host, 1)  # starts at once
    time.sleep(0.1)
    _flush(backend, host, 0)
    dst = torch.empty(N, dtype=torch.bfloat16)  # alive until its copy has landed: the engine does not hold it
    loaded = backend.load(0, host[0], dst)  # waits for unit 0's step
    # Sliced, unit 0 went ahead of unit 1 at its next slice; whole, unit 1 finished before unit 0 began.
    assert backend.pending_units() == ([1] if slice_elements else [])
    backend.compute_wait(loaded)
    backend.finish_step()
    backend.settle()
    backend.close()


def _niceness_of_threads() -> dict[int, int]:
    """This process's threads: id -> niceness (Linux keeps one per thread)."""
    return {int(tid): os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir("/proc/self/task")}


def test_host_nice_gives_every_host_step_thread_that_niceness_and_nothing_else() -> None:
    before = _niceness_of_threads()
    # Above the process's own niceness (raising it needs no privilege; tests may run under `nice`).
    target = max(before.values()) + 1
    if target > 19:
        pytest.skip("the process already runs at niceness 19")
    engine = ops.Engine(-1, 4, False, 1 << 20, host_nice=target)
    # The scheduler and three workers (a pool of 4 counts its caller): each takes its niceness as it starts.
    deadline = time.monotonic() + 10
    while sum(n == target for n in _niceness_of_threads().values()) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    after = _niceness_of_threads()
    assert sum(n == target for n in after.values()) == 4
    assert all(after[t] == n for t, n in before.items() if t in after)  # the others keep theirs
    assert engine.stats()["host_nice"] == target
    assert ops.Engine(-1, 2, False, 1 << 20).stats()["host_nice"] == 0


def test_host_nice_outside_0_to_19_is_refused_naming_the_range() -> None:
    with pytest.raises(ValueError, match=r"nice must be in \[0, 19\].*got 20"):
        ops.Engine(-1, 2, False, 1 << 20, host_nice=20)


def test_an_eight_bit_unit_needs_an_absmax_a_block_of_each_group_range_and_uint8_moments() -> None:
    from offload_ext.optim.eight_bit import eight_bit_codes

    engine, n = _engine(), 1000  # ranges of 600 and 400 elements: 3 + 2 blocks, not num_blocks(1000) = 4
    param, grad = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    codes = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    groups = [(0, 0, 600), (1, 600, n)]

    def add(blocks: int, moments=codes) -> int:
        return engine.add_unit(param, grad, *moments, groups=groups,
                               eight_bit=[torch.zeros(blocks), torch.zeros(blocks), eight_bit_codes()])
    with pytest.raises(RuntimeError, match="expected exp_avg_absmax to have 5 elements like param, got 4"):
        add(4)
    with pytest.raises(RuntimeError, match="8-bit .* mode expected exp_avg of dtype Byte, got BFloat16"):
        add(5, (param.clone(), param.clone()))
    assert add(5) == 0
