"""A cache scoped to the layer types and model kinds it supports (``kvconform_supports`` / ``CacheSpec.supports``):
items outside it are skipped with that reason, from every entry point; an undeclared cache whose construction
raises ``NotImplementedError`` fails with "does not support …", not as a keyword-argument problem."""

from __future__ import annotations

import dataclasses
import re

import pytest

from kvconform.api import check_cache
from kvconform.subjects import (CAPABILITIES, SUPPORTS, CacheSpec, SpecError, as_cache_spec, declared_supports,
                                resolve_cache_spec, validate_spec)

_M = "kvconform.testing.scoped"
CHECK = ["check_prefill_then_decode"]
CASE = ["decode_implicit_positions"]


def test_declared_scope_skips_unsupported_models_and_runs_the_rest():
    results = {r.model: r for r in check_cache(f"{_M}:AttentionOnlyCache", models=["llama", "mamba", "t5"],
                                               checks=CHECK, cases=CASE)}
    assert results["llama"].outcome == "passed", results["llama"].message
    assert results["mamba"].outcome == "skipped"
    assert results["mamba"].message == ("AttentionOnlyCache supports decoder_only, full_attention, sliding_attention "
                                        "(kvconform_supports): mamba has linear_attention layers, not judged")
    assert results["t5"].outcome == "skipped" and "t5 is encoder-decoder, not judged" in results["t5"].message


def test_undeclared_not_implemented_is_reported_as_not_supported():
    [result] = check_cache(f"{_M}:UndeclaredAttentionOnlyCache", models=["mamba"], checks=CHECK, cases=CASE)
    assert result.outcome == "failed"
    assert "raised NotImplementedError: AttentionOnlyCache supports attention layers only" in result.message
    cause = next(line for line in result.message.splitlines() if "likely cause:" in line)
    assert "UndeclaredAttentionOnlyCache does not support mamba's linear_attention layers" in cause
    assert "kvconform_supports = {" in cause
    assert "keyword arguments" not in cause


def test_every_entry_point_carries_the_declaration(tmp_path):
    want = frozenset({"full_attention", "sliding_attention", "decoder_only"})
    assert resolve_cache_spec(f"{_M}:AttentionOnlyCache").supports == want  # --kvconform-cache
    from kvconform.testing.scoped import AttentionOnlyCache, UndeclaredAttentionOnlyCache

    assert as_cache_spec(AttentionOnlyCache).supports == want  # check_cache / parametrize_with_checks
    spec = CacheSpec("Scoped", UndeclaredAttentionOnlyCache, supports={"full_attention"})  # hook / CacheSpec
    assert spec.supports == frozenset({"full_attention"})
    [result] = check_cache(spec, models=["qwen2"], checks=CHECK, cases=CASE)
    assert result.outcome == "skipped" and "qwen2 has sliding_attention layers" in result.message
    file = tmp_path / "mine.py"
    file.write_text("from kvconform.testing.scoped import UndeclaredAttentionOnlyCache as Base\n"
                    "def mine(config):\n    return Base(config)\n"
                    "mine.kvconform_supports = ['full_attention']\n")
    assert resolve_cache_spec(f"{file}:mine").supports == frozenset({"full_attention"})  # a factory's attribute


@pytest.mark.parametrize("value, match", [("full_attention", "non-empty set"), (set(), "non-empty set"),
                                          ({"full_attn"}, "did you mean 'full_attention'")])
def test_a_bad_declaration_is_a_usage_error(value, match):
    class Bad:
        kvconform_supports = value

    with pytest.raises(SpecError, match=match):
        declared_supports(Bad, "Bad")
    spec = dataclasses.replace(as_cache_spec(f"{_M}:AttentionOnlyCache"), supports=value)
    with pytest.raises(SpecError, match=match):
        validate_spec(spec, "check_cache")


def test_readme_lists_every_capability_and_support_name():
    import pathlib

    text = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
    for name in (*CAPABILITIES, *SUPPORTS):
        assert re.search(rf"`{name}`", text), name
