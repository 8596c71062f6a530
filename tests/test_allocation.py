"""Allocation policies other than token by token or pages: a fixed ring of the sliding window and amortised
doubling buffers pass the memory family with their honest bound, declared or inferred; the faulty variants that
really over-hold are pinned by ``tests/test_faulty_caches.py`` (``kvconform.testing.allocation.FAULTY``)."""

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


def test_without_the_policy_a_ring_over_holds_its_formula():
    """The same ring judged token by token (``min(S, window)``): the measurement really sees it hold more."""
    from kvconform.checks.memory import expected_layer, LayerShape
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
