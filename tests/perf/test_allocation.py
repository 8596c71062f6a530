"""Allocation policies other than token by token or pages: a fixed ring of the sliding window and amortised
doubling buffers pass the memory family with their honest bound, declared or inferred; the faulty variants that
really over-hold are pinned by ``tests/caches/test_faulty_caches.py`` (``kvconform.testing.allocation.FAULTY``)."""

from __future__ import annotations

import dataclasses

import pytest

from kvconform.api import check_cache
from kvconform.subjects import SpecError, as_cache_spec, declared_allocation


@pytest.mark.parametrize("spec, model", [("kvconform.testing.allocation:RingWindowCache", "mistral"),
                                         ("kvconform.testing.allocation:DoublingCache", "llama")])
@pytest.mark.parametrize("declared", [True, False], ids=["declared", "inferred"])
def test_allocation_policy_passes_memory_bytes(spec, model, declared):
    subject = as_cache_spec(spec)
    if not declared:
        subject = dataclasses.replace(subject, allocation=None)
    [result] = check_cache(subject, models=[model], checks=["check_memory_bytes"], cases=["memory_decode"])
    assert result.outcome == "passed", result.message
    want = "preallocated" if "Ring" in spec else "doubling"
    assert any(want in a and ("declared" if declared else "inferred") in a for a in result.metrics["allocation"])


def test_a_buffer_of_max_cache_len_passes_and_one_of_a_fixed_size_fails():
    """One preallocated buffer per layer: sized by the ``max_cache_len`` it is given it passes (the preallocation
    inferred); a fixed 4,096 slots, declared by ``get_max_length()``, is held to the 64 tokens asked (from the
    newcomer try-out: a declared capacity used to be its own bound)."""
    good, bad = check_cache(["kvconform.testing.allocation:BufferCache",
                             "kvconform.testing.allocation:BufferIgnoresMaxCacheLen"],
                            models=["llama"], checks=["check_memory_bytes"], cases=["memory_decode"])
    assert good.outcome == "passed", good.message
    assert any("preallocated" in a and "inferred" in a for a in good.metrics["allocation"])
    assert bad.outcome == "failed" and "(64.00× the formula)" in bad.message
    assert "max_cache_len=64 asked, get_max_length() says 4096" in bad.message


def test_a_declared_capacity_is_held_to_what_was_asked_rounded_to_pages():
    from kvconform.checks._allocation import capacity_over_asked

    assert capacity_over_asked(4096, 64) == 64
    assert capacity_over_asked(64, 64) is None and capacity_over_asked(8, 64) is None  # a window within it
    assert capacity_over_asked(80, 70, page=16) is None and capacity_over_asked(96, 70, page=16) == 80
    assert capacity_over_asked(4096, None) is None and capacity_over_asked(-1, 64) is None


def test_without_the_policy_a_ring_over_holds_its_formula():
    """The same ring judged token by token (``min(S, window)``): the measurement really sees it hold more."""
    from kvconform.checks._allocation import expected_layer, LayerShape
    from kvconform.testing.allocation import RingSlidingLayer

    layer = RingSlidingLayer(sliding_window=8)
    shape = LayerShape("attention", token_bytes=256, dims=(2, 2, 16, 4))
    assert expected_layer(shape, layer, 5, 0).high == 5 * 256
    assert expected_layer(shape, layer, 5, 0, policy="preallocated").high == 8 * 256


def test_unknown_allocation_is_a_usage_error():
    class Bad:
        kvconform_allocation = "doubeling"

    with pytest.raises(SpecError, match="did you mean 'doubling'"):
        declared_allocation(Bad, "Bad")


def _long(spec, **replace):
    subject = as_cache_spec(spec)
    if replace:
        subject = dataclasses.replace(subject, **replace)
    [result] = check_cache(subject, models=["llama"], checks=["check_memory_bytes"], cases=["memory_long"], full=True)
    return result


def test_undeclared_doubling_is_inferred_from_its_buffer_after_one_large_prefill():
    """prefill(200) fills a 256-slot buffer with room for every decode step: no growth to observe, so the policy is
    inferred from the capacity of the buffer its keys are a view of (issue: 1.28× failed as "superseded keys/values
    are kept")."""
    result = _long("kvconform.testing.allocation:UndeclaredDoublingCache")
    assert result.outcome == "passed", result.message
    [policy] = result.metrics["allocation"]
    assert "inferred from the buffer its keys are a view of (S=200 in 256 slots" in policy


def test_a_buffer_past_doubling_fails_saying_why_not_inferred():
    result = _long("kvconform.testing.allocation:DoublingHeadroom")
    assert result.outcome == "failed"
    assert "(2.56× the formula)" in result.message
    assert ("none inferred (its keys are a view of a buffer of 512 slots for 200 tokens (2.56×), more than twice the "
            "tokens held)") in result.message
    assert "more than amortised doubling (≤ 2×) may hold, so no declared policy would explain it" in result.message
    assert "likely cause: the buffer behind its keys has 512 slots for 200 tokens (2.56×)" in result.message
    declared = _long("kvconform.testing.allocation:DoublingHeadroom", allocation="doubling")
    assert declared.outcome == "failed" and "grows by more than doubling" in declared.message


def test_a_plain_leak_is_not_inferred_as_doubling():
    """A layer that over-holds without a larger buffer behind its keys gets the line saying why nothing was
    inferred (no growth seen, no buffer capacity visible)."""
    from kvconform.checks._allocation import not_inferred

    line = not_inferred([(200, 256 * 100, None)], [(200, None)], 100)
    assert "its keys are not a view of a larger buffer" in line and "1.28× the formula" in line
    assert 'declare kvconform_allocation = "doubling"' in line
    assert "which a doubling buffer would explain" in line


def test_more_than_doubling_never_suggests_the_declaration():
    from kvconform.checks._allocation import hint_applies, not_inferred

    series = [(6, 6 * 100 * 6, None)]
    assert not hint_applies(series, [(6, None)], 100)
    line = not_inferred(series, [(6, None)], 100)
    assert "6.00× the formula, more than amortised doubling" in line and "kvconform_allocation" not in line
