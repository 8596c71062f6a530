"""The root of kvconform's exceptions, and the outcome exceptions raised below the checks layer.

Every exception kvconform raises on purpose derives from ``KVConformError`` (``except KVConformError`` catches them
all), each keeping the base its callers rely on:

* usage errors (``UsageError``; the run stops with exit code 4): ``subjects.SpecError``, ``cases.CaseFileError``,
  ``known_faults.KnownFaultsError`` — also ``ValueError`` s;
* conformance failures: ``checks.ConformanceError`` (also an ``AssertionError``, so pytest and the xfail of a known
  fault treat it as a test failure), ``checks.Unexcused`` and ``checks.SubjectNotBuilt`` (deliberately *not*
  ``AssertionError`` s: no xfail excuses them), ``checks.KnownFaultShown``;
* skips: ``CheckSkipped``;
* a subject's own faults, reported on its items: ``subjects.SubjectBuildError``, ``subjects.FactoryResultError``
  (also a ``TypeError``), ``subjects.ModelLeftChanged`` (also a ``RuntimeError``), ``checks._drive.SubjectRaised``;
* control flow inside a check: ``checks.fuzz.ProgramFailed`` (``checks._interpreter.StopRun`` joins when the op
  interpreter is next edited).

One exception stays outside: ``session.ItemTimeout`` is a ``BaseException`` so that no ``except Exception`` around a
subject call swallows the per-item timeout.

Bottom of the import layers (see ARCHITECTURE.md and ``[tool.importlinter]`` in pyproject.toml): it imports
nothing, so ``timing`` (which raises ``CheckSkipped`` when benchmarking is disabled) need not import ``checks``.
``kvconform.checks`` re-exports ``CheckSkipped``; the suite and ``run_check`` catch it from there.
"""

from __future__ import annotations


class KVConformError(Exception):
    """The root of every exception kvconform raises on purpose (see the module docstring)."""


class UsageError(KVConformError):
    """Bad input from the user (a spec, a case file, a known-faults file): the run stops with exit code 4 and
    ``str(err)`` names the input and the fix."""


class CheckSkipped(KVConformError):
    """A check found at run time that it cannot measure here (e.g. benchmarking is disabled). The suite reports
    the item as skipped with ``str(err)`` as the reason — never as passed."""


def with_article(word: str) -> str:
    """``word`` with its indefinite article, for messages naming a type: ``"an int"``, ``"a str"``, ``"an
    OffloadedCache"`` (by the first letter: a vowel takes "an")."""
    return f"{'an' if word[:1].lower() in 'aeiou' else 'a'} {word}"


# ------------------------------------------------------------------------------------------------ breadcrumbs
# Where a process is: the item it runs and the last op it started, kept in a small file that outlives the process.
# A subject that kills its process (a segfault or abort in a native kernel, os._exit, the OOM killer's SIGKILL) leaves
# no Python traceback; the pytest-xdist controller reads the crashed worker's file to name the item's last op
# (kvconform.plugin, "crashes"). One pwrite of a fixed-size record per op: nothing is lost when the process dies
# right after, since the kernel holds the data.
_BREADCRUMB = {"fd": None}
BREADCRUMB_SIZE = 1024


def open_breadcrumbs(path: str) -> None:
    """Record this process's breadcrumbs in ``path`` (created, or truncated)."""
    import os

    close_breadcrumbs()
    _BREADCRUMB["fd"] = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)


def close_breadcrumbs() -> None:
    import os

    fd, _BREADCRUMB["fd"] = _BREADCRUMB["fd"], None
    if fd is not None:
        os.close(fd)


def breadcrumb(op: str, item: str | None = None) -> None:
    """Record ``op`` (``"decode 6"``, ``"generate(max_new_tokens=12)"``) as the last op started, and ``item`` (an
    item id) when a new item starts. A no-op unless ``open_breadcrumbs`` was called in this process."""
    import os

    fd = _BREADCRUMB["fd"]
    if fd is None:
        return
    if item is not None:
        _BREADCRUMB["item"] = item
    text = f"{_BREADCRUMB.get('item', '')}\n{op}".encode("utf-8", "replace")[:BREADCRUMB_SIZE]
    os.pwrite(fd, text.ljust(BREADCRUMB_SIZE, b"\0"), 0)


def read_breadcrumbs(path: str) -> tuple[str, str] | None:
    """``(item id, last op started)`` recorded in ``path``, or None when there is none."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(BREADCRUMB_SIZE).rstrip(b"\0").decode("utf-8", "replace")
    except OSError:
        return None
    if not data:
        return None
    item, _, op = data.partition("\n")
    return item, op
