"""A copy of a cache past its sliding window that keeps the right keys and values but counts its tokens wrong:
exact with explicit ``position_ids``, wrong where positions come from the cache (``get_seq_length()``). Caught by
``check_prefix_fork``'s ``prefix_fork_past_window`` case (implicit positions, prefill past the window).
``FAULTY`` pins the check, case and likely-cause line (``tests/caches/test_faulty_caches.py``); the built-in
``DynamicCache`` (a layer copied whole, counter included) and kvconform's ``ReferenceCache`` pass the same case."""

from __future__ import annotations

import copy

from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from kvconform.compat import layer_types_and_kwargs
from kvconform.testing import FaultyCache


class _RecountOnCopyLayer(DynamicSlidingWindowLayer):
    def __deepcopy__(self, memo):
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            setattr(new, key, copy.deepcopy(value, memo))
        if self.is_initialized:
            # BUG: the copy "recounts" its tokens from what it stores: past the window that is the window, not the
            # tokens seen, so the copy's get_seq_length() (and every position derived from it) starts over too low
            new.cumulative_length = int(new.keys.shape[-2])
        return new


class RecountOnCopyCache(Cache):
    """Sliding-window layers whose ``deepcopy`` sets the token count to the stored window; full-attention layers
    are plain ``DynamicLayer``s."""


    def __init__(self, config=None, **kwargs):
        types, _ = layer_types_and_kwargs(config)
        window = getattr(config.get_text_config(decoder=True), "sliding_window", None)
        super().__init__(layers=[_RecountOnCopyLayer(sliding_window=window) if t == "sliding_attention"
                                 else DynamicLayer() for t in types])


FAULTY = [
    FaultyCache(
        name="fork_recounts_window", attr="RecountOnCopyCache", module=__name__, family="prefix",
        check="check_prefix_fork", model="mistral", case="prefix_fork_past_window",
        message=("check_prefix_fork failed: RecountOnCopyCache on mistral",),
        cause=r"the deep copy counts its tokens wrong: right after copy.deepcopy its get_seq_length\(\) = 7, the "
              r"original.s = 12",
    ),
]
