"""Outcome exceptions raised below the checks layer.

Bottom of the import layers (see ARCHITECTURE.md and ``[tool.importlinter]`` in pyproject.toml): it imports
nothing, so ``timing`` (which raises ``CheckSkipped`` when benchmarking is disabled) need not import ``checks``.
``kvconform.checks`` re-exports ``CheckSkipped``; the suite and ``run_check`` catch it from there.
"""

from __future__ import annotations


class CheckSkipped(Exception):
    """A check found at run time that it cannot measure here (e.g. benchmarking is disabled). The suite reports
    the item as skipped with ``str(err)`` as the reason — never as passed."""


def with_article(word: str) -> str:
    """``word`` with its indefinite article, for messages naming a type: ``"an int"``, ``"a str"``, ``"an
    OffloadedCache"`` (by the first letter: a vowel takes "an")."""
    return f"{'an' if word[:1].lower() in 'aeiou' else 'a'} {word}"
