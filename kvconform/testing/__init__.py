"""Faulty caches that kvconform must catch, and helpers for users' own meta-tests.

Every ``kvconform/testing/faulty_*.py`` module defines ``FAULTY``: a list of ``FaultyCache`` entries, each one
small realistic bug. ``tests/caches/test_faulty_caches.py`` runs each through the plugin and proves it is caught by the
check it targets, with its message pinned. ``faulty_caches()`` collects them all.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass


@dataclass(frozen=True)
class FaultyCache:
    """One faulty cache.

    Attributes:
        name: short id (``hidden_window_16``).
        attr: attribute name of the cache class / factory in ``module`` (what ``--kvconform-cache`` names).
        module: the module holding it (``kvconform.testing.faulty_logits``).
        family: the check family that must catch it.
        check: the check that must fail.
        model: the zoo model on which the fault shows.
        message: substrings the failure message must contain (pinned by the meta-tests).
        also_caught_by: other families that legitimately fail too (a fault visible everywhere), documented.
        case: optional case id to narrow the run (``-k``), default: all cases of the check.
        cause: a regular expression the failure's ``likely cause:`` line must match (``re.search``) — the diagnosis
            the fault must get, pinned by ``tests/caches/test_faulty_caches.py``; every faulty cache has one.
    """

    name: str
    attr: str
    module: str
    family: str
    check: str
    model: str
    message: tuple = ()
    also_caught_by: tuple = ()
    case: str = ""
    cause: str = ""

    @property
    def spec(self) -> str:
        """The ``--kvconform-cache`` spec of this cache."""
        return f"{self.module}:{self.attr}"

    def load(self):
        return getattr(importlib.import_module(self.module), self.attr)


def faulty_caches() -> list[FaultyCache]:
    """Every ``FaultyCache`` of every ``kvconform.testing`` module that lists them (``FAULTY``: the ``faulty_*``
    modules, and the modules of bundled correct caches with their faulty variants), sorted by name."""
    out = []
    for module in pkgutil.iter_modules(__path__):
        out.extend(getattr(importlib.import_module(f"{__name__}.{module.name}"), "FAULTY", []))
    return sorted(out, key=lambda f: f.name)
