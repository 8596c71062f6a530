"""The speculative family: transformers' own candidate generators (prompt lookup, a draft model) with the subject
as the target's cache give the uncached greedy tokens, and every item records the rollbacks it exercised. Correct
caches of other designs pass (a paged cache of kvconform's; transformers' StaticCache and DynamicCache); the faulty
one (a chunk staged apart and left out of the rollback) is pinned in tests/caches/test_faulty_caches.py."""

import json

from kvconform import compat


def test_a_crop_counts_as_a_rollback_only_where_it_removes_tokens():
    # from 5.14 crop(n) removes -n tokens and crop(0) none (prompt lookup calls crop(0) after every accepted step)
    assert compat.tokens_removed_by_crop(-3, 20) == 3 and compat.tokens_removed_by_crop(0, 20) == 0
    if compat.transformers_version().release >= (5, 14):
        assert compat.tokens_removed_by_crop(0, None) == 0
    else:  # the legacy contract: the argument is the length to keep
        assert compat.tokens_removed_by_crop(17, 20) == 3


def test_correct_caches_of_other_designs_pass_with_rollbacks_measured(run_kvconform, pytester):
    result = run_kvconform("--kvconform-cache", "kvconform.testing.paged:PagedCache", "--kvconform-subject",
                           "PagedCache", "--kvconform-subject", "StaticCache", "--kvconform-model", "llama",
                           "--kvconform-model", "gpt2", "-m", "kvconform_speculative", "--kvconform-json", "r.json",
                           "-n", "0")
    records = json.loads((pytester.path / "r.json").read_text())["results"]
    ran = [r for r in records if r["outcome"] != "skipped"]
    assert {r["subject"] for r in ran} == {"PagedCache", "StaticCache"} and len(ran) == 8, ran
    assert all(r["outcome"] == "passed" for r in ran), [(r["nodeid"], r["message"]) for r in ran]
    for r in ran:  # each item says what it exercised: crops, rollbacks and the tokens they removed
        m = r["metrics"]
        assert m["tokens_equal"] is True and m["rollbacks"] >= 1 and m["tokens_rolled_back"] >= m["rollbacks"], m
        assert m["crops"] >= m["rollbacks"]
    assert result.ret == 0
