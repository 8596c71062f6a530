"""The documentation (README.md, docs/, mkdocs.yml) held to the code: docs/layout.md names every module under
kvconform/ and only paths that exist, its layer tables (and ARCHITECTURE.md's) are the import contracts of
pyproject.toml in their order, the site's nav holds every page, README.md's links reach pages that exist, and the
site builds with ``mkdocs build --strict``."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = ROOT / "docs" / "layout.md"


def contracts() -> dict[str, list[list[str]]]:
    """``{container: [[module, ...] per layer, top to bottom]}`` of pyproject.toml's ``layers`` contracts."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    out = {}
    for contract in data["tool"]["importlinter"]["contracts"]:
        if contract["type"] == "layers":
            (container,) = contract["containers"]
            out[container] = [[m.strip() for m in re.split(r"[|:]", layer)] for layer in contract["layers"]]
    return out


def listing() -> list[str]:
    """The paths named in docs/layout.md's listing (the first fenced block): each line's first word."""
    block = re.search(r"^```\n(.*?)^```", LAYOUT.read_text(), re.S | re.M).group(1)
    return [line.split()[0] for line in block.splitlines() if line and not line[0].isspace()]


def tables(text: str) -> list[list[list[str]]]:
    """Every ``| layer | modules | ... |`` table of a Markdown text: per row, the modules column's names (backticked,
    ``suite/`` and ``checks/<family>.py`` read as ``suite`` and ``checks``)."""
    out, current = [], None
    for line in text.splitlines():
        if re.match(r"^\| layer \| modules \|", line):
            current = []
            out.append(current)
        elif current is not None and line.startswith("|"):
            if not line.startswith("|---"):
                cells = [c.strip() for c in line.strip("|").split("|")]
                current.append([name.split("/")[0] for name in re.findall(r"`([^`]+)`", cells[1])])
        else:
            current = None
    return out


def test_layout_names_every_module_and_only_paths_that_exist():
    named = listing()
    assert len(named) == len(set(named)), [p for p in named if named.count(p) > 1]
    missing_paths = [p for p in named if not (ROOT / p).exists()]
    assert not missing_paths, f"docs/layout.md names paths that do not exist: {missing_paths}"
    modules = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "kvconform").rglob("*.py"))
    unnamed = [m for m in modules if m not in named
               and not (m.endswith("/__init__.py") and m[: -len("__init__.py")] in named)]
    assert not unnamed, f"modules under kvconform/ that docs/layout.md does not name: {unnamed}"
    # a package is named by its folder (its __init__.py) as well as by its modules
    packages = sorted({p.parent.relative_to(ROOT).as_posix() + "/" for p in (ROOT / "kvconform").rglob("__init__.py")})
    assert all(p in named for p in packages if p != "kvconform/"), [p for p in packages if p not in named]


def test_layout_layer_tables_are_the_import_contracts_in_their_order():
    layers = contracts()
    top, checks = tables(LAYOUT.read_text())
    assert top == layers["kvconform"], (top, layers["kvconform"])
    assert checks == layers["kvconform.checks"], (checks, layers["kvconform.checks"])


def test_architecture_layer_table_lists_the_contracts_modules_in_their_order():
    """ARCHITECTURE.md's table may put two adjacent layers in one row; its modules, read top to bottom, are the
    contract's."""
    (table,) = tables((ROOT / "ARCHITECTURE.md").read_text())
    flat = [m for row in table for m in row]
    assert flat == [m for layer in contracts()["kvconform"] for m in layer], flat


def test_the_site_nav_holds_every_page_and_readme_links_reach_pages():
    nav = re.findall(r"^\s+- [^:]+: (\S+\.md)$", (ROOT / "mkdocs.yml").read_text(), re.M)
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert sorted(nav) == pages, (nav, pages)
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", readme)
    assert {f"docs/{p}" for p in pages} <= set(links), "README.md's 'Where to go next' misses a page"
    assert all((ROOT / link).is_file() for link in links), [link for link in links if not (ROOT / link).is_file()]
    assert len(readme.splitlines()) <= 300, "README.md is the front door: 300 lines at most, the rest in docs/"


def test_the_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is in the dev extra (pip install -e '.[dev]')")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "layout" / "index.html").is_file() and (tmp_path / "index.html").is_file()
