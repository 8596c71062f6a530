"""A cache that quantizes without declaring it (``kvconform_lossy``) is checked as exact and fails nearly every family.
Its memory failure names compression, not a leak, and the run's summary asks once whether it is lossy by design.
A new user's int8 cache got 27 failures, each blaming another op, and a memory cause "bytes survive reset()" measured
before any reset. Real runs on llama: the bundled int8 residual cache with its declaration removed."""

from __future__ import annotations

from kvconform.api import check_cache
from kvconform.report import undeclared_kind_hints
from kvconform.session import build_session
from kvconform.testing.lossy import Int8ResidualCache

CHECKS = ["check_prefill_then_decode", "check_crop_then_continue", "check_memory_bytes"]


class Int8Undeclared(Int8ResidualCache):
    """The bundled int8 cache (4 exact recent tokens, 4 exact rollback tokens) without ``kvconform_lossy``: what an
    author runs before reading about declarations."""

    kvconform_lossy = None

    def __init__(self, config=None, residual: int = 4, rollback: int = 4, **kwargs):
        super().__init__(config, residual=residual, rollback=rollback, **kwargs)


def _cause(message: str) -> str:
    return next(line for line in message.splitlines() if line.strip().startswith("likely cause:"))


def test_memory_cause_of_an_undeclared_quantized_cache_names_compression_not_reset():
    results = check_cache(Int8Undeclared, models=["llama"], checks=["check_memory_bytes"])
    failed = [r for r in results if r.outcome == "failed"]
    assert failed, [(r.case, r.outcome) for r in results]
    for r in failed:
        cause = _cause(r.message)
        assert "compresses or drops them" in cause and "kvconform_lossy" in cause, cause
        assert "survive reset" not in cause, cause


def _results(spec):
    return {r.id: {"subject": r.subject, "family": r.family, "outcome": r.outcome}
            for r in check_cache(spec, models=["llama"], checks=CHECKS)}


def test_summary_asks_an_exact_subject_failing_widely_whether_it_is_lossy_by_design():
    session = build_session(caches=[Int8Undeclared], models=["llama"], checks=CHECKS)
    results = _results(Int8Undeclared)
    hints = undeclared_kind_hints(results, session.digest())
    assert len(hints) == 1, hints
    assert hints[0].startswith("kvconform: Int8Undeclared is checked as an exact cache and failed")
    assert "kvconform_lossy" in hints[0] and "(crop, logits, memory)" in hints[0], hints[0]


def test_no_such_hint_for_a_declared_lossy_cache_or_a_built_in_subject():
    session = build_session(caches=[Int8ResidualCache], models=["llama"], checks=CHECKS)
    declared = _results(Int8ResidualCache)
    assert not undeclared_kind_hints(declared, session.digest())
    # the same failures on a built-in exact subject: a transformers cache is not asked to declare anything
    as_builtin = {k: {**r, "subject": "DynamicCache", "outcome": "failed"} for k, r in declared.items()}
    assert not undeclared_kind_hints(as_builtin, session.digest())
