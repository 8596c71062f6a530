"""Entry points for cache authors outside ``pytest --kvconform``: ``check_cache`` and ``parametrize_with_checks``.

Both run the same checks, cases, oracle and known-fault list as the suite.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvconform.run_options import RunOptions


@dataclass(frozen=True)
class CheckResult:
    """Outcome of one item run by ``check_cache``.

    Attributes:
        id: the item id (``subject-model-check-case``), as in pytest.
        subject, model, check, family, case: the item's coordinates.
        dtype, batch: the case's dtype (``"float32"``, ``"bfloat16"``, ...) and batch size.
        outcome: ``passed``, ``failed``, ``skipped``, ``xfailed``, ``xpassed``, ``error`` or ``internal`` (kvconform's
            own code failed on the item: no verdict on the subject; the message says where and where to report it).
        message: the failure message (ARCHITECTURE.md, "Failure messages"), the skip / xfail reason, or the exception
            for ``error``.
        metrics: JSON-serialisable numbers (``max_abs``, ``tolerance``, ``noise_floor``, ...).
    """

    id: str
    subject: str
    model: str
    check: str
    family: str
    case: str
    outcome: str
    message: str = ""
    metrics: dict = field(default_factory=dict)
    dtype: str = "float32"
    batch: int = 0


def _session(caches, models, checks, cases, options, run_options):
    from kvconform.session import build_session

    # no power table without the plugin's report (pytest --kvconform --kvconform-power)
    options = RunOptions.of(options or RunOptions(power="off"), **run_options)
    return build_session(caches=list(caches), models=models, builtin=False, checks=checks, case_ids=cases,
                         options=options)


def _as_list(obj):
    return list(obj) if isinstance(obj, (list, tuple)) else [obj]


def check_cache(cache, models=None, checks=None, cases=None, *, raise_on_failure=False,
                options: RunOptions | None = None, **run_options) -> list[CheckResult]:
    """Run every applicable conformance item on ``cache`` and return the results (no pytest needed).

    Args:
        cache: a ``CacheSpec``, a ``transformers.Cache`` subclass, a factory, or a ``"module:attr"`` string (or a
            list of these).
        models: zoo names / checkpoint folders (default: the whole zoo), or model adapters of models written from
            scratch (``"module:Attr"`` strings or the adapter objects themselves; ``kvconform.scratch``): their own
            caches are the subjects then, so ``cache`` may be ``[]``.
        checks: check names to run (default: all), e.g. ``["check_prefill_then_decode"]``.
        cases: case ids to run (default: all).
        raise_on_failure: raise ``ConformanceError`` with every failure message after running everything.
        options: the run's options as one ``RunOptions`` (``kvconform.RunOptions``; default: the defaults, with no
            power pass).
        run_options: the same options by keyword, applied over ``options`` and validated as the command line's
            flags are: ``strict=True`` (known upstream faults count as failures), ``full=True`` (the heavier
            tier), ``device="cuda"``, ``fuzz_seed=7``, ``power="sampled"``, ``trust_remote_code=True``.

    Raises:
        kvconform.outcomes.UsageError: bad input — an unknown run option or a bad value (naming it), a spec, model,
            check or case name (``SpecError``).
        kvconform.checks.ConformanceError: when ``raise_on_failure`` and an item failed.
    """
    from kvconform.checks import CheckSkipped, ConformanceError, KnownFaultShown, KVConformInternalError, Unexcused

    session = _session(_as_list(cache), models, checks, cases, options, run_options)
    results = []
    for item in session.items():
        base = item.record()
        if item.skip:
            results.append(CheckResult(item.id, **base, outcome="skipped", message=item.skip))
            continue
        try:
            metrics = session.run(item)
            outcome, message = ("xpassed", item.xfail) if item.xfail else ("passed", "")
        except ConformanceError as exc:
            metrics = exc.metrics
            outcome, message = ("xfailed", item.xfail) if item.xfail else ("failed", str(exc))
        except KnownFaultShown as exc:  # a known fault shown by its evidence
            metrics, outcome, message = exc.metrics, "xfailed", str(exc)
        except Unexcused as exc:  # never an xfail: the cache was not built, or its failure is not the known fault
            metrics, outcome, message = exc.metrics, "failed", str(exc)
        except CheckSkipped as exc:  # the check cannot measure here (as under pytest: a skip with its reason)
            metrics, outcome, message = {}, "skipped", str(exc)
        except KVConformInternalError as exc:  # kvconform's own code failed: no verdict on the subject
            metrics, outcome, message = exc.metrics, "internal", str(exc)
        except Exception as exc:  # noqa: BLE001 - reported as the item's error
            metrics, outcome, message = {}, "error", f"{type(exc).__name__}: {exc}"
        results.append(CheckResult(item.id, **base, outcome=outcome, message=message, metrics=dict(metrics)))
    failures = [r for r in results if r.outcome in ("failed", "error", "internal")]
    if raise_on_failure and failures:
        raise ConformanceError("\n\n".join(r.message for r in failures))
    return results


def parametrize_with_checks(caches, models=None, checks=None, cases=None, *, options: RunOptions | None = None,
                            **run_options):
    """A ``pytest.mark.parametrize`` over every conformance item of ``caches``, for a cache author's own tests::

        from kvconform import parametrize_with_checks

        @parametrize_with_checks([PagedCache], models=["llama", "mistral"])
        def test_paged_cache_conforms(kv_item, kv_runner):
            kv_runner(kv_item)

    ``kv_runner`` is a fixture of kvconform's plugin. Skips and expected failures (``CacheSpec
    .expected_failures``, known upstream faults) become skip / xfail marks. Arguments (``options`` and the run
    options by keyword too) as in ``check_cache``: the items are planned *and run* under them — ``kv_runner`` runs
    each item through the session that planned it (``planning_session``), so ``strict``, ``full``, ``device``,
    ``power`` and ``timeout`` act as in ``check_cache`` whatever the pytest command line says.

    Raises:
        kvconform.outcomes.UsageError: as ``check_cache``.
    """
    import pytest

    session = _session(_as_list(caches), models, checks, cases, options, run_options)
    items = session.items()
    for item in items:
        _PLANNED[id(item)] = (item, session)
    params = [pytest.param(item, id=item.id, marks=item.marks(pytest)) for item in items]
    return pytest.mark.parametrize("kv_item", params)


_PLANNED: dict = {}
"""``{id(item): (item, session)}`` of the items ``parametrize_with_checks`` planned in this process (the item kept
so that its id is not reused): ``planning_session``."""


def planning_session(item):
    """The ``KVSession`` (``kvconform.session``) whose ``RunOptions`` planned ``item`` (a ``PlanItem`` from
    ``parametrize_with_checks`` in this process), or None for an item planned elsewhere (the plugin's own suite):
    ``kv_runner`` runs the item through it, so that the options given to ``parametrize_with_checks`` are the ones
    its items run under."""
    entry = _PLANNED.get(id(item))
    return entry[1] if entry is not None and entry[0] is item else None
