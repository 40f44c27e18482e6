"""The README's performance table is the generator's output from the committed result files, unedited."""
from __future__ import annotations

import importlib.util
import os

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
