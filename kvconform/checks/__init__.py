"""Checks: plain functions ``check_<property>(ctx) -> None`` that raise ``ConformanceError``.

Checks do not depend on pytest: the suite, ``check_cache`` and ``parametrize_with_checks`` all call them through
``run_check``. Each check is registered with its family (the matrix column) and the capabilities it needs.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

from kvconform.outcomes import CheckSkipped  # noqa: F401 - re-exported: the suite catches it from here


class ConformanceError(AssertionError):
    """A subject does not conform. ``str(err)`` is the DESIGN §7 message; ``metrics`` is JSON-serialisable
    (``max_abs`` logits units, ``tolerance``, ``noise_floor``, ...)."""

    def __init__(self, message: str, metrics: dict | None = None):
        super().__init__(message)
        self.metrics = metrics or {}


@dataclass(frozen=True)
class CheckInfo:
    """A registered check: ``fn(ctx)``, its ``family`` and the subject ``capabilities`` it needs."""

    name: str
    fn: Callable
    family: str
    needs: frozenset = frozenset()
    doc: str = ""


CHECKS: dict[str, CheckInfo] = {}
FAMILIES = ("logits", "generate", "crop", "prefix", "batch", "lifecycle", "contract", "fuzz", "quality",
            "coverage", "compile", "memory", "speed")
"""Check families in matrix-column order. A check registered under another family is appended after these."""


def register(family: str, needs=()):
    """Decorator registering ``check_*`` functions under ``family``."""

    def deco(fn):
        CHECKS[fn.__name__] = CheckInfo(fn.__name__, fn, family, frozenset(needs), (fn.__doc__ or "").strip())
        return fn

    return deco


def load_checks() -> dict[str, CheckInfo]:
    """Import every public module of this package (each registers its checks) and return the registry."""
    import pkgutil

    for module in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not module.name.startswith("_"):
            importlib.import_module(f"{__name__}.{module.name}")
    return CHECKS


@dataclass
class CheckContext:
    """Everything one item needs.

    Attributes:
        subject: the ``CacheSpec`` under test.
        model: the ``ZooModel`` at the case dtype.
        case: the ``Case``.
        oracle: the model's ``Oracle`` (memoised float64 logits).
        reference: the ``CacheSpec`` used to tell model faults from cache faults.
        metrics: filled by the check (JSON-serialisable), reported even on success.
        check_name: the running check's name (set by ``run_check``).
        known_fault: the bundled known-upstream-fault reason matching this item, if any (named in the message).
        full: True under ``--kvconform-full`` (checks may then use their heavier profile).
        benchmark: the pytest-benchmark fixture for ``speed`` items when the plugin is installed, else None
            (``kvconform.timing`` then times with its own loop).
    """

    subject: object
    model: object
    case: object
    oracle: object
    reference: object = None
    metrics: dict = field(default_factory=dict)
    check_name: str = ""
    known_fault: str | None = None
    full: bool = False
    benchmark: object = None

    def tolerance(self):
        from kvconform.oracle import DEFAULT_ABS_MIN, DEFAULT_FACTOR, Tolerance

        factor = (self.case.tolerance_factor or DEFAULT_FACTOR) * self.subject.tolerance_factor
        return Tolerance(factor, self.case.abs_min if self.case.abs_min is not None else DEFAULT_ABS_MIN)

    @property
    def max_cache_len(self) -> int:
        return max(64, self.case.total_tokens)

    def new_cache(self, spec=None):
        """A fresh cache of ``spec`` (default: the subject) sized for this case."""
        spec = spec or self.subject
        return spec.build(self.model, max_cache_len=self.max_cache_len, batch_size=self.case.batch,
                          encoder_len=self.case.encoder_len)

    def headline(self) -> str:
        dtype = {"float32": "fp32", "float64": "fp64", "bfloat16": "bf16", "float16": "fp16"}[self.case.dtype]
        return (f"{self.check_name} failed: {self.subject.name} on {self.model.name} "
                f"({dtype}, batch {self.case.batch}), case {self.case.id}")

    def reproduce(self) -> str:
        name = self.check_name.removeprefix("check_")
        model = self.model.name if self.model.source == "zoo" else self.model.source
        return reproduce_line(self.subject, model, f"{name} and {self.case.id} and {self.subject.name}")

    def fail(self, lines, metrics=None):
        """Raise ``ConformanceError`` with the headline, ``lines`` (indented) and the reproduce line."""
        self.metrics.update(metrics or {})
        lines = list(lines)
        if self.known_fault:
            short = self.known_fault if len(self.known_fault) <= 220 else self.known_fault[:217] + "..."
            lines.append(f"known upstream fault: {short}")
        body = [self.headline(), *("  " + line for line in lines if line), "  " + self.reproduce()]
        raise ConformanceError("\n".join(body), dict(self.metrics))


def reproduce_line(subject, model_spec: str, selection: str) -> str:
    """The ``reproduce:`` line of a failure message: a command that runs just this item again —
    ``pytest --kvconform [--kvconform-cache SPEC] --kvconform-model MODEL -k "SELECTION"``. A subject given as a
    ``module:attr`` / ``file.py:attr`` spec is named with ``--kvconform-cache``; one declared in Python (conftest
    hook, ``parametrize_with_checks``, ``check_cache``) is said to need that code."""
    import shlex

    args = ["pytest", "--kvconform"]
    source = getattr(subject, "source", "builtin")
    if ":" in source:
        args += ["--kvconform-cache", shlex.quote(source)]
    args += ["--kvconform-model", shlex.quote(model_spec), "-k", f'"{selection}"']
    where = "" if source == "builtin" or ":" in source else f"   (where your code declares {subject.name})"
    return "reproduce: " + " ".join(args) + where


def run_check(name: str, ctx: CheckContext) -> dict:
    """Run check ``name`` on ``ctx``; return its metrics. Raises ``ConformanceError`` on non-conformance."""
    from kvconform.subjects import SubjectBuildError

    info = load_checks()[name]
    ctx.check_name = name
    try:
        info.fn(ctx)
    except SubjectBuildError as exc:
        from kvconform.checks._engine import describe_exception

        ctx.fail([f"building the subject raised {describe_exception(exc.cause)}",
                  f"called: {exc.name}({', '.join(f'{k}=...' for k in exc.kwargs)}) for {ctx.model.name}",
                  "likely cause: the cache's constructor (or factory) cannot build a cache for this model from the "
                  "keyword arguments kvconform passes (config, max_cache_len, batch_size, device, dtype; only those "
                  "its signature accepts)"], {"raised": type(exc.cause).__name__, "failed_at": "construction"})
    return ctx.metrics
