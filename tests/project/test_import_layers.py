"""The import contract of pyproject.toml (``[tool.importlinter]``): kvconform's modules form layers without
back-edges, function-level imports included. ``lint-imports`` is run in a subprocess (it imports no kvconform
code: grimp parses the sources), so a new upward import or import cycle fails ``pytest tests``."""

import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("importlinter", reason="import-linter is in the dev extra: pip install -e .[dev]")

ROOT = pathlib.Path(__file__).resolve().parents[2]


def lint_imports(package_parent: pathlib.Path, config: pathlib.Path) -> subprocess.CompletedProcess:
    """Run ``lint-imports --config config`` with ``package_parent`` (the folder holding ``kvconform/``) first on
    the import path; returns the finished process (exit status 0: every contract kept, 1: one broken)."""
    env = dict(os.environ, PYTHONPATH=str(package_parent))
    code = ("import sys; from importlinter.cli import lint_imports; "
            "sys.exit(lint_imports(config_filename=sys.argv[1], no_cache=True, no_logo=True))")
    return subprocess.run([sys.executable, "-c", code, str(config)], capture_output=True, text=True, env=env,
                          cwd=package_parent, timeout=300)


def test_import_contracts_are_kept():
    result = lint_imports(ROOT, ROOT / "pyproject.toml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 3 kept, 0 broken." in result.stdout, result.stdout


@pytest.mark.parametrize("module,back_edge,broken", [
    ("quant.py", "from kvconform.checks import _judge", "kvconform.quant is not allowed to import kvconform.checks"),
    ("timing.py", "from kvconform.checks import CheckSkipped",
     "kvconform.timing is not allowed to import kvconform.checks"),
    ("checks/_twin.py", "from kvconform.checks._interpreter import run_ops",
     "kvconform.checks._twin is not allowed to import kvconform.checks._interpreter"),
    ("checks/speed.py", "from kvconform.checks.compile import check_compile_claim",
     "kvconform.checks.speed is not allowed to import kvconform.checks.compile"),
], ids=["quant->checks", "timing->checks", "_twin->_interpreter", "family->family"])
def test_an_upward_import_breaks_the_contract(tmp_path, module, back_edge, broken):
    """The back-edges this contract was written to remove, put back in a copy of the package (inside a function:
    grimp sees function-level imports too), each break it."""
    shutil.copytree(ROOT / "kvconform", tmp_path / "kvconform")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    with open(tmp_path / "kvconform" / module, "a") as f:
        f.write(textwrap.dedent(f"""

            def _back_edge():
                {back_edge}
            """))
    result = lint_imports(tmp_path, tmp_path / "pyproject.toml")
    assert result.returncode == 1, result.stdout + result.stderr
    assert broken in result.stdout, result.stdout
