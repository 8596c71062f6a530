"""The bundled list of known upstream (transformers) faults, keyed by version range → item pattern → reason.

Data lives in ``known_faults.toml`` next to this module. ``match(...)`` returns the reason for an item, or None.
"""

from __future__ import annotations

import fnmatch
import tomllib
from dataclasses import dataclass
from pathlib import Path

FAULTS_FILE = Path(__file__).with_name("known_faults.toml")


@dataclass(frozen=True)
class KnownFault:
    """One entry: the affected ``transformers`` versions (PEP 440 specifier) and fnmatch patterns per field."""

    transformers: str
    reason: str
    subject: tuple = ("*",)
    model: tuple = ("*",)
    check: tuple = ("*",)
    case: tuple = ("*",)

    def matches(self, version, **fields) -> bool:
        from packaging.specifiers import SpecifierSet

        if version not in SpecifierSet(self.transformers):
            return False
        return all(any(fnmatch.fnmatchcase(fields[k], p) for p in getattr(self, k)) for k in fields)


def _patterns(value) -> tuple:
    return (value,) if isinstance(value, str) else tuple(value)


def load_known_faults(path=FAULTS_FILE) -> list[KnownFault]:
    """Parse the faults file. Raises ``ValueError`` naming the entry on a malformed one."""
    with open(path, "rb") as fh:
        data = tomllib.load(fh)
    faults = []
    for i, raw in enumerate(data.get("fault", [])):
        try:
            faults.append(KnownFault(
                transformers=raw["transformers"], reason=" ".join(raw["reason"].split()),
                **{k: _patterns(raw[k]) for k in ("subject", "model", "check", "case") if k in raw},
            ))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{path}: fault #{i}: {exc}") from None
    return faults


def match(faults, version, subject: str, model: str, check: str, case: str) -> str | None:
    """The reason of the first fault matching this item on ``version``, or None."""
    for fault in faults:
        if fault.matches(version, subject=subject, model=model, check=check, case=case):
            return fault.reason
    return None
