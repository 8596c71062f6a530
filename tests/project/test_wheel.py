"""Packaging: the built wheel, installed into a fresh virtual environment, runs ``pytest --kvconform`` from an empty
folder and finds its case files (package data mapped from the repository's top-level ``conformance_cases/``).

The fresh environment reaches this environment's packages (torch, transformers, pytest...) through a ``.pth``
file — ``--system-site-packages`` does not chain through virtual environments — so nothing is downloaded; the
wheel is installed with ``--no-index --no-deps`` and every dependency it declares must then be importable in range.
``.ci/run`` repeats the check in a truly fresh environment holding only the README's dependencies.

Marked ``wheel`` (under 2 minutes on 2 cores; deselect with ``-m "not wheel"``); it fails, never skips, when the
wheel cannot be built or installed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "kvconform", "conformance_cases")


def _run(cmd, cwd, env, timeout=600):
    result = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, (f"{' '.join(map(str, cmd))} exited {result.returncode}\n"
                                    f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return result


def _clean_env():
    """This process's environment without anything that would import the checkout instead of the wheel."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["PIP_NO_INDEX"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.setdefault("KVCONFORM_THREADS", "1")
    return env


def _copy_sources(tmp: Path) -> Path:
    """A copy of what the wheel is built from, so the checkout stays free of build/ and egg-info folders."""
    src = tmp / "src"
    src.mkdir(parents=True)
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(REPO / name, src / name)
    return src


def _build_wheel(tmp: Path, env) -> Path:
    src = _copy_sources(tmp)
    dist = tmp / "dist"
    try:
        import build  # noqa: F401  (pip install kvconform[dev])

        cmd = [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", dist, src]
    except ImportError:
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", dist, src]
    _run(cmd, cwd=tmp, env=env)
    wheels = sorted(dist.glob("kvconform-*.whl"))
    assert len(wheels) == 1, f"expected one wheel in {dist}, found {wheels}"
    return wheels[0]


def _fresh_venv(tmp: Path) -> Path:
    """A new virtual environment whose site-packages chains to this one's (a ``.pth`` line), returning its python."""
    env_dir = tmp / "venv"
    venv.EnvBuilder(with_pip=False, clear=True).create(env_dir)  # pip (and setuptools) come through the .pth
    python = env_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "_kvconform_test_parent.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


# Run in the fresh environment: every dependency the wheel declares (no extras) is installed there, in range.
_REQUIREMENTS_MET = """
from importlib.metadata import distribution, version, PackageNotFoundError
from packaging.requirements import Requirement
problems = []
for text in distribution("kvconform").requires or []:
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    try:
        found = version(req.name)
    except PackageNotFoundError:
        problems.append(f"{req} not installed")
        continue
    if not req.specifier.contains(found, prereleases=True):
        problems.append(f"{req}: {found} installed")
assert not problems, problems
"""


def test_every_package_is_listed_in_pyproject():
    """pyproject lists the packages by hand (package discovery cannot map conformance_cases/): a new subpackage of
    kvconform/ must be added there, or the wheel would ship without it."""
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "kvconform").rglob("__init__.py")}
    assert on_disk <= listed, f"add {sorted(on_disk - listed)} to [tool.setuptools] packages in pyproject.toml"
    assert "kvconform.conformance_cases" in listed


@pytest.mark.wheel
def test_wheel_runs_the_suite_from_an_empty_folder(tmp_path):
    env = _clean_env()
    wheel = _build_wheel(tmp_path, env)
    python = _fresh_venv(tmp_path)
    # --ignore-installed: this environment's own kvconform (an editable install, say) is visible through the .pth;
    # install beside it, never uninstalling it.
    _run([python, "-m", "pip", "install", "--no-index", "--no-deps", "--ignore-installed", wheel], cwd=tmp_path,
         env=env)
    _run([python, "-c", _REQUIREMENTS_MET], cwd=tmp_path, env=env)

    where = _run([python, "-c", "import kvconform, kvconform.cases as c; "
                                "print(kvconform.__file__); print(c.builtin_cases_dir())"], cwd=tmp_path, env=env)
    package_file, cases_dir = (Path(line) for line in where.stdout.split())
    venv_dir = (tmp_path / "venv").resolve()
    assert venv_dir in package_file.resolve().parents, f"kvconform imported from {package_file}, not the wheel"
    assert cases_dir.resolve() == package_file.resolve().parent / "conformance_cases"
    assert sorted(p.name for p in cases_dir.glob("*.toml")) == sorted(p.name for p in
                                                                      (REPO / "conformance_cases").glob("*.toml"))

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    report = tmp_path / "report.json"
    # Speed items are left out: their budgets are ratios timed on this shared machine (tests/perf/test_perf.py covers
    # them), and a noisy ratio must not decide whether the package works. One subject (the reference cache runs every
    # family) in process: what is tested here is the package and its case files; the whole default run from the built
    # wheel, in its workers, is .ci/run's stage "main job from the built wheel" (~40 s more here for the same answer).
    result = _run([python, "-m", "pytest", "--kvconform", "--kvconform-model", "llama", "-p", "no:cacheprovider",
                   "-q", "-m", "not kvconform_speed", "-k", "ReferenceCache", "-n", "0", "--kvconform-json", report],
                  cwd=run_dir, env=env)
    results = json.loads(report.read_text())["results"]
    assert len(results) > 60, f"only {len(results)} items: case files missing?\n{result.stdout[-2000:]}"
    assert {r["model"] for r in results} == {"llama"}
    families = {r["family"] for r in results}
    assert {"logits", "generate", "crop", "prefix", "batch", "lifecycle", "contract", "coverage"} <= families
    assert any(r["outcome"] == "passed" for r in results)


@pytest.mark.wheel
def test_editable_install_finds_the_checkout_case_files(tmp_path):
    """``pip install -e``: the package data mapping cannot be imported from the checkout (conformance_cases/ has no
    ``__init__.py``), so kvconform.cases finds the folder beside the package folder."""
    env = _clean_env()
    src = _copy_sources(tmp_path)
    python = _fresh_venv(tmp_path)
    _run([python, "-m", "pip", "install", "--no-index", "--no-deps", "--ignore-installed", "--no-build-isolation",
          "-e", src], cwd=tmp_path, env=env)
    where = _run([python, "-c", "import kvconform, kvconform.cases as c; "
                                "print(kvconform.__file__); print(c.builtin_cases_dir()); print(len(c.load_cases()))"],
                 cwd=tmp_path, env=env)
    package_file, cases_dir, count = where.stdout.split()
    assert Path(package_file) == src / "kvconform" / "__init__.py"
    assert Path(cases_dir) == src / "conformance_cases"
    assert int(count) > 50
