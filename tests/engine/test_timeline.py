"""Offloader.trace: a timeline whose events are in the order the engine must run them, as a Chrome trace."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import offload_ext
from helpers import batches, offloaded_training, tiny_llama
from offload_ext.engine.timeline import Timeline

LAYERS = 4


def _traced_run(backend: str, path: Path, **kw) -> list[tuple[str, str, int, int, int]]:
    model = tiny_llama(layers=LAYERS)
    off = offload_ext.Offloader(model, backend=backend, device="cpu", **kw)
    offloaded_training(off, model, batches(1))
    with off.trace(str(path)) as timeline:
        offloaded_training(off, model, batches(2))
    off.close()
    return timeline.events


def test_native_timeline_steps_each_unit_after_its_gradients_land_and_copies_it_after_its_step(tmp_path) -> None:
    events = _traced_run("native", tmp_path / "t.json")
    lanes = {e[0] for e in events}
    assert {"python", "H2D", "D2H", "host step"} <= lanes
    for unit in range(LAYERS):
        copies_out = [(e[2], e[3]) for e in events if e[0] == "D2H" and e[4] == unit]
        steps = [(e[2], e[3]) for e in events if e[0] == "host step" and e[4] == unit]
        loads = [e[2] for e in events if e[0] == "H2D" and e[4] == unit]
        assert len(copies_out) == 2, (unit, copies_out)  # two traced backward passes
        for k, (issued, landed) in enumerate(sorted(copies_out)):
            after = [s for s in steps if s[0] >= issued]
            assert after and all(begin >= landed for begin, _ in after)  # a unit is stepped once its grads landed
            if k == 0:  # and copied to the device for the next (traced) forward only after that step
                assert any(t >= min(after)[1] for t in loads), (unit, after, loads)
    assert sum(e[1] == "backward" for e in events) == 2 and sum(e[1] == "step" for e in events) == 2


def test_python_backend_timeline_has_its_host_steps_after_backward(tmp_path) -> None:
    events = _traced_run("python", tmp_path / "t.json")
    backward_end = max(e[3] for e in events if e[1] == "backward")
    steps = [e for e in events if e[0] == "host step"]
    assert len(steps) == 2 * LAYERS and all(e[2] >= min(b[3] for b in events if b[1] == "backward") for e in steps)
    assert max(e[3] for e in steps) >= backward_end  # the python backend steps inside step(), after backward


def test_the_trace_file_is_a_chrome_trace_with_a_named_lane_per_stream(tmp_path) -> None:
    path = tmp_path / "t.json"
    events = _traced_run("native", path, max_grad_norm=1e-3)  # speculative clipping: steps and redos
    trace = json.loads(path.read_text())
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"python", "H2D", "D2H", "host step", "wait"} <= names
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(events) and all(e["ts"] >= 0 and e["dur"] >= 0 for e in complete)
    jobs = {e["name"].rsplit(" u", 1)[0] for e in complete if e["tid"] == 3}  # the host step lane
    after_norm = {f"{job} ({part})" for job in ("scale + step", "scale + step from before (redo)")
                  for part in ("params", "moments")}
    assert jobs and jobs <= {"norm", "speculative step"} | after_norm, jobs
    assert jobs & after_norm, jobs  # clipped: every unit steps again, or for the first time, after the norm


def test_a_torch_profiler_run_merges_onto_the_timeline_clock(tmp_path) -> None:
    # The simulated device has no GPU streams: the profiler's CPU ops stand in for them, on the same path.
    from torch.profiler import ProfilerActivity, profile

    model = tiny_llama(layers=2)
    off = offload_ext.Offloader(model, backend="native", device="cpu")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with off.trace() as timeline:
            offloaded_training(off, model, batches(1))
    off.close()
    ours = list(timeline.events)
    assert timeline.add_profile(prof, categories=("cpu_op",)) > 0
    merged = [e for e in timeline.events if e[0] == "torch ops"]
    _, _, begin, end, _ = next(e for e in ours if e[1] == "backward")
    # autograd's ops run inside backward's span: the two clocks agree to well under a millisecond
    inside = [e for e in merged if e[1].startswith("autograd::engine") or "Backward" in e[1]]
    assert inside and all(begin - 1_000_000 <= e[2] and e[3] <= end + 1_000_000 for e in inside)
    path = tmp_path / "merged.json"
    timeline.write(str(path))
    names = {e["args"]["name"] for e in json.loads(path.read_text())["traceEvents"] if e["name"] == "thread_name"}
    assert "torch ops" in names


def test_a_second_trace_inside_the_first_is_refused() -> None:
    model = tiny_llama(layers=2)
    with offload_ext.Offloader(model, device="cpu") as off, off.trace():
        with pytest.raises(RuntimeError, match="already tracing"):
            with off.trace():
                pass


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="plotting needs matplotlib")
def test_plot_timeline_draws_one_step_as_a_png(tmp_path) -> None:
    trace, png = tmp_path / "t.json", tmp_path / "t.png"
    _traced_run("native", trace)
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "plot_timeline.py"
    subprocess.run([sys.executable, str(script), str(trace), str(png), "--step", "1"], check=True)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_timeline_without_matplotlib_names_the_pip_line(tmp_path) -> None:
    trace = tmp_path / "t.json"
    _traced_run("native", trace)
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "plot_timeline.py"
    hidden = tmp_path / "no_matplotlib"  # first on the path: `import matplotlib` fails as where it is not installed
    hidden.mkdir()
    (hidden / "matplotlib.py").write_text("raise ImportError(\"No module named 'matplotlib'\")\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hidden), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script), str(trace), str(tmp_path / "t.png")], capture_output=True,
                          text=True, env=env)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip() == ('plot_timeline: drawing needs matplotlib: pip install matplotlib (or pip install '
                                   '".[plot]" in the repository)')


def test_timeline_stats_counts_one_host_step_per_unit_in_a_step(tmp_path) -> None:
    trace = tmp_path / "t.json"
    _traced_run("native", trace)
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "timeline_stats.py"
    out = subprocess.run([sys.executable, str(script), str(trace), "--step", "1"], check=True, capture_output=True,
                         text=True).stdout
    assert "  step uN: " in out and f"({LAYERS}, " in out.split("host steps by kind")[1], out


def test_bench_train_traces_a_resident_step_with_its_backward_passes_as_it_does_an_offloaded_one(tmp_path) -> None:
    # Both columns of a recipe on one kind of timeline, so that timeline_stats compares their launches.
    bench = Path(__file__).resolve().parents[2] / "benchmarks"
    shape = ["--layers", "2", "--hidden", "64", "--intermediate", "128", "--heads", "4", "--kv-heads", "2",
             "--vocab", "128", "--batch", "2", "--seq", "16", "--steps", "1", "--warmup", "1"]
    subprocess.run([sys.executable, str(bench / "bench_train.py"), "--device", "cpu", *shape, "--stem",
                    str(tmp_path / "t"), "--modes", "resident-accum2,native-bf16-accum2", "--trace", str(tmp_path)],
                   check=True, capture_output=True, cwd=tmp_path)
    for mode in ("resident-accum2", "native-bf16-accum2"):
        with open(tmp_path / f"timeline_{mode}.json") as f:
            names = [e["name"] for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and e.get("tid") == 0]
        assert names.count("backward") == 2 and names.count("step") == 1, (mode, names)
        stats = [sys.executable, str(bench / "timeline_stats.py"), str(tmp_path / f"timeline_{mode}.json")]
        out = subprocess.run(stats, check=True, capture_output=True, text=True).stdout
        assert out.startswith("step window ") and "python:" in out, out


def test_timeline_stats_reports_who_fed_each_pass_how_fast_and_with_which_ops(tmp_path) -> None:
    # A made-up step: backward 0-10 ms with launches every 100 us (calls of 5 us), then a 5 ms forward and a
    # backward whose launches come every 200 us (calls of 20 us): the figures must be read back per pass.
    timeline = Timeline()
    ms = 1_000_000
    for lo, hi, every, call in ((0, 10 * ms, 100_000, 5_000), (15 * ms, 25 * ms, 200_000, 20_000)):
        timeline.mark("python", "backward", lo, hi)
        for t in range(lo, hi, every):
            timeline.mark("CUDA API 11", "cudaLaunchKernel", t, t + call)
            timeline.mark("GPU stream 7", "gemm", t + call, t + call + every // 2)
            timeline.mark("torch ops", "aten::mm", t, t + 2 * call)
    timeline.mark("python", "step", 25 * ms, 26 * ms)
    path = tmp_path / "t.json"
    timeline.write(str(path))
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "timeline_stats.py"
    out = subprocess.run([sys.executable, str(script), str(path)], check=True, capture_output=True, text=True).stdout
    fed = [line.strip() for line in out.splitlines() if "launched by" in line]
    assert fed == ["launched by CUDA API 11: 100 launches, call 5.0 us, interval 100.0 us (mean 100.0)",
                   "launched by no launches",
                   "launched by CUDA API 11: 50 launches, call 20.0 us, interval 200.0 us (mean 200.0)"], out
    ops = [line.strip() for line in out.splitlines() if "costliest torch ops" in line]
    assert ops == ["costliest torch ops: aten::mm 1.0 ms (100)", "costliest torch ops: none",
                   "costliest torch ops: aten::mm 2.0 ms (50)"], out
