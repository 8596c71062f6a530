"""A ``kvconform_*`` attribute kvconform does not read is refused, from every entry point, naming the closest known
declaration: a typo (``kvconform_lossey``) would otherwise leave a lossy cache judged as exact, in silence."""

from __future__ import annotations

import pytest
from transformers import DynamicCache

from kvconform.subjects import SpecError, as_cache_spec, resolve_cache_spec
from kvconform.subjects.declare import DECLARATIONS


class LossyTypo(DynamicCache):
    kvconform_lossey = {"kl_max": 0.05, "top1_min": 0.8}


class BudgetAsItsOwnAttribute(DynamicCache):
    kvconform_lossy = {"kl_max": 0.05, "top1_min": 0.8}
    kvconform_budget = {"kl_max": 0.01}


def test_a_misspelt_declaration_on_a_class_names_the_one_meant():
    with pytest.raises(SpecError, match=r"unknown declaration 'kvconform_lossey' \(did you mean 'kvconform_lossy'\?\)"):
        as_cache_spec(LossyTypo)


def test_a_budget_attribute_says_where_a_budget_goes():
    with pytest.raises(SpecError, match=r"'kvconform_budget'; a budget is the value of the kind's declaration: "
                                        r"kvconform_lossy or kvconform_evicting or kvconform_press = "):
        as_cache_spec(BudgetAsItsOwnAttribute)


def test_a_misspelt_attribute_of_a_factory_function_in_a_file(tmp_path):
    file = tmp_path / "mine.py"
    file.write_text("from transformers import DynamicCache\n"
                    "def mine(config):\n    return DynamicCache(config=config)\n"
                    "mine.kvconform_capabilites = {'forward', 'crop'}\n")
    with pytest.raises(SpecError, match=r"'kvconform_capabilites' \(did you mean 'kvconform_capabilities'\?\)"):
        resolve_cache_spec(f"{file}:mine")


def test_every_known_declaration_is_accepted():
    attrs = {"kvconform_capabilities": {"forward"}, "kvconform_page_size": 4, "kvconform_supports": {"decoder_only"},
             "kvconform_refuses": {}, "kvconform_lossy": {"kl_max": 0.05, "top1_min": 0.8}}
    spec = as_cache_spec(type("Declared", (DynamicCache,), attrs))
    assert spec.kind == "lossy" and spec.page_size == 4
    assert {"kvconform_held", "kvconform_poison", "kvconform_allocation"} <= set(DECLARATIONS)


def test_the_run_ends_with_exit_4_before_any_item(run_kvconform, pytester):
    pytester.makepyfile(mycaches="from transformers import DynamicCache\n"
                                 "class Mine(DynamicCache):\n    kvconform_evictng = {'kl_max': 1.0}\n")
    result = run_kvconform("--kvconform-cache", "mycaches:Mine")
    assert result.ret == 4
    assert "'mycaches:Mine': unknown declaration 'kvconform_evictng' (did you mean 'kvconform_evicting'?)" in \
        result.stderr.str()
