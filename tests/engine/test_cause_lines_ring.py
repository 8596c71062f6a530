"""A ring buffer's misplaced start slot is named as such, measured in the sliding layer's keys, not blamed on the
prefill (``kvconform.testing.faulty_ring``); the correct ring of the same size (``allocation.RingWindowCache``)
passes the same items."""

from __future__ import annotations

from kvconform.api import check_cache

RING = "kvconform.testing.faulty_ring:RingStartSlotCache"
CASES = dict(models=["mistral"], checks=["check_prefill_then_decode", "check_chunked_continuation"],
             cases=["decode_explicit_positions", "chunk4_straddle_window"])


def _cause_line(message: str) -> str:
    [line] = [line.strip() for line in message.splitlines() if line.strip().startswith("likely cause:")]
    return line


def test_a_misplaced_ring_start_slot_is_named_not_blamed_on_the_prefill():
    results = {r.case: r for r in check_cache(RING, **CASES)}
    decode, chunk = results["decode_explicit_positions"], results["chunk4_straddle_window"]
    assert decode.outcome == chunk.outcome == "failed", (decode.message, chunk.message)
    # prefill(12) → decode: the ring has wrapped before the first decode step, which fails
    assert "[failed at decode 1]" in decode.message, decode.message
    for result in (decode, chunk):
        line = _cause_line(result.message)
        assert "ring buffer whose start slot" in line and "misplaced by 1 once the window wraps" in line, line
        assert "prefill" not in line and "chunk" not in line, line
        assert "stored intact" in line, line
    assert "holds the keys of positions 8-14 after 16 tokens, but should hold the last 7: 9-15" in \
        _cause_line(chunk.message)


def test_the_correct_ring_of_the_same_size_passes_the_same_items():
    results = check_cache("kvconform.testing.allocation:RingWindowCache", **CASES)
    assert [r.outcome for r in results] == ["passed", "passed"], [r.message for r in results]


def test_ranges_name_positions_compactly():
    from kvconform.checks._diagnosis import _ranges

    assert _ranges([3, 4, 5, 9]) == "3-5, 9"
    assert _ranges([]) == "none"
