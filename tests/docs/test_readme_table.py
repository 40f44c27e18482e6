"""The README's performance table is the generator's output from the committed result files, unedited."""
from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _generator():
    spec = importlib.util.spec_from_file_location("readme_table", os.path.join(ROOT, "benchmarks", "readme_table.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_holds_exactly_the_table_generated_from_the_results_files() -> None:
    gen = _generator()
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    stale = "README.md's table is stale: python benchmarks/readme_table.py --write README.md"
    assert gen.replaced(readme) == readme, stale
    assert readme.count("| ") > 4 and "benchmarks/results/" in gen.table()


def test_the_readme_stays_short_and_links_only_inside_the_repository() -> None:
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert len(readme.splitlines()) <= 300
    assert "shared/" not in readme
    for target in ("docs/api.md", "docs/offload-train.md", "docs/memory-plan.md", "docs/design.md",
                   "docs/performance.md", "docs/history.md", "docs/install.md"):
        assert os.path.isfile(os.path.join(ROOT, target)), target


def _suite_file(root, run: str, date: str, rows: list[dict], device: str = "cuda") -> None:
    os.makedirs(os.path.join(root, run))
    with open(os.path.join(root, run, "suite_b1.json"), "w") as f:
        json.dump({"date": date, "args": {"device": device}, "rows": rows}, f)


def _suite_row(key: str, peer: str | None, step_s: float | None) -> dict:
    return {"key": key, "shape": "b1", "peer": peer, "step_s": step_s}


def test_each_row_comes_from_the_newest_gpu_file_where_it_and_its_peer_ran(tmp_path) -> None:
    gen = _generator()
    ran = [_suite_row("resident-plain", None, 0.2), _suite_row("plain", "resident-plain", 0.2)]
    _suite_file(tmp_path, "old", "2026-12-01T00:00:00+00:00", ran)
    _suite_file(tmp_path, "peer-failed", "2026-12-02T00:00:00+00:00",
                [_suite_row("resident-plain", None, None), _suite_row("plain", "resident-plain", 0.1)])
    _suite_file(tmp_path, "simulated", "2026-12-03T00:00:00+00:00", ran, device="cpu")
    assert gen.newest(gen.gpu_suites(str(tmp_path)), "b1", "plain")[0] == os.path.join("old", "suite_b1.json")
    _suite_file(tmp_path, "new", "2026-12-04T00:00:00+00:00", ran)
    assert gen.newest(gen.gpu_suites(str(tmp_path)), "b1", "plain")[0] == os.path.join("new", "suite_b1.json")
    with pytest.raises(SystemExit, match="holds a run of b1 row 'accum2'"):
        gen.newest(gen.gpu_suites(str(tmp_path)), "b1", "accum2")


def test_the_suite_s_table_rewrite_regenerates_the_readme_table_too() -> None:
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import suite

    gen = _generator()
    stale = f"# Title\n\n{gen.BEGIN}\n| a stale row |\n{gen.END}\n"
    assert suite.rewrite(stale, ".") == f"# Title\n\n{gen.BEGIN}\n{gen.table()}\n{gen.END}\n"


def _started(first_loss: float) -> dict:
    return {"rounds": [{"losses": [first_loss, first_loss - 0.5]}]}


def test_a_row_whose_first_loss_is_off_its_peer_s_is_flagged_as_other_weights() -> None:
    readme_table, peer = _generator(), _started(12.1084)
    assert readme_table.other_start(_started(12.2250), peer) == "first loss 12.2250 against 12.1084: other weights"
    # two dequantization paths of the same weights: 0.07 % apart, the same run
    assert readme_table.other_start(_started(12.1084 * (1 + 7e-4)), peer) is None
    assert readme_table.other_start({"rounds": [{"losses": []}]}, peer) is None  # a row without losses: no claim
