"""Poisoned capacity on rings (full tier, ``poison_ring_nan`` / ``poison_ring_large``, mistral, gemma2 and gemma3,
window 8): a ring's stale entries — the slot of the token that just left the window, and every further slot of a
ring larger than the window — filled with NaN through the ring's ``kvconform_poison`` hook, until it has wrapped
twice.

transformers' ``StaticSlidingWindowLayer`` keeps no stale entry once full (it rolls its ``sliding_window`` slots and
a decode step reads all of them), so kvconform fills only its unused tail before it wraps, with finite values (it is
read under a mask: NaN × 0 is NaN); the NaN case skips it, naming why.
"""

from __future__ import annotations

import pytest

from kvconform.api import check_cache

MODELS = ["mistral", "gemma2", "gemma3"]
CASES = ["poison_ring_nan", "poison_ring_large"]


@pytest.fixture(scope="module")
def results():
    found = check_cache(["kvconform.testing.allocation:RingWindowCache",
                         "kvconform.testing.page_pool:PagePoolCache",
                         "kvconform.testing.faulty_poison:BlockReadRingCache", "transformers:StaticCache"],
                        models=MODELS, checks=["check_poisoned_capacity"], cases=CASES, full=True)
    return {(r.subject, r.model, r.case): r for r in found}


def test_a_ring_reading_its_stale_entries_under_the_mask_is_caught_by_nan_only(results):
    for model in MODELS:
        nan = results["BlockReadRingCache", model, "poison_ring_nan"]
        assert nan.outcome == "failed", (model, nan.outcome, nan.message)
        assert "NaN/inf with the unused slots filled with NaN" in nan.message, nan.message
        assert "the cache reads slots it holds no token in" in nan.message, nan.message
        # large finite values are hidden by the mask: the read is invisible without NaN
        assert results["BlockReadRingCache", model, "poison_ring_large"].outcome == "passed"


def test_correct_caches_pass_or_skip_naming_why(results):
    for model in MODELS:
        for case in CASES:
            ring = results["RingWindowCache", model, case]
            assert ring.outcome == "passed", (model, case, ring.message)
            pool = results["PagePoolCache", model, case]
            assert pool.outcome in ("passed", "skipped"), (model, case, pool.message)
        assert results["StaticCache", model, "poison_ring_large"].outcome == "passed"
        static_nan = results["StaticCache", model, "poison_ring_nan"]
        assert static_nan.outcome == "skipped" and "NaN × 0 is NaN" in static_nan.message, static_nan.message
