"""A positive ``crop(+n)`` accepted where the installed transformers refuses it (≥ 5.20) is reported, not failed:
no caller of such a release passes a positive count. The note names what the cache did (the pre-5.20 "keep n"
meaning, ``abs(n)``, or nothing), and the continuation after it is still judged; a crop that leaves an unexplained
length still fails."""

from __future__ import annotations

import pytest
from transformers.cache_utils import Cache, DynamicLayer

from kvconform import compat
from kvconform.api import check_cache

pytestmark = pytest.mark.skipif(compat.positive_crop_contract() != "raise",
                                reason="positive crop counts are accepted by this transformers release")


class _KeepNLayer(DynamicLayer):
    def crop(self, n: int) -> None:
        if n > 0:  # the pre-5.20 meaning: keep the first n tokens
            self.keys, self.values = self.keys[..., :n, :], self.values[..., :n, :]
        elif n < 0:
            self.keys, self.values = self.keys[..., :n, :], self.values[..., :n, :]


class KeepNCropCache(Cache):
    """A correct cache whose crop still implements the pre-5.20 "keep n" meaning of a positive count."""

    def __init__(self, config=None, **kwargs):
        Cache.__init__(self, layer_class_to_replicate=_KeepNLayer)


class _HalfLayer(DynamicLayer):
    def crop(self, n: int) -> None:
        keep = self.keys.shape[-2] - 1 if n > 0 else self.keys.shape[-2] + n
        self.keys, self.values = self.keys[..., :keep, :], self.values[..., :keep, :]


class OffByOneCropCache(Cache):
    """A positive count removes one token whatever n is: neither abs(n), keep n, nor ignored."""

    def __init__(self, config=None, **kwargs):
        Cache.__init__(self, layer_class_to_replicate=_HalfLayer)


def test_keep_n_crop_is_reported_not_failed():
    with pytest.warns(UserWarning, match=r"pre-5\.20 meaning of a positive count \(keep the first 2 tokens\)"):
        [result] = check_cache(KeepNCropCache, models=["llama"], checks=["check_crop_then_continue"],
                               cases=["crop_positive"])
    assert result.outcome == "passed", result.message
    assert result.metrics["positive_crop"] == "keep"
    assert "reported, not failed" in result.metrics["note"] and "abs(n)" not in result.metrics["note"]


def test_unexplained_positive_crop_still_fails():
    [result] = check_cache(OffByOneCropCache, models=["llama"], checks=["check_crop_then_continue"],
                           cases=["crop_positive"])
    assert result.outcome == "failed", result.message
    assert "neither" in result.message and "abs(n)" not in result.message.split("likely cause:")[1]
