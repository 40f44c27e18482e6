"""The engine under faults, on the simulated device: a slow host never changes what accumulation sums, a device
fault or a thread that cannot start ends in an error within a bound (never a hang), a failed step leaves the
Offloader failed until it is closed, close() returns after any error, bad sizes and scales are refused."""
from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import offload_ext
from helpers import batches, offloaded_training, tiny_llama
from offload_ext import ops, testing

LR, WD = 1e-2, 0.1
TESTS = Path(__file__).resolve().parents[1]  # tests/, where helpers.py is
# A fault must surface well within this (the waits poll the copy streams every 50 ms); the rest is start-up.
BOUND_S = 10.0


def _native(model: torch.nn.Module, **kw: Any) -> offload_ext.Offloader:
    return offload_ext.Offloader(model, lr=LR, weight_decay=WD, backend="native", device="cpu", **kw)


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _run_bounded(script: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """Runs `script` in a fresh interpreter: a hang ends as a failed test, not a stuck suite."""
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r})\n" + textwrap.dedent(script)
    try:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"hung for {timeout} s; output: {e.stdout!r} {e.stderr!r}")


# Host sums (accumulate_on_device=False) with the layer staying on the device between micro-batches
# (device_layers = the stack), the default ring, and the part outside the stack stepped on the host.
LAYOUTS = [{"device_layers": 4}, {}, {"offload_all": True}]


@pytest.mark.parametrize("layout", LAYOUTS, ids=["device_layers=stack", "default", "offload_all"])
def test_host_accumulation_under_slow_host_steps_is_bit_exact_with_the_run_without_delay(layout) -> None:
    base, data = tiny_llama(layers=4), batches(4)
    runs = []
    # Each host job far slower than a micro-batch's forward and backward on this machine, so that without the
    # ordering micro-batch 2's gradients land while micro-batch 1's accumulate jobs are still queued.
    for delay_us in (0, 300_000):
        model = copy.deepcopy(base)
        off = _native(model, grad_accum=2, accumulate_on_device=False, **layout)
        testing.slow_host_steps(off, delay_us)
        losses = offloaded_training(off, model, data)
        off.close()
        runs.append((losses, _params(model)))
    (ref_losses, ref_params), (losses, params) = runs
    assert losses == ref_losses
    differ = [i for i, (a, b) in enumerate(zip(params, ref_params)) if not torch.equal(a, b)]
    assert differ == [], f"{len(differ)} of {len(params)} parameters differ from the run without delay"


def test_a_copy_that_never_completes_raises_within_the_bound_and_close_returns() -> None:
    result = _run_bounded("""
        import json, time, warnings
        import offload_ext
        from helpers import batches, offloaded_training, tiny_llama
        from offload_ext import testing
        model = tiny_llama(layers=4)
        off = offload_ext.Offloader(model, backend="native", device="cpu")
        data = batches(3)
        offloaded_training(off, model, data[:1])
        testing.fault_next_copy(off)
        t0 = time.monotonic()
        try:
            offloaded_training(off, model, data[1:])
            raise SystemExit("no error after a device fault")
        except RuntimeError as e:
            message, raised = str(e), time.monotonic() - t0
        try:  # it stays failed
            offloaded_training(off, model, data[2:])
            raise SystemExit("a call after the fault went through")
        except RuntimeError as e:
            again = str(e)
        t1 = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            off.close()
        print(json.dumps({"message": message, "again": again, "raised_s": raised,
                           "close_s": time.monotonic() - t1, "warned": [str(w.message) for w in caught]}))
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert "simulated device faulted" in out["message"]
    assert "simulated device faulted" in out["again"]
    assert out["raised_s"] < BOUND_S and out["close_s"] < BOUND_S
    assert any("simulated device faulted" in w for w in out["warned"])


def test_ctrl_c_interrupts_a_wait_for_a_slow_host_step() -> None:
    result = _run_bounded("""
        import os, signal, threading, time
        import offload_ext
        from helpers import batches, offloaded_training, tiny_llama
        from offload_ext import testing
        model = tiny_llama(layers=2)
        off = offload_ext.Offloader(model, backend="native", device="cpu", async_step=True)
        testing.slow_host_steps(off, 3_000_000)  # each host step 3 s: step() returns, settle() waits
        offloaded_training(off, model, batches(1))
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        t0 = time.monotonic()
        try:
            testing.settle(off)
            raise SystemExit("settle() ended without the interrupt")
        except KeyboardInterrupt:
            print(f"interrupted after {time.monotonic() - t0:.2f} s")
        testing.slow_host_steps(off, 0)
        off.close()
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    seconds = float(result.stdout.split("interrupted after ")[1].split()[0])
    assert seconds < 2.5  # the signal at 0.5 s, polls every 50 ms; without them the wait is the 3 s step


def test_a_thread_that_cannot_start_raises_naming_it_and_nothing_hangs() -> None:
    result = _run_bounded("""
        import offload_ext
        from helpers import tiny_llama
        from offload_ext import testing
        with testing.failing_thread_starts(1):
            try:
                offload_ext.Offloader(tiny_llama(layers=2), backend="native", device="cpu", num_threads=4)
                raise SystemExit("no error")
            except RuntimeError as e:
                print(e)
        off = offload_ext.Offloader(tiny_llama(layers=2), backend="native", device="cpu", num_threads=4)
        off.close()
        print("built after")
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "could not start worker thread 2 of 3" in result.stdout
    assert "num_threads=" in result.stdout and "built after" in result.stdout


def test_a_failed_host_step_leaves_the_offloader_failed_until_closed() -> None:
    model = tiny_llama(layers=4)
    off = _native(model, async_step=False)
    data = batches(3)
    offloaded_training(off, model, data[:1])
    testing.fail_next_host_step(off)
    with pytest.raises(RuntimeError, match="injected failure"):
        offloaded_training(off, model, data[1:2])
    # Every later call raises the first error: no layer steps on while others stay behind.
    for call in (lambda: offloaded_training(off, model, data[2:]), off.state_dict):
        with pytest.raises(RuntimeError, match="injected failure"):
            call()
    with pytest.warns(RuntimeWarning, match="injected failure"):
        off.close()
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_exit_closes_with_an_engine_error_pending() -> None:
    model = tiny_llama(layers=2)
    x = batches(1)[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="injected failure"):
            with _native(model, async_step=True) as off:
                testing.fail_next_host_step(off)
                off.backward(model(input_ids=x, labels=x).loss)
                off.step()
                model(input_ids=x, labels=x)
                testing.settle(off)
    assert any("training had failed" in str(w.message) and "injected failure" in str(w.message) for w in caught)
    with pytest.raises(RuntimeError, match="already closed"):
        off.step()
    model(input_ids=x, labels=x)  # an ordinary module again


def test_close_mid_step_returns_and_detaches() -> None:
    model = tiny_llama(layers=2)
    off = _native(model, grad_accum=2)
    x = batches(1)[0]
    off.backward(model(input_ids=x, labels=x).loss)  # one of two micro-batches
    off.close()
    model(input_ids=x, labels=x)


@pytest.mark.parametrize("backend", ["python", "native"])
def test_a_non_finite_norm_raises_and_no_later_step_is_taken(backend) -> None:
    model = tiny_llama(layers=2)
    off = offload_ext.Offloader(model, lr=LR, backend=backend, device="cpu", max_grad_norm=1.0)
    x = batches(1)[0]
    off.backward(model(input_ids=x, labels=x).loss * float("nan"))
    with pytest.raises(FloatingPointError, match="gradient norm is nan"):
        off.step()
    assert math.isnan(off.last_grad_norm)
    with pytest.raises(RuntimeError, match="an earlier step failed .*gradient norm is nan"):
        off.backward(model(input_ids=x, labels=x).loss)
    with pytest.warns(RuntimeWarning, match="gradient norm is nan"):
        off.close()


@pytest.mark.parametrize("make", ["pinned_empty", "host_empty", "host_zeros"])
@pytest.mark.parametrize("numel", [2 ** 62, -1])
def test_sizes_whose_bytes_overflow_are_refused(make: str, numel: int) -> None:
    engine = ops.Engine(-1, 1, False, 1 << 20)
    with pytest.raises(RuntimeError, match=f"Engine.{make}: expected 0 <= numel"):
        getattr(engine, make)(numel, torch.bfloat16)


@pytest.mark.parametrize("scale", [float("nan"), -0.5, float("inf")])
def test_a_redo_with_a_nan_negative_or_infinite_scale_is_refused(scale: float) -> None:
    engine = ops.Engine(-1, 1, False, 1 << 20)
    with pytest.raises(RuntimeError, match="expected a finite clipping scale >= 0"):
        engine.redo(0, scale)
    with pytest.raises(RuntimeError, match="expected a finite clipping scale >= 0"):
        engine.run(0, ops.Job.SCALE_STEP, scale)


def test_a_wait_on_a_faulted_stream_is_bounded_at_the_engine() -> None:
    engine = ops.Engine(-1, 1, False, 1 << 20)
    src, dst = torch.ones(1024), engine.pinned_empty(1024, torch.float32)
    engine.fault_next_copy()
    engine.copy(ops.Direction.D2H, dst, src)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="simulated device faulted on the D2H copy stream"):
        engine.synchronize()
    with pytest.raises(RuntimeError, match="simulated device faulted"):
        engine.wait_all()
    assert time.monotonic() - t0 < BOUND_S
    assert "simulated device faulted" in engine.close()
