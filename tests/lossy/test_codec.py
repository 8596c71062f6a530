"""A lossy cache with no memory promise (``saves_memory=False``): quality and self-consistency judged, compression
skipped with that reason; a cache that promises a saving and rounds through a codec but keeps the decoded floats
fails compression with the true cause (the codec runs), one whose codec never runs with "never reached"."""

from __future__ import annotations

import pytest

from kvconform.api import check_cache
from kvconform.subjects import CacheSpec, SpecError, kind_of, validate_spec

_M = "kvconform.testing.codec"


CASES = {"check_compression_real": "compression_long", "check_quality_budget": "quality_long",
         "check_prefill_then_decode": "decode_implicit_positions"}


def _results(attr, checks):
    return {r.check: r for r in check_cache(f"{_M}:{attr}", models=["llama"], checks=checks,
                                            cases=[CASES[c] for c in checks])}


def test_no_memory_promise_skips_compression_and_judges_quality_and_consistency():
    r = _results("CodecRoundTripCache", ["check_compression_real", "check_quality_budget",
                                         "check_prefill_then_decode"])
    assert r["check_compression_real"].outcome == "skipped"
    assert r["check_compression_real"].message.startswith(
        "CodecRoundTripCache promises no memory saving (saves_memory=False in its budget)")
    assert r["check_quality_budget"].outcome == "passed", r["check_quality_budget"].message
    assert 0 < r["check_quality_budget"].metrics["kl_mean"] < 1e-3
    assert r["check_prefill_then_decode"].outcome == "passed"
    assert r["check_prefill_then_decode"].metrics["max_abs"] <= r["check_prefill_then_decode"].metrics["tolerance"]


def test_its_quality_is_still_judged():
    r = _results("CodecCoarse", ["check_quality_budget"])
    assert r["check_quality_budget"].outcome == "failed"
    assert "KL(oracle ‖ subject) = " in r["check_quality_budget"].message


def test_a_codec_that_keeps_decoded_floats_gets_the_true_cause():
    r = _results("CodecClaimsSaving", ["check_compression_real"])["check_compression_real"]
    assert r.outcome == "failed" and "1.000× the 245,760 B an exact cache must hold" in r.message
    cause = next(line for line in r.message.splitlines() if "likely cause:" in line)
    assert "the codec runs but the cache stores its decoded output" in cause
    assert "never reached" not in cause
    delta = float(cause.split("differ from the exact keys/values by up to ")[1].split(" ")[0])
    assert 1e-3 < delta < 0.1  # int8 rounding of the zoo's keys/values, measured against ReferenceCache
    assert "saves_memory=False" in cause


def test_a_codec_that_never_runs_is_never_reached():
    r = _results("CodecNeverReached", ["check_compression_real"])["check_compression_real"]
    assert r.outcome == "failed"
    assert "the compressor is never reached" in r.message
    assert "the codec runs" not in r.message


def test_saves_memory_declarations():
    from kvconform.testing.codec import CodecRoundTripCache

    spec = CacheSpec("C", CodecRoundTripCache, kind="lossy", budget={"kl_max": 1e-3, "top1_min": 0.9,
                                                                     "saves_memory": False})
    # the kind compresses (a fact of the kind), but this subject's budget promises no saving: compression unjudged
    assert kind_of(spec).compresses and not kind_of(spec).saves_memory
    from kvconform.checks.quality import _compression_judged

    assert "promises no memory saving" in _compression_judged(spec, None, None)
    for budget, match in [({"kl_max": 1, "top1_min": 0, "saves_memory": "no"}, "must be True or False"),
                          ({"kl_max": 1, "top1_min": 0, "saves_memory": False, "bytes_ratio_max": 0.5},
                           "nothing to bound")]:
        with pytest.raises(SpecError, match=match):
            validate_spec(CacheSpec("C", CodecRoundTripCache, kind="lossy", budget=budget), "check_cache")
    with pytest.raises(SpecError, match="saves_memory is for lossy and press"):
        validate_spec(CacheSpec("C", CodecRoundTripCache, kind="evicting",
                                budget={"kl_max": 1, "top1_min": 0, "tokens_max": 8, "saves_memory": False}), "x")
