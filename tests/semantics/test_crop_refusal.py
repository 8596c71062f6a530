"""A crop the cache refuses: when a clear refusal that changes nothing conforms, and when ``is_croppable`` True makes it
a fault. Two caches written as an author would (DynamicCache subclasses whose ``crop`` refuses what they cannot do),
checked with ``check_cache`` on llama; a new user's residual-buffer cache hit the first rule as a false alarm."""

from __future__ import annotations

from transformers import DynamicCache

from kvconform import compat
from kvconform.api import check_cache

CROP_CHECKS = ["check_crop_then_continue", "check_crop_contract"]


def _tokens_to_remove(cache, max_length: int) -> int:
    """What ``crop(max_length)`` asks of a cache: ``-max_length`` tokens, or before transformers 5.14 (a
    non-negative argument) the tokens above the length to keep."""
    return -max_length if max_length < 0 else max(cache.get_seq_length() - max_length, 0)


class RefusesCropBeyondHeld(DynamicCache):
    """Crops any number of the tokens it holds; asked to remove more than it holds, it raises a clear error and
    changes nothing (instead of emptying itself)."""

    def crop(self, max_length: int) -> None:
        held = self.get_seq_length()
        if max_length < 0 and -max_length > held:
            raise ValueError(f"cannot crop {-max_length} tokens: the cache holds {held}")
        super().crop(max_length)


class RefusesDeepCrop(DynamicCache):
    """Says ``is_croppable`` True (DynamicCache's flag) but refuses to remove more than one of the tokens it holds:
    a promise assisted decoding relies on and the cache does not keep."""

    def crop(self, max_length: int) -> None:
        if _tokens_to_remove(self, max_length) > 1:
            raise ValueError(f"crop({max_length}): this cache can only remove the last token")
        super().crop(max_length)


def test_a_clear_refusal_of_a_crop_beyond_the_held_tokens_conforms():
    results = check_cache(RefusesCropBeyondHeld, models=["llama"], checks=CROP_CHECKS)
    bad = [(r.check, r.case, r.message) for r in results if r.outcome not in ("passed", "skipped")]
    assert not bad, bad
    beyond = [r for r in results if r.case == "crop_more_than_cached"]
    assert beyond and all(r.outcome == "passed" for r in beyond), beyond
    if compat.transformers_version().release >= (5, 14):
        # crop(-5) of a 3-token cache reached the cache and was refused (before 5.14 it is crop(0): kept 0 tokens)
        assert beyond[0].metrics["crop_accepted"] == [False], beyond[0].metrics


def test_a_refused_crop_of_held_tokens_fails_while_is_croppable_says_true():
    results = check_cache(RefusesDeepCrop, models=["llama"], checks=CROP_CHECKS)
    failed = [r for r in results if r.outcome == "failed"]
    assert failed, [(r.case, r.outcome) for r in results]
    for r in failed:
        assert "although is_croppable is True" in r.message, r.message
        assert "is_croppable does not account for this state" in r.message, r.message


class RefusesCropDeeperThanFour(DynamicCache):
    """Keeps an exact rollback buffer of 4 tokens (as a quantized cache with a residual does) and refuses deeper crops
    of held tokens, while ``is_croppable`` stays True: every crop of the older cases is within its buffer."""

    def crop(self, max_length: int) -> None:
        removed, held = _tokens_to_remove(self, max_length), self.get_seq_length()
        if 4 < removed <= held:
            raise ValueError(f"crop({max_length}): only the last 4 tokens can be removed exactly")
        super().crop(max_length)


def test_a_crop_as_deep_as_assisted_decoding_makes_catches_a_shallow_rollback_buffer():
    results = check_cache(RefusesCropDeeperThanFour, models=["llama"], checks=CROP_CHECKS)
    failed = {r.case: r.message for r in results if r.outcome == "failed"}
    assert set(failed) == {"crop_assisted_depth"}, failed
    assert "crop(-10) on a 16-token cache raised ValueError" in failed["crop_assisted_depth"]
    assert "although is_croppable is True" in failed["crop_assisted_depth"]


class RefusesCropOnceAWindowFilled(DynamicCache):
    """Refuses every crop once a sliding layer has seen more tokens than its window — with past recording on too,
    where DynamicCache's sliding layers keep what leaves the window and the crop can round-trip — while
    ``is_croppable`` stays True."""

    def crop(self, max_length: int) -> None:
        for layer in self.layers:
            window = getattr(layer, "sliding_window", None)
            if window and getattr(layer, "cumulative_length", 0) >= window:
                raise ValueError(f"crop({max_length}): the sliding window is full, nothing to roll back")
        super().crop(max_length)


def test_a_refused_crop_past_the_window_names_whether_past_recording_was_on():
    """The cause line of a refused crop past a full window says which mode the case ran in (from the newcomer
    try-out: a ``*_recording`` case was told "with past recording off")."""
    results = check_cache(RefusesCropOnceAWindowFilled, models=["gemma3"], checks=["check_crop_contract"],
                          cases=["crop_past_window", "crop_past_window_recording"])
    by_case = {r.case: r for r in results}
    off, on = by_case["crop_past_window"], by_case["crop_past_window_recording"]
    assert off.outcome == on.outcome == "failed", (off.message, on.message)
    assert "a sliding window already full with past recording off" in off.message, off.message
    assert "activate_past_recording() was called, yet crop() refuses a sliding window already full" in on.message
    assert "past recording off" not in on.message, on.message
