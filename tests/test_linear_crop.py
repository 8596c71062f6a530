"""A recurrent (linear-attention) layer that claims ``is_croppable`` is caught in the default tier, and a correct
cache of the same build (transformers' ``LinearAttentionLayer`` slots, crop refused clearly) passes the same items.

The faulty caches (``kvconform.testing.faulty_linear``) pin their catching item and cause line through the registry
(``tests/test_faulty_caches.py``); here: the correct design passes both catching items, and transformers' milder fault
of the same kind (``linear-crop-recording-ssm-state``: a crop accepted while the flag says False) no longer covers a
layer that says True.
"""

from __future__ import annotations

from kvconform.api import check_cache


def test_a_linear_cache_that_refuses_crop_passes_where_the_croppable_ones_fail():
    results = check_cache("kvconform.testing.faulty_linear:RefusingLinearCache", models=["mamba", "mamba2"],
                          checks=["check_crop_then_continue", "check_crop_contract"],
                          cases=["crop_short", "crop_linear_recording"])
    assert sorted((r.model, r.case, r.outcome) for r in results) == [
        ("mamba", "crop_short", "passed"), ("mamba2", "crop_linear_recording", "passed")], [r.message for r in results]


def test_the_ssm_crop_fault_envelope_excludes_a_croppable_claim():
    from kvconform.known_faults import load_all

    [fault] = [f for f in load_all() if f.id == "linear-crop-recording-ssm-state"]
    assert fault.within({"max_abs": 0.03, "is_croppable": [False]})
    assert not fault.within({"max_abs": 0.03, "is_croppable": [True]})
    assert "is_croppable [True]" in fault.outside({"max_abs": 0.03, "is_croppable": [True]})
