"""Scoping by model features (issue 43): ``kvconform_supports`` names how a model encodes positions (rotary,
learned, ALiBi, relative, none) besides layer types and model kinds; a transformers-layer cache for rotary models
only is shown failing on gpt2 with the declaration that fits suggested, and scoped by it."""

import pytest
from transformers import DynamicCache

from kvconform import architectures, check_cache, zoo
from kvconform.subjects import SpecError, check_supports

CHECKS = ["check_prefill_then_decode"]
CASES = ["decode_implicit_positions"]


class RotaryOnlyCache(DynamicCache):
    """A cache written for rotary models only (it would re-rotate keys to new positions): refuses any other."""

    def __init__(self, config=None, **kwargs):
        text = config.get_text_config(decoder=True) if config is not None else None
        if getattr(text, "rope_parameters", None) is None:
            raise NotImplementedError("RotaryOnlyCache re-rotates its keys: rotary (RoPE) models only")
        super().__init__(config=config)


class ScopedRotaryOnlyCache(RotaryOnlyCache):
    kvconform_supports = {"rotary_positions"}


def test_each_zoo_model_has_a_position_kind():
    kinds = {name: architectures.position_kind(zoo.zoo_config(name)) for name in ("llama", "gpt2", "bart", "t5",
                                                                                    "mamba", "jamba", "gemma3")}
    assert kinds == {"llama": "rotary_positions", "gpt2": "learned_positions", "bart": "learned_positions",
                     "t5": "relative_positions", "mamba": "no_positions", "jamba": "no_positions",
                     "gemma3": "rotary_positions"}


def test_a_rotary_only_cache_fails_on_gpt2_with_the_declaration_that_fits_then_is_scoped_by_it():
    results = {r.model: r for r in check_cache(RotaryOnlyCache, models=["llama", "gpt2"], checks=CHECKS, cases=CASES)}
    assert results["llama"].outcome == "passed", results["llama"].message
    assert results["gpt2"].outcome == "failed"
    assert "kvconform_supports = {'rotary_positions'}" in results["gpt2"].message, results["gpt2"].message
    assert "sliding_attention" not in results["gpt2"].message
    scoped = {r.model: r for r in check_cache(ScopedRotaryOnlyCache, models=["llama", "gpt2"], checks=CHECKS,
                                              cases=CASES)}
    assert scoped["llama"].outcome == "passed"
    assert scoped["gpt2"].outcome == "skipped" and "gpt2 has learned positions" in scoped["gpt2"].message


def test_the_position_names_are_validated_like_the_others():
    assert check_supports({"rotary_positions", "full_attention"}, "x") == {"rotary_positions", "full_attention"}
    with pytest.raises(SpecError, match="rotary_positions"):
        check_supports({"rotary"}, "x")
