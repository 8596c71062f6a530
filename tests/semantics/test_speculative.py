"""The speculative family: transformers' own candidate generators (prompt lookup, a draft model, DFlash) with the
subject as the target's cache give the uncached greedy tokens, and every item records the rollbacks it exercised.
Correct caches of other designs pass (a paged cache of kvconform's; transformers' StaticCache and DynamicCache); the
faulty ones (a chunk staged apart and left out of the rollback; a decode tail left out of the draft's rollback) are
pinned in tests/caches/test_faulty_caches.py."""

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
    # 3 cases (prompt lookup, assisted, assisted with the subject as the draft's cache) x 2 models x 2 subjects,
    # and DFlash (transformers >= 5.25) on llama x 2 subjects
    dflash = 2 if compat.transformers_version().release >= (5, 25) else 0
    assert {r["subject"] for r in ran} == {"PagedCache", "StaticCache"} and len(ran) == 12 + dflash, ran
    assert sum(r["metrics"].get("role") == "draft_cache" for r in ran) == 4
    assert sum(r["metrics"].get("mode") == "dflash" for r in ran) == dflash
    assert all(r["outcome"] == "passed" for r in ran), [(r["nodeid"], r["message"]) for r in ran]
    for r in ran:  # each item says what it exercised: crops, rollbacks and the tokens they removed
        m = r["metrics"]
        assert m["tokens_equal"] is True and m["rollbacks"] >= 1 and m["tokens_rolled_back"] >= m["rollbacks"], m
        assert m["crops"] >= m["rollbacks"]
    assert result.ret == 0


def test_an_item_that_never_rolled_back_is_blind():
    from kvconform.checks import Measured

    assert "no rollback" in Measured(rollbacks=0, tokens_rolled_back=0).blind()
    assert Measured(rollbacks=2, tokens_rolled_back=5).blind() is None
    assert Measured().blind() is None  # an item of another family records no rollbacks at all
    assert Measured(rollbacks=2, tokens_rolled_back=5).as_metrics() == {"rollbacks": 2, "tokens_rolled_back": 5}


def test_mtp_path_with_the_subject_as_the_models_cache_or_the_mtp_layers_cache(run_kvconform, pytester):
    # generate(use_mtp=True) on the zoo's glm4_moe with 2 MTP layers: a paged cache of kvconform's and DynamicCache
    # as the model's cache, transformers' MtpCache as the MTP layers' cache (judged by its drafts)
    from transformers import cache_utils

    if not hasattr(cache_utils, "MtpCache"):
        import pytest

        pytest.skip("MTP needs transformers 5.25")
    result = run_kvconform("--kvconform-cache", "kvconform.testing.paged:PagedCache", "--kvconform-subject",
                           "PagedCache", "--kvconform-subject", "DynamicCache", "--kvconform-subject", "MtpCache",
                           "--kvconform-model", "glm4_mtp", "-k", "speculative_mtp", "--kvconform-json", "r.json",
                           "-n", "0", "--kvconform-power", "off")
    records = json.loads((pytester.path / "r.json").read_text())["results"]
    ran = {r["subject"]: r for r in records if r["outcome"] != "skipped"}
    assert set(ran) == {"PagedCache", "DynamicCache", "MtpCache"}, records
    assert all(r["outcome"] == "passed" for r in ran.values()), [(r["nodeid"], r["message"]) for r in ran.values()]
    assert ran["MtpCache"]["metrics"]["role"] == "mtp_cache" and ran["PagedCache"]["metrics"]["role"] == "target_cache"
    for r in ran.values():
        assert r["metrics"]["measured"]["rollbacks"] >= 1, r["metrics"]
    assert result.ret == 0


def test_transformers_refuses_speculative_decoding_above_batch_1():
    # why the family's cases are batch 1: every candidate generator (prompt lookup, a draft, DFlash, MTP) runs in
    # generate()'s _assisted_decoding, which raises at batch > 1 (5.5.4 and 5.25.0 measured). When this fails,
    # transformers decodes several rows speculatively: give the family batch-2 cases.
    import pytest
    import torch

    from kvconform import zoo

    model = zoo.build_zoo_model("llama", dtype=torch.float32, device="cpu", seed=0).model
    prompt = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="only supported for batch_size = 1"):
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False,
                       prompt_lookup_num_tokens=3)
