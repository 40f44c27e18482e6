"""The documentation against the code and the tree: every public name has its entry in docs/api.md, the README
stays short, every relative link lands on a file (and heading) that exists, the generated configuration
reference in docs/api.md is what scripts/config_doc.py prints now, and docs/design.md's file map names every
module of the Python package and no other."""
from __future__ import annotations

import importlib.util
import inspect
import re
from pathlib import Path
from types import ModuleType

import offload_ext

ROOT = Path(__file__).resolve().parents[2]
API = ROOT / "docs" / "api.md"
DESIGN = ROOT / "docs" / "design.md"
PACKAGE = ROOT / "python" / "offload_ext"
LINKED_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md",
               ROOT / "benchmarks" / "results" / "README.md"]

# An entry documents one name: a line that starts with "### ", "- **" or "**", then the name in backquotes,
# alone or followed by its signature: "### `plan(model_or_config, ...)`", "- **`stacks`**", "**`OffloadConfig`**".
ENTRY = re.compile(r"^(?:### |- \*\*|\*\*)`(?P<name>[A-Za-z_][\w.]*)[`(]")
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(?P<text>.+?)\s*#*\s*$", re.MULTILINE)


def _entries(text: str) -> dict[str, str]:
    """Each documented name -> its section: the entry line and what follows up to the next entry or heading."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        match = ENTRY.match(line)
        if match:
            current = sections.setdefault(match["name"], [])
        elif line.startswith("#"):
            current = None
        if current is not None:
            current.append(line)
    return {name: "\n".join(lines) for name, lines in sections.items()}


def _named_parameters(obj: object) -> list[str]:
    """The parameters a caller may name (no *args / **kwargs); none for a module or a plain value."""
    if isinstance(obj, ModuleType) or not callable(obj):
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
             inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in inspect.signature(obj).parameters.values() if p.kind in kinds]


def test_every_public_name_has_an_entry_in_api_md_naming_each_of_its_parameters() -> None:
    entries = _entries(API.read_text())
    missing = [name for name in offload_ext.__all__ if name not in entries]
    assert not missing, f"docs/api.md has no entry (### `NAME`, - **`NAME`** or **`NAME`**) for {missing}"
    unnamed = {name: [p for p in _named_parameters(getattr(offload_ext, name))
                      if not re.search(rf"\b{re.escape(p)}\b", entries[name])]
               for name in offload_ext.__all__}
    unnamed = {name: params for name, params in unnamed.items() if params}
    assert not unnamed, f"docs/api.md's entries do not name these parameters: {unnamed}"


def test_the_configuration_reference_in_api_md_is_the_generated_one() -> None:
    spec = importlib.util.spec_from_file_location("config_doc", ROOT / "scripts" / "config_doc.py")
    config_doc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(config_doc)
    text = API.read_text()
    start, stop = text.find(config_doc.BEGIN), text.find(config_doc.END)
    assert 0 <= start < stop, "docs/api.md has no configuration markers: its '## Configuration' section holds them"
    stale = "docs/api.md's configuration reference is stale: python scripts/config_doc.py --write docs/api.md"
    assert text[start:stop + len(config_doc.END)] == config_doc.reference(), stale


def test_the_readme_is_at_most_300_lines() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lower-cased, punctuation dropped, spaces turned into hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    """Every anchor GitHub gives the headings of a markdown file (a repeated heading gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    anchors = set()
    for match in HEADING.finditer(FENCE.sub("", path.read_text())):
        slug = _slug(match["text"])
        anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def _relative_links(path: Path) -> list[str]:
    """The link and image targets of a markdown file outside code, less those with a scheme (http:, mailto:)."""
    text = CODE_SPAN.sub("", FENCE.sub("", path.read_text()))
    return [m["target"] for m in LINK.finditer(text) if not re.match(r"^[a-z][a-z0-9+.-]*:", m["target"])]


def _broken(doc: Path, target: str) -> str | None:
    """Why `target`, linked from `doc`, does not resolve; None when it lands on a file (and heading) of the repo."""
    file_part, _, anchor = target.partition("#")
    resolved = (doc.parent / file_part).resolve() if file_part else doc
    if not resolved.is_relative_to(ROOT):
        return "outside the repository"
    if not resolved.exists():
        return "no such file"
    if anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
        return f"no heading #{anchor} there"
    return None


def test_every_relative_link_in_the_readme_and_docs_lands_on_a_file_that_exists() -> None:
    broken = [f"{doc.relative_to(ROOT)}: {target} ({why})"
              for doc in LINKED_DOCS for target in _relative_links(doc)
              if (why := _broken(doc, target)) is not None]
    assert not broken, "\n".join(broken)
    assert any(_relative_links(doc) for doc in LINKED_DOCS)


def _python_file_map() -> str:
    """design.md's table of the Python package: from its heading up to the next heading of the file map."""
    text = DESIGN.read_text()
    start = text.index("### The Python package")
    return text[start:text.index("\n### ", start + 1)]


def test_the_file_map_in_design_md_names_every_python_module_and_no_other() -> None:
    modules = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
               if "csrc" not in p.parts and (p.name != "__init__.py" or p.parent == PACKAGE)}
    mapped = set(re.findall(r"^\| `([\w/]+\.py)` \|", _python_file_map(), re.MULTILINE))
    assert not modules - mapped, f"docs/design.md's file map lacks {sorted(modules - mapped)}"
    assert not mapped - modules, f"docs/design.md's file map names modules that are gone: {sorted(mapped - modules)}"
