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
