"""A cache that evicts a share of its tokens at every step declares it (``keep_ratio``, ``tokens_exact``) and is
judged by it: its held tokens and bytes against the share of the tokens seen, its exactness below
``tokens_exact``; the bundled correct cache passes, each faulty variant fails with the judgement it breaks."""

from __future__ import annotations

import pytest

from kvconform.api import check_cache
from kvconform.subjects import Budget, CacheSpec, SpecError, kind_of, validate_spec

_M = "kvconform.testing.share_evicting"
CHECKS = ["check_evicting_bounds", "check_memory_bound", "check_quality_budget", "check_prefill_then_decode"]


def _run(attr, checks=CHECKS):
    return {(r.check, r.case): r for r in check_cache(f"{_M}:{attr}", models=["llama"], checks=checks)}


def test_the_share_bound():
    budget = Budget(kl_max=0.3, top1_min=0.3, keep_ratio=0.5, tokens_exact=16)
    assert [budget.held_bound(s) for s in (10, 16, 17, 33, 240)] == [10, 16, 17, 25, 128]
    assert budget.exact_limit == 16
    assert Budget(kl_max=1, top1_min=0, keep_ratio=0.5, tokens_max=32).held_bound(200) == 32


def test_correct_share_evicting_cache_passes_and_long_cases_skip_with_the_share():
    results = _run("ShareEvictingCache")
    bounds = results[("check_evicting_bounds", "evicting_bounds")]
    assert bounds.outcome == "passed", bounds.message
    assert bounds.metrics["most_held"] == 43  # 16 + ceil(0.5 · (71 − 16)) after 71 tokens
    memory = results[("check_memory_bound", "memory_bound_long")]
    assert memory.outcome == "passed", memory.message
    assert memory.metrics["tokens_max"] == 128  # 16 + ceil(0.5 · 224) of 240 tokens seen
    quality = results[("check_quality_budget", "quality_long")]
    assert quality.outcome == "passed", quality.message
    skipped = results[("check_prefill_then_decode", "decode_implicit_positions")]
    assert skipped.outcome == "skipped"
    assert "evicts a share of its tokens past 16 tokens seen (keep_ratio 0.5)" in skipped.message


def test_keeping_more_than_the_declared_share_fails_bounds_and_bytes():
    results = _run("ShareKeepsTooMuch", ["check_evicting_bounds", "check_memory_bound"])
    bounds = results[("check_evicting_bounds", "evicting_bounds")]
    assert bounds.outcome == "failed"
    assert ("holds 29 tokens per row after chunk(17) (33 seen), but should hold ≤ 25 (16 + ceil(0.5 · (seen − 16)) "
            "(keep_ratio 0.5 past tokens_exact 16))") in bounds.message
    assert "likely cause: the cache keeps a larger share than it declares" in bounds.message
    memory = results[("check_memory_bound", "memory_bound_long")]
    assert memory.outcome == "failed" and "(128 tokens: 16 + ceil(0.5 · (seen − 16))" in memory.message
    assert "keeps a larger share of the 240 tokens than it declares (184 tokens' worth" in memory.message


def test_evicting_before_tokens_exact_fails_where_exactness_was_promised():
    [result] = check_cache(f"{_M}:ShareEvictsEarly", models=["llama"], checks=["check_evicting_bounds"])
    assert result.outcome == "failed"
    assert "decode 1 of 2 after 14 tokens: max|Δlogit| = " in result.message
    assert "likely cause: the cache evicts (or changes what it holds) before tokens_exact = 16 tokens" in \
        result.message


@pytest.mark.parametrize("budget, match", [
    ({"kl_max": 0.3, "top1_min": 0.3}, "needs tokens_max .* or keep_ratio"),
    ({"kl_max": 0.3, "top1_min": 0.3, "tokens_max": 8, "tokens_exact": 4}, "tokens_exact goes with keep_ratio"),
    ({"kl_max": 0.3, "top1_min": 0.3, "keep_ratio": 0}, r"keep_ratio must be a number in \(0, 1\]"),
    ({"kl_max": 0.3, "top1_min": 0.3, "keep_ratio": 1.5}, r"keep_ratio must be a number in \[0, 1\]"),
])
def test_bad_share_declarations_are_usage_errors(budget, match):
    from kvconform.testing.share_evicting import ShareEvictingCache

    with pytest.raises(SpecError, match=match):
        validate_spec(CacheSpec("S", ShareEvictingCache, kind="evicting", budget=budget), "check_cache")


def test_a_lossy_cache_cannot_declare_a_share():
    from kvconform.testing.share_evicting import ShareEvictingCache

    spec = CacheSpec("S", ShareEvictingCache, kind="lossy", budget={"kl_max": 0.3, "top1_min": 0.3, "keep_ratio": 0.5})
    with pytest.raises(SpecError, match="keep_ratio is for evicting subjects"):
        validate_spec(spec, "check_cache")
    assert kind_of(CacheSpec("S", ShareEvictingCache, kind="evicting",
                             budget={"kl_max": 0.3, "top1_min": 0.3, "keep_ratio": 0.5})).exact_limit == 0
