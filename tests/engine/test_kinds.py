"""A subject's kind is an object (``kvconform.subjects.kinds``): what judges it, why an item does not apply to it;
checks declare the kinds they judge at registration. Direct API calls only (no run, no model)."""

import ast
import pathlib
from types import SimpleNamespace

import pytest

from kvconform.subjects import Budget, CacheSpec, kind_of
from kvconform.subjects.kinds import (ALL_KINDS, DEFAULT_JUDGES, EVICTING, EXACT, FRESH, LOSSY_FRESH, LOSSY_TWIN,
                                      ORACLE, PRESS, TWIN)

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _factory(**_):
    raise AssertionError("never built here")


def _twin(**_):
    raise AssertionError("never built here")


LOSSY = Budget(kl_max=0.1, top1_min=0.5)
EVICT = Budget(kl_max=0.1, top1_min=0.5, tokens_max=8)


@pytest.mark.parametrize("spec, name, target", [
    (CacheSpec("Plain", _factory), EXACT, ORACLE),
    (CacheSpec("Quant", _factory, kind="lossy", budget=LOSSY, twin=_twin), LOSSY_TWIN, TWIN),
    (CacheSpec("ExactWithTwin", _factory, twin=_twin), LOSSY_TWIN, TWIN),
    (CacheSpec("Int8", _factory, kind="lossy", budget=LOSSY), LOSSY_FRESH, FRESH),
    (CacheSpec("Window", _factory, kind="evicting", budget=EVICT), EVICTING, ORACLE),
    (CacheSpec("WindowWithTwin", _factory, kind="evicting", budget=EVICT, twin=_twin), EVICTING, TWIN),
], ids=lambda v: v.name if isinstance(v, CacheSpec) else None)
def test_each_declaration_maps_to_one_kind_and_its_target(spec, name, target):
    kind = kind_of(spec)
    assert (kind.name, kind.target) == (name, target)
    twin = kind.twin_spec()
    assert (twin is not None) == (target == TWIN)
    if twin is not None:
        assert twin.name == f"{spec.name}.twin" and twin.factory is _twin and kind_of(twin).target != TWIN
    assert kind.versus == (" vs its fake-quant twin" if target == TWIN else "")


def test_the_twin_of_a_lossy_subject_is_judged_by_self_consistency_like_its_declaration():
    spec = CacheSpec("Quant", _factory, kind="lossy", budget=LOSSY, twin=_twin)
    assert kind_of(kind_of(spec).twin_spec()).target == FRESH


def test_register_refuses_unknown_kinds_and_defaults_to_every_kind_but_evicting():
    from kvconform.checks import register

    with pytest.raises(TypeError, match="unknown kind.*'lossy'.*known: exact, lossy_twin, lossy_fresh, evicting"):
        register("logits", judges=("exact", "lossy"))
    with pytest.raises(TypeError, match="collection of kind names"):
        register("logits", judges="exact")
    assert DEFAULT_JUDGES == ALL_KINDS - {EVICTING}


def test_checks_declare_the_kinds_they_judge():
    from kvconform.checks import load_checks

    registry = load_checks()
    judges = {name: info.judges for name, info in registry.items()}
    assert {n for n, j in judges.items() if j == {EXACT}} == {
        "check_generate_greedy", "check_beam_search", "check_prefix_generate", "check_multi_turn",
        "check_speculative_greedy", "check_speculative_mtp"}
    assert {n for n, j in judges.items() if j == {EXACT, LOSSY_TWIN}} == {
        "check_memory_bytes", "check_memory_cuda_allocated"}
    assert {n for n, j in judges.items() if j == ALL_KINDS} == {
        n for n, info in registry.items() if info.family in ("quality", "speed") and n != "check_memory_bound"}
    # one word for the kinds a check judges: a check of one kind names it in judges, with no applies= filter
    assert {n for n, j in judges.items() if j == {EVICTING}} == {
        "check_memory_bound", *(n for n in registry if n.startswith("check_evicting_"))}
    assert {n for n, j in judges.items() if j == {PRESS}} == {"check_press_contract"}
    assert {n for n, j in judges.items() if j == ALL_KINDS - {EXACT}} == {
        "check_identity_ops", "check_padded_row_alone"}
    assert {n for n, j in judges.items() if j == {LOSSY_FRESH, PRESS}} == {
        "check_generate_self_consistent", "check_beam_search_self_consistent"}
    assert not any(hasattr(info.fn, "evicting_judged") for info in registry.values())


def test_kinds_register_themselves_and_own_their_facts():
    """Each kind is a class that registers itself (``__init_subclass__``): the kind lists are derived from the
    classes, and a new kind needs no list edited by hand."""
    from kvconform.subjects import kinds

    assert kinds.KIND_NAMES == (EXACT, LOSSY_TWIN, LOSSY_FRESH, EVICTING, PRESS)
    assert kinds.DECLARED_KINDS == ("exact", "lossy", "evicting", "press")
    assert kinds.DEFAULT_JUDGES == ALL_KINDS - {EVICTING}
    try:
        class Sketch(kinds.Kind):  # a new kind: one class
            name = "sketch"
            declares = "sketch"
            precedence = 0
            judged_by_default = False

        assert "sketch" in kinds.KINDS and kinds.KINDS["sketch"] is Sketch
        assert Sketch.claims(SimpleNamespace(kind="sketch")) and not Sketch.claims(SimpleNamespace(kind="lossy"))
    finally:
        kinds.KINDS.pop("sketch", None)


def test_a_check_supplies_the_skip_reason_of_a_kind_it_does_not_judge():
    """The reason an item is skipped for its kind comes from the check (``@register(..., unjudged=...)``), not
    from family names in the kinds module."""
    from kvconform.checks import load_checks

    registry = load_checks()
    lossy = SimpleNamespace(name="Q", kind="lossy", twin=None, budget=None)
    exact = SimpleNamespace(name="E", kind="exact", twin=None, budget=None)
    case = SimpleNamespace(id="c")
    greedy, press = registry["check_generate_greedy"], registry["check_press_contract"]
    assert kind_of(lossy).not_judged(greedy, case, held=lambda: 0).startswith(
        "Q is lossy: its greedy generate() is not compared token for token")
    assert kind_of(exact).not_judged(press, case, held=lambda: 0) == (
        "applies to press subjects only (kind='press': a cache that compresses the prefill)")
    source = (ROOT / "kvconform" / "subjects" / "kinds.py").read_text()
    assert "check.family" not in source and "check.name" not in source


def test_no_module_outside_the_subjects_package_reads_a_subjects_kind_or_twin():
    """``getattr(x, "kind" / "twin", ...)`` and ``x.twin`` / ``subject.kind`` / ``spec.kind`` belong to
    ``kvconform/subjects/``; everything else asks the ``Kind`` object."""
    found = []
    for path in sorted((ROOT / "kvconform").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("kvconform/subjects/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant) and node.args[1].value in ("kind", "twin")):
                found.append(f"{rel}:{node.lineno} getattr(..., {node.args[1].value!r})")
            elif isinstance(node, ast.Attribute) and node.attr in ("kind", "twin"):
                owner = node.value
                if (owner.attr if isinstance(owner, ast.Attribute)
                        else getattr(owner, "id", None)) in ("subject", "spec"):
                    found.append(f"{rel}:{node.lineno} .{node.attr}")
    assert not found, found


def test_a_new_kind_defined_by_a_class_alone_is_judged_by_every_family_that_judges_its_facts():
    """A kind added as the Recipes say — one ``Kind`` subclass, nothing else edited — is declared, validated and
    judged by every check that selects kinds by a fact (quality included: a budgeted kind that compresses gets
    ``check_quality_budget`` and ``check_compression_real``), exactly where a subject declaring ``kind="lossy"``
    (the built-in kind with the same facts but ``quantizes``) is."""
    import dataclasses

    from kvconform.cases import load_cases
    from kvconform.checks import load_checks
    from kvconform.session import model_info, skip_reason
    from kvconform.subjects import CAPABILITIES, kinds
    from kvconform.subjects.declare import declared_kind, validate_spec

    class Sketched(kinds.Kind):  # a low-rank sketch of the keys/values: budgeted, compressing, checked by a fresh copy
        name = "sketched"
        declares = "sketched"
        target = FRESH
        lossy = True
        needs_budget = True
        budget_keys = ("kl_max", "top1_min", "bytes_ratio_max", "saves_memory")
        compresses = True

    try:
        every = frozenset(CAPABILITIES)
        new = CacheSpec("Sk", _factory, capabilities=every, kind="sketched", budget=LOSSY)
        validate_spec(new, "test")  # the declaration is known and its budget checked by the class's facts
        with pytest.raises(Exception, match="needs a budget"):
            validate_spec(dataclasses.replace(new, budget=None), "test")

        class Declared:
            kvconform_sketched = {"kl_max": 0.1, "top1_min": 0.5}

        assert declared_kind(Declared, "Declared") == ("sketched", {"kl_max": 0.1, "top1_min": 0.5})
        kind = kind_of(new)
        assert kind.name == "sketched" and kind.budgeted and kind.compresses and not kind.exact
        same = CacheSpec("Sk", _factory, capabilities=every, kind="lossy", budget=LOSSY)

        registry, info = load_checks(), model_info("llama")
        first = {}
        for case in load_cases(known_checks=registry):
            first.setdefault(case.check, case)
        judged_new = {name for name, check in registry.items() if name in first
                      and skip_reason(new, info, check, first[name]) is None}
        judged_lossy = {name for name, check in registry.items() if name in first
                        and skip_reason(same, info, check, first[name]) is None}
        # the one difference is a fact: a sketch does not quantize (``quantizes`` unset), so the residual flush of
        # a quantized cache is not its check
        assert judged_lossy - judged_new == {"check_reorder_after_flush"} and judged_new <= judged_lossy
        assert {"check_quality_budget", "check_compression_real"} <= judged_new  # the quality family judges it
        families = {registry[name].family for name in judged_new}
        assert {"quality", "batch", "generate", "logits", "speed"} <= families, families
    finally:
        kinds.KINDS.pop("sketched", None)
