"""The performance suite: each row in a process of its own, rounds in alternating order, ratios per round against
the peer of the same round, and tables regenerated from the file their markers name."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
import suite  # noqa: E402

TINY = "--layers 2 --hidden 64 --intermediate 128 --heads 4 --kv-heads 2 --vocab 512 --batch 2 --seq 16"


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("suite")
    subprocess.run([sys.executable, str(BENCH / "suite.py"), "--preset", "b1", "--only", "clipreal", "--rounds", "2",
                    "--warmup", "1", "--steps", "2", "--device", "cpu", "--shape-args", TINY, "--out", str(out)],
                   check=True, capture_output=True, cwd=out)
    return out, json.loads((out / "suite_b1.json").read_text())


def test_a_row_brings_its_peer_and_each_round_runs_each_row_in_a_process_of_its_own(measured) -> None:
    out, result = measured
    rows = {r["key"]: r for r in result["rows"]}
    assert list(rows) == ["resident-clipreal", "clipreal"]  # the peer came with the row asked for
    ours, peer = rows["clipreal"], rows["resident-clipreal"]
    assert sorted(p.name for p in (out / "suite_b1").glob("*.json")) == [
        "clipreal-r1.json", "clipreal-r2.json", "resident-clipreal-r1.json", "resident-clipreal-r2.json"]
    assert [len(r["step_times_s"]) for r in ours["rounds"]] == [2, 2]
    assert ours["round_ratio"] == [a / b for a, b in zip(ours["round_step_s"], peer["round_step_s"])]
    assert all(r["host_rss_peak_gb"] > 0.1 for r in (ours, peer))  # the child's own peak, from the kernel
    assert ours["clipped_fraction"] is not None and ours["cap_gb"] is None


def test_both_sides_train_the_same_real_text_under_clip_one(measured) -> None:
    rows = {r["key"]: r for r in measured[1]["rows"]}
    ours, peer = rows["clipreal"]["rounds"][0], rows["resident-clipreal"]["rounds"][0]
    assert ours["args"]["data"] == "embedded" and ours["mode"] == "native-bf16-auto-clipreal"
    # bf16 on both sides, one step's rounding apart at most: the first loss is the same batch's
    assert ours["losses"][0] == pytest.approx(peer["losses"][0], rel=1e-2)


def test_a_marked_table_is_regenerated_from_the_file_its_marker_names(measured, tmp_path, monkeypatch) -> None:
    out, _ = measured
    monkeypatch.setattr(suite._common, "REPO_DIR", str(out))
    doc = out / "docs" / "perf.md"
    doc.parent.mkdir()
    doc.write_text("before\n<!-- suite-table:begin suite_b1.json -->\nstale\n<!-- suite-table:end -->\nafter\n")
    suite.write_tables(["docs/perf.md"])
    text = doc.read_text()
    assert "stale" not in text and text.startswith("before\n") and text.endswith("after\n")
    assert "[suite_b1.json](../suite_b1.json)" in text and "| clipreal | `native-bf16-auto-clipreal` | none |" in text
    assert f"host copy {json.loads((out / 'suite_b1.json').read_text())['host_copy_gb_s']:.0f} GB/s" in text
    assert suite.rewrite(text, "docs") == text  # regenerating again changes nothing


def test_a_row_s_spread_is_the_range_of_all_its_timed_steps_over_their_median(measured) -> None:
    row = next(r for r in measured[1]["rows"] if r["key"] == "clipreal")
    steps = [t for one in row["rounds"] for t in one["step_times_s"]]
    line = next(x for x in suite.rows_table([row]).splitlines() if x.startswith("| clipreal |"))
    rounds = ", ".join(f"{t:.4f}" for t in row["round_step_s"])
    assert f"| {row['step_s']:.4f} ({rounds}), {(max(steps) - min(steps)) / row['step_s']:.1%} |" in line


def test_a_second_suite_run_into_the_same_folder_reports_its_own_rows(tmp_path) -> None:
    for steps in ("1", "3"):
        subprocess.run([sys.executable, str(BENCH / "suite.py"), "--preset", "b1", "--only", "plain", "--rounds", "1",
                        "--warmup", "0", "--steps", steps, "--device", "cpu", "--shape-args", TINY,
                        "--out", str(tmp_path)], check=True, capture_output=True, cwd=tmp_path)
    second = json.loads((tmp_path / "suite_b1-2.json").read_text())
    assert second["jobs"] == "suite_b1-2"
    assert [len(r["rounds"][0]["step_times_s"]) for r in second["rows"]] == [3, 3]  # not the first run's one step


def test_an_unknown_row_is_refused_naming_the_rows_there_are() -> None:
    with pytest.raises(SystemExit, match="b2 has no row 'fast'; its rows: resident-plain, plain"):
        suite.selected("b2", "fast")


def test_an_fsdp_row_runs_under_torchrun_with_its_peers(tmp_path) -> None:
    shape = "--layers 2 --hidden 64 --intermediate 128 --heads 4 --kv-heads 2 --vocab 256 --batch 2 --seq 32"
    subprocess.run([sys.executable, str(BENCH / "suite.py"), "--preset", "fsdp", "--only", "fsdp-overlap-clip",
                    "--rounds", "1", "--warmup", "1", "--steps", "2", "--device", "cpu", "--shape-args", shape,
                    "--out", str(tmp_path)], check=True, capture_output=True, cwd=tmp_path,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    rows = {r["key"]: r for r in json.loads((tmp_path / "suite_fsdp.json").read_text())["rows"]}
    assert list(rows) == ["fsdp-resident", "fsdp-torchfused-clip", "fsdp-overlap-clip"]
    ours = rows["fsdp-overlap-clip"]
    assert "error" not in ours and len(ours["rounds"][0]["step_times_s"]) == 2
    assert ours["round_ratio"] == [ours["round_step_s"][0] / rows["fsdp-torchfused-clip"]["round_step_s"][0]]


def test_kept_layer_rows_run_beside_their_peers_with_offload_train_s_allocator(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
    subprocess.run([sys.executable, str(BENCH / "suite.py"), "--preset", "kept", "--only", "ckptnone,long-aoff",
                    "--rounds", "1", "--warmup", "0", "--steps", "1", "--device", "cpu", "--shape-args", TINY,
                    "--out", str(tmp_path)], check=True, capture_output=True, cwd=tmp_path, env=env)
    rows = {r["key"]: r for r in json.loads((tmp_path / "suite_kept.json").read_text())["rows"]}
    assert list(rows) == ["resident-ckptnone", "ckptnone", "long-uncapped", "long-aoff"]
    assert not [key for key, r in rows.items() if "error" in r]
    allocator = {key: json.loads((tmp_path / "suite_kept" / f"{key}-r1.json").read_text())["allocator"]
                 for key in rows}
    # layers kept (a resident run without checkpointing too) grow segments, as offload-train's do
    assert allocator == {"resident-ckptnone": "expandable_segments:True", "ckptnone": "expandable_segments:True",
                         "long-uncapped": None, "long-aoff": None}


def test_a_row_past_its_time_is_killed_and_its_row_says_so(tmp_path) -> None:
    done = subprocess.run([sys.executable, str(BENCH / "suite.py"), "--preset", "b1", "--only", "plain",
                           "--rounds", "1", "--steps", "1", "--warmup", "0", "--row-timeout", "0.5", "--device", "cpu",
                           "--shape-args", TINY, "--out", str(tmp_path)], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rows = {r["key"]: r for r in json.loads((tmp_path / "suite_b1.json").read_text())["rows"]}
    assert list(rows) == ["resident-plain", "plain"]
    assert all(r["error"] == "killed after --row-timeout 0.5 s" for r in rows.values())


def test_the_default_row_records_the_layout_the_engine_chose(tmp_path) -> None:
    subprocess.run([sys.executable, str(BENCH / "suite.py"), "--preset", "b1", "--only", "plain", "--rounds", "1",
                    "--steps", "1", "--warmup", "0", "--device", "cpu", "--shape-args", TINY, "--out", str(tmp_path)],
                   check=True, capture_output=True, cwd=tmp_path)
    row = json.loads((tmp_path / "suite_b1" / "plain-r1.json").read_text())["rows"][0]
    # the simulated device has no GPU figure to plan with: none resident, two buffers (auto_layout's fallback)
    assert row["mode"] == "native-bf16-auto" and row["layout"] == {"resident_layers": 0, "device_layers": 2}


def test_a_row_s_host_memory_is_what_its_process_plans_with(tmp_path) -> None:
    # the 8 B 8-bit row is defined at 64 GB of host: its process must plan with that, not the machine's
    assert {r.key: r.host_gb for r in suite.PRESETS["b2"]}["8bit-clipreal"] == 64.0
    a = suite.parse(["--preset", "b1", "--device", "cpu", "--warmup", "0", "--steps", "1", "--shape-args", TINY])
    small = suite.Row("small-host", "b1", "native-bf16-clipreal", host_gb=1e-4)  # 100 kB: the tiny shape needs more
    got = suite.run_row(small, a, str(tmp_path), 1)
    assert "MemoryError" in got.get("error", ""), got


def test_a_row_s_allocator_settings_are_the_ones_its_process_starts_with(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)  # an earlier offload-train run's, in this process
    assert {r.key: r.alloc_conf for r in suite.PRESETS["b2"]}["handpicked-r6-xseg-clipreal"] == \
        "expandable_segments:True"
    a = suite.parse(["--preset", "b1", "--device", "cpu", "--warmup", "0", "--steps", "1", "--shape-args", TINY])
    for key, conf in (("cached", None), ("grown", "expandable_segments:True")):
        got = suite.run_row(suite.Row(key, "b1", "native-bf16", alloc_conf=conf), a, str(tmp_path), 1)
        assert "error" not in got, got
        assert json.loads((tmp_path / f"{key}-r1.json").read_text())["allocator"] == conf


def test_every_row_of_every_preset_names_a_mode_its_benchmark_knows() -> None:
    import bench_train

    modes = [r.mode for rows in suite.PRESETS.values() for r in rows if not r.fsdp]
    assert "native-bf16-auto-dr16-clipreal" in modes  # B2's hand-picked row
    for mode in modes:
        bench_train.Mode.parse(mode)  # an unknown suffix exits naming it


@pytest.mark.parametrize("mode", ["deepspeed2-bf16-tuned-zenflow-clipreal",
                                  "deepspeed-bf16-tuned-superoffload-clipreal"])
def test_newer_deepspeed_engines_in_bf16_are_refused_naming_the_mode_that_runs(mode: str) -> None:
    import bench_train

    # DeepSpeed 0.19 asserts in initialize that bf16 master weights go with DeepSpeedCPUAdam, not ZenFlowCPUAdam;
    # SuperOffload's worker fails in the first step, setting an fp32 gradient on a bf16 master
    mixed = mode.replace("bf16", "mixed")
    with pytest.raises(SystemExit, match=f"run it in mixed: {mixed}$"):
        bench_train.Mode.parse(mode)
    assert bench_train.Mode.parse(mixed).precision == "mixed"


def _left_running(marker: str) -> list[str]:
    """The command lines of live processes that name `marker` (zombies excluded)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:  # gone meanwhile
            continue
        if marker in cmd and state != "Z" and int(pid) != os.getpid():
            found.append(cmd)
    return found


def test_a_row_killed_at_its_time_takes_the_processes_it_started_with_it(tmp_path) -> None:
    # torchrun spawns its rank within ~2 s; the rank needs ~7 s here. Killed at 4 s, the rank must not outlive it
    # (on the GPU machine such a rank held 66 GB of host and 23 GB of GPU while the next rows ran)
    shape = "--layers 2 --hidden 64 --intermediate 128 --heads 4 --kv-heads 2 --vocab 256 --batch 2 --seq 32"
    done = subprocess.run([sys.executable, str(BENCH / "suite.py"), "--preset", "fsdp", "--only", "fsdp-resident",
                           "--rounds", "1", "--warmup", "1", "--steps", "2", "--row-timeout", "4", "--device", "cpu",
                           "--shape-args", shape, "--out", str(tmp_path)], capture_output=True, text=True,
                          cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    row = json.loads((tmp_path / "suite_fsdp.json").read_text())["rows"][0]
    assert row["error"] == "killed after --row-timeout 4 s"
    assert _left_running(str(tmp_path)) == []


def test_a_suite_stopped_by_sigterm_writes_the_rounds_measured_before_it(tmp_path) -> None:
    proc = subprocess.Popen([sys.executable, str(BENCH / "suite.py"), "--preset", "b1", "--only", "plain",
                             "--rounds", "2", "--warmup", "0", "--steps", "1", "--device", "cpu", "--shape-args", TINY,
                             "--out", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=tmp_path)
    second = tmp_path / "suite_b1" / "plain-r1.log"  # made as round 1's second row starts, the first one done
    deadline = time.monotonic() + 300
    while not second.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, output
    rows = {r["key"]: r for r in json.loads((tmp_path / "suite_b1.json").read_text())["rows"]}
    assert len(rows["resident-plain"]["rounds"]) == 1 and "error" not in rows["resident-plain"]
    assert rows["plain"]["error"] == "not run: the suite was stopped (SIGTERM) before this row"
    assert "stopped (SIGTERM) in round 1 at plain" in output
    assert _left_running(str(tmp_path)) == []
