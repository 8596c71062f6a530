"""Generate and beam search judged for lossy subjects without a twin: against kvconform's own greedy loop on a
fresh instance fed the same tokens (``check_generate_self_consistent``: two turns on one cache) and against a fresh
instance fed each beam's tokens (``check_beam_search_self_consistent``); the correct codec cache passes, a cache
whose ``get_seq_length()`` lags (invisible to self-consistency) and one whose reorder skips a layer fail."""

from __future__ import annotations

from kvconform.api import check_cache

_M = "kvconform.testing.codec"
CHECKS = ["check_generate_self_consistent", "check_beam_search_self_consistent", "check_prefill_then_decode"]


def _run(attr, checks=CHECKS):
    return {r.check: r for r in check_cache(f"{_M}:{attr}", models=["llama"], checks=checks)
            if r.case != "decode_explicit_positions" and r.case != "decode_recording" and r.dtype == "float32"}


def test_a_correct_lossy_cache_passes_generate_and_beam_search():
    r = _run("CodecRoundTripCache")
    assert r["check_generate_self_consistent"].outcome == "passed", r["check_generate_self_consistent"].message
    assert r["check_generate_self_consistent"].metrics["max_abs"] < 1e-5
    assert r["check_generate_self_consistent"].metrics["new_tokens"] == 12
    assert r["check_beam_search_self_consistent"].outcome == "passed", r["check_beam_search_self_consistent"].message
    assert r["check_beam_search_self_consistent"].metrics["max_abs"] < 1e-5


def test_a_lagging_length_only_generate_sees():
    r = _run("CodecLengthLags", ["check_generate_self_consistent", "check_prefill_then_decode"])
    assert r["check_prefill_then_decode"].outcome == "passed"  # the fresh instance lags alike
    g = r["check_generate_self_consistent"]
    assert g.outcome == "failed"
    assert "turn 2" in g.message and "vs kvconform's greedy loop on a fresh CodecLengthLags" in g.message
    assert ("likely cause: the cache holds 28 tokens where generate() should have fed 27: continuing a warm cache, "
            "generate() feeds the tokens past get_seq_length() — which reports 27 for the 28 tokens held now — so "
            "it fed 1 token(s) twice") in g.message


def test_a_reorder_that_skips_a_layer_fails_beam_search():
    r = _run("CodecStaleReorder", ["check_beam_search_self_consistent"])["check_beam_search_self_consistent"]
    assert r.outcome == "failed"
    assert "from beam search, but a fresh CodecStaleReorder fed the same tokens gives" in r.message
    assert "likely cause: reorder_cache() does not move every part of the cache" in r.message
    assert r.metrics["max_abs"] > 0.1


def test_exact_subjects_skip_the_self_consistent_checks():
    results = check_cache("kvconform.reference:ReferenceCache", models=["llama"], checks=CHECKS[:2])
    assert {r.outcome for r in results} == {"skipped"}
    assert all(r.message.startswith("applies to lossy subjects without a fake-quant twin") for r in results)
