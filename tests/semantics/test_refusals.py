"""A refusal is clear only where the contract allows it: after ``reset B`` a cache that refuses the new batch size
passes only when it declares that refusal (``refuses`` / ``kvconform_refuses``) or kvconform's reference refuses the
same case too; past ``max_cache_len`` a refusal passes only when the cache declares the capacity it enforces
(``get_max_length()``). Otherwise the item fails, naming what was refused and that the reference accepts it."""

from __future__ import annotations

import pytest

import kvconform
from kvconform.subjects import CacheSpec, SpecError, as_cache_spec, validate_spec
from kvconform.testing.page_pool import PagePoolCache, StaleTablesPagePoolCache

RESET = dict(checks=["check_reset_then_reuse"], cases=["reset_reuse", "reset_smaller_batch", "reset_larger_batch"])


class DeclaredStaleTables(StaleTablesPagePoolCache):
    """The same cache, its refusal declared: the block tables are sized for one batch by design."""

    kvconform_refuses = {"reset_batch": "block tables are kept for the batch the cache was first used with"}


def _by_case(results):
    return {r.case: r for r in results if r.outcome != "skipped"}


def test_correct_page_pool_accepts_another_batch_after_reset():
    ran = _by_case(kvconform.check_cache(PagePoolCache, models=["llama"], **RESET))
    assert set(ran) == {"reset_reuse", "reset_smaller_batch", "reset_larger_batch"}
    for r in ran.values():
        assert r.outcome == "passed", r.message
        assert "refused" not in r.metrics


def test_undeclared_refusal_the_reference_does_not_share_fails():
    """Before: a clear message naming "batch" passed as a "clear refusal" (both resized cases green)."""
    ran = _by_case(kvconform.check_cache(StaleTablesPagePoolCache, models=["llama"], **RESET))
    assert ran["reset_reuse"].outcome == "passed", ran["reset_reuse"].message  # the same batch: nothing wrong
    for case, rows in (("reset_smaller_batch", "holds 4 rows, got a batch of 2"),
                       ("reset_larger_batch", "holds 2 rows, got a batch of 4")):
        r = ran[case]
        assert r.outcome == "failed", (case, r.message)
        assert rows in r.message
        assert "but ReferenceCache accepts it" in r.message
        assert r.metrics["reference_accepts"] is True and r.metrics["failed_at"] == "prefill(8)"
        assert "likely cause: after reset() the cache still has buffers sized for the previous batch" in r.message


def test_declared_refusal_passes_and_says_who_refused():
    ran = _by_case(kvconform.check_cache(DeclaredStaleTables, models=["llama"], **RESET))
    for case in ("reset_smaller_batch", "reset_larger_batch"):
        r = ran[case]
        assert r.outcome == "passed", r.message
        assert r.metrics["refused_by"].startswith("subject, declared: block tables are kept")
        assert r.metrics["measured"]["refusal"].startswith("ValueError: DeclaredStaleTables holds")


def test_refuses_is_declared_by_attribute_or_field_and_validated():
    assert as_cache_spec(DeclaredStaleTables).refuses == {
        "reset_batch": "block tables are kept for the batch the cache was first used with"}
    assert as_cache_spec(PagePoolCache).refuses == {}

    class Misspelt(PagePoolCache):
        kvconform_refuses = {"reset_batches": "x"}

    with pytest.raises(SpecError, match=r"kvconform_refuses: unknown refusals 'reset_batches' "
                                        r"\(did you mean 'reset_batch'\?\)"):
        as_cache_spec(Misspelt)

    class NoReason(PagePoolCache):
        kvconform_refuses = {"reset_batch": ""}

    with pytest.raises(SpecError, match="kvconform_refuses must be a dict of refusal names"):
        as_cache_spec(NoReason)
    with pytest.raises(SpecError, match="refuses must be a dict"):
        validate_spec(CacheSpec("Pool", PagePoolCache, refuses=["reset_batch"]), "test")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------ capacity
class _FullPastTwelve(PagePoolCache):
    """Refuses, clearly and before writing, a forward that would hold more than 12 tokens a row."""

    limit = 12

    def write(self, layer_idx, keys, values):
        if self.lengths[layer_idx] + keys.shape[-2] > self.limit:
            raise ValueError(f"cache is full: max_cache_len {self.limit} exceeded")
        super().write(layer_idx, keys, values)


class UndeclaredCapacity(_FullPastTwelve):
    """get_max_length() = -1 (inherited: "unbounded"), yet it refuses past 12 tokens."""


def _declared_cap(config=None, max_cache_len=12, **kwargs):
    """The same cache, its capacity declared: every layer's get_max_length() is the max_cache_len it enforces."""
    cache = _FullPastTwelve(config)
    cache.limit = max_cache_len
    for layer in cache.layers:
        layer.get_max_length = lambda cap=max_cache_len: cap
    return cache


def test_capacity_refusal_passes_only_where_the_capacity_is_declared():
    """Before, both passed: any clear error naming the capacity was a refusal the contract allows."""
    undeclared = _by_case(kvconform.check_cache(UndeclaredCapacity, models=["llama"], checks=["check_capacity"]))
    r = undeclared["capacity"]
    assert r.outcome == "failed", r.message
    assert "but it declares no maximum (get_max_length() = -1) and ReferenceCache holds those tokens" in r.message
    assert r.metrics["reference_accepts"] is True
    declared = _by_case(kvconform.check_cache(CacheSpec("DeclaredCapacity", _declared_cap), models=["llama"],
                                              checks=["check_capacity"]))
    r = declared["capacity"]
    assert r.outcome == "passed", r.message
    assert r.metrics["refused_by"] == "subject, declared: get_max_length() = 12"
    assert r.metrics["measured"]["refusal"].startswith("ValueError: cache is full")
