"""Every published cache design gets a true verdict (the press kind, exactness owed by non-exact kinds, checks that
apply only where they can). The faulty variants' cause lines are pinned by ``tests/caches/test_faulty_caches.py`` (their
``FAULTY`` entries); here the correct designs pass and the rules that decide applicability hold. Direct
``check_cache`` calls on llama (and one hybrid model), no pytester runs."""

from __future__ import annotations

import pytest

from kvconform.api import check_cache
from kvconform.subjects import SpecError, declared_kind, kind_of


def _outcomes(spec, models, checks, cases=None, full=False):
    results = check_cache(spec, models=models, checks=checks, cases=cases, full=full)
    assert results, (spec, checks)
    return results


def test_press_is_declared_and_judged_as_a_press():
    from kvconform.testing.press import TailPress

    kind, budget = declared_kind(TailPress, "TailPress")
    assert kind == "press" and "tokens_max" not in budget
    spec = kvconform_spec(TailPress)
    assert spec.kind == "press" and spec.budget.tokens_max is None
    k = kind_of(spec)
    assert k.name == "press" and k.presses and k.compresses and k.budgeted and not k.exact


def kvconform_spec(obj):
    from kvconform.subjects import as_cache_spec

    return as_cache_spec(obj)


def test_press_with_a_token_bound_is_a_usage_error():
    from transformers import DynamicCache

    def bad(config):
        return DynamicCache(config=config)

    bad.kvconform_press = {"kl_max": 0.5, "top1_min": 0.3, "tokens_max": 64}
    with pytest.raises(SpecError, match="tokens_max is for evicting subjects"):
        check_cache(bad, models=["llama"], checks=["check_press_contract"])


def test_correct_press_passes_its_contract_and_the_exactness_checks():
    """TailPress: the press contract (short prompts, exact prefill, length = tokens seen, held keys a subset), the
    identity ops and the padded row (refused clearly: a press cannot compress padded rows alike) on llama and qwen2
    (whose sliding layers it leaves alone)."""
    results = _outcomes("kvconform.testing.press:TailPress", ["llama", "qwen2"],
                        ["check_press_contract", "check_identity_ops", "check_padded_row_alone",
                         "check_length_bookkeeping", "check_crop_then_continue"])
    bad = [(r.model, r.case, r.message) for r in results if r.outcome == "failed"]
    assert not bad, bad
    padded = [r for r in results if r.check == "check_padded_row_alone"]
    assert padded and all("refused a left-padded prefill" in r.metrics.get("note", "") for r in padded), padded


@pytest.mark.parametrize("spec", ["kvconform.testing.lossy:Int8ResidualCache",
                                  "kvconform.testing.evicting:SinkWindowCache"])
def test_bundled_non_exact_caches_pass_the_exactness_checks(spec):
    results = _outcomes(spec, ["llama"], ["check_identity_ops", "check_padded_row_alone"])
    assert [r.outcome for r in results] == ["passed", "passed"], [r.message for r in results]
    assert all(r.metrics["max_abs"] <= r.metrics["tolerance"] for r in results)


def test_exactness_checks_do_not_apply_to_exact_caches():
    [result] = check_cache("kvconform.testing.paged:PagedCache", models=["llama"], checks=["check_identity_ops"])
    assert result.outcome == "skipped" and "an exact subject is held to the float64 oracle" in result.message


def test_press_crop_failure_blames_the_length_not_the_crop():
    [result] = check_cache("kvconform.testing.press:HeldLengthPress", models=["llama"],
                           checks=["check_crop_then_continue"], cases=["crop_zero"])
    assert result.outcome == "failed", result.message
    line = [x for x in result.message.splitlines() if "likely cause:" in x][0]
    assert "the length counter is the fault, not the crop" in line, line
    assert "crop() removed a different number of tokens than asked" not in line


def test_compression_is_not_judged_without_keys_and_values():
    [result] = check_cache("kvconform.testing.lossy:Int8ResidualCache", models=["mamba"],
                           checks=["check_compression_real"], full=True)
    assert result.outcome == "skipped" and "no keys or values to compress" in result.message


def test_lossy_budget_counts_on_top_of_the_models_own_loss():
    """jamba's modeling code loses KL ~1.2e-3 on the long case whatever the cache (kvconform's ReferenceCache gets
    the same): a lossy cache with kl_max 1e-4 that adds nothing to it passes, with a note naming the baseline."""
    [result] = [r for r in check_cache("kvconform.testing.lossy:Int8ResidualCache", models=["jamba"],
                                       checks=["check_quality_budget"], full=True)
                if r.dtype == "float32"]  # the full tier also runs the bf16/fp16 quality cases
    assert result.outcome == "passed", result.message
    assert result.metrics["reference_kl_mean"] > 1e-4
    assert result.metrics["kl_mean"] - result.metrics["reference_kl_mean"] <= 1e-4
    assert "the model's own fault" in result.metrics["note"]
