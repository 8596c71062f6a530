"""Faulty *evicting* caches: ``SinkWindowCache`` (``kvconform.testing.evicting``; ``RerotatingSinkCache`` for
``SinkShiftSinkCache``) with one realistic bug each, all declared ``kvconform_evicting`` with the same budget. Each
is exact while it holds at most ``tokens_max`` tokens, so only the evicting contract (``kvconform.checks.contract``,
its evicting section) sees it — ``SinkShiftSinkCache`` only its exact comparison past the bound
(``check_evicting_held_exact``): its quality stays within the budget."""

from __future__ import annotations

import torch

from kvconform.testing import FaultyCache
from kvconform.testing.evicting import RerotatingSinkCache, RerotatingSinkLayer, SinkWindowCache, SinkWindowLayer


class _HeldLengthLayer(SinkWindowLayer):
    def get_seq_length(self) -> int:
        # BUG: reports the tokens held, not the tokens seen: after an eviction positions restart from tokens_max
        return self.held


class HeldLengthSinkCache(SinkWindowCache):
    """``get_seq_length()`` returns the number of tokens held: right until the first eviction, then every new token
    is placed at position ``tokens_max`` (RoPE / absolute positions restart)."""

    def __init__(self, config=None, **kwargs):
        super().__init__(config, **kwargs)
        self.layers = [_swap(layer, _HeldLengthLayer) for layer in self.layers]


class NeverEvictsSinkCache(SinkWindowCache):
    """Declares ``tokens_max`` = 64 but its window was left at a debugging value: it never evicts, so what it holds
    grows without bound (exact logits, unbounded memory)."""

    def __init__(self, config=None, **kwargs):
        super().__init__(config, sinks=4, window=10**9, **kwargs)  # BUG: the window of a debugging session


class _OwnChunkLayer(SinkWindowLayer):
    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        kv_length = min(self.held + query_length, self.tokens_max)
        return kv_length, self.seen + query_length - kv_length

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        # BUG: evicts before attending: the forward sees only sinks + window of (held + its own chunk)
        return self._evict(keys), self._evict(values)


class EvictsOwnChunkCache(SinkWindowCache):
    """Evicts inside the forward that brings the tokens: a forward over more than ``tokens_max`` tokens attends
    only the sinks and the last ``window`` of them (masks sized to match), so the prefill that crosses the bound is
    already wrong."""

    def __init__(self, config=None, **kwargs):
        super().__init__(config, **kwargs)
        self.layers = [_swap(layer, _OwnChunkLayer) for layer in self.layers]


class _CropsEvictedLayer(SinkWindowLayer):
    def crop_problem(self, tokens_to_remove: int):
        return None  # BUG: "the last k slots are still held, so the crop is fine" — the window it had is gone

    def crop(self, tokens_to_remove: int) -> None:
        k = -tokens_to_remove
        if k <= 0 or self.keys is None:
            return
        keep = max(self.held - k, 0)
        self.keys, self.values = self.keys[..., :keep, :].clone(), self.values[..., :keep, :].clone()
        self.seen = max(self.seen - k, 0)


class CropsEvictedSinkCache(SinkWindowCache):
    """Accepts ``crop(-k)`` after eviction by dropping its last ``k`` slots: the window it attends afterwards is
    ``k`` tokens short of what a cache that never saw them would hold."""

    def __init__(self, config=None, **kwargs):
        super().__init__(config, **kwargs)
        self.layers = [_swap(layer, _CropsEvictedLayer) for layer in self.layers]


class _ReorderWindowOnlyLayer(SinkWindowLayer):
    def reorder_cache(self, beam_idx) -> None:
        if self.keys is None or self.held == self.seen:
            return super().reorder_cache(beam_idx)
        # BUG: once it evicted, the "fast path" moves only the window slots: the sinks stay with the old rows
        idx = beam_idx.to(self.keys.device)
        s = self.sinks
        self.keys = torch.cat([self.keys[..., :s, :], self.keys[..., s:, :].index_select(0, idx)], dim=-2)
        self.values = torch.cat([self.values[..., :s, :], self.values[..., s:, :].index_select(0, idx)], dim=-2)


class ReorderWindowOnlySinkCache(SinkWindowCache):
    """``reorder_cache`` after an eviction moves the recent window with its rows but leaves the sinks behind (beam
    search then mixes one beam's sinks with another's window); exact while nothing was evicted."""

    def __init__(self, config=None, **kwargs):
        super().__init__(config, **kwargs)
        self.layers = [_swap(layer, _ReorderWindowOnlyLayer) for layer in self.layers]


# ---------------------------------------------------------------------------------------- sinks re-rotated too far
class _SinkShiftLayer(RerotatingSinkLayer):
    def _sink_shift(self) -> int:
        if self.held == self.seen or self.held <= self.sinks:
            return 0
        return self.seen - self.window  # BUG: the tokens evicted, counted without subtracting the sinks


class SinkShiftSinkCache(RerotatingSinkCache):
    """``RerotatingSinkCache`` whose sinks are re-rotated by the tokens seen minus the window, without subtracting
    the sink count: after an eviction every sink sits ``sinks`` positions too late, on top of the window's first
    positions. Its ``kvconform_held`` states StreamingLLM's positions (inherited); its budget is the same."""

    layer_class = _SinkShiftLayer


def _swap(layer, cls):
    """``layer`` with its class replaced by ``cls`` where it is a plain ``SinkWindowLayer`` (hybrid and linear
    layers are kept)."""
    if type(layer) is SinkWindowLayer:
        layer.__class__ = cls
    return layer


FAULTY = [
    FaultyCache(
        name="evicting_held_length", attr="HeldLengthSinkCache", module=__name__, family="contract",
        check="check_evicting_bounds", model="llama",
        message=("check_evicting_bounds failed: HeldLengthSinkCache on llama",
                 "get_seq_length() = 64 after prefill(69), but should be 69 (tokens seen)",
                 "likely cause: get_seq_length() reports the tokens held (64), not the tokens seen"),
        also_caught_by=("quality",), case="evicting_bounds",
        cause=r"reports the tokens held \(64\), not the tokens seen",
    ),
    FaultyCache(
        name="evicting_never", attr="NeverEvictsSinkCache", module=__name__, family="contract",
        check="check_evicting_bounds", model="llama",
        message=("check_evicting_bounds failed: NeverEvictsSinkCache on llama",
                 "attention layer 0 holds 69 tokens per row after prefill(69) (69 seen), but tokens_max is 64",
                 "likely cause: the cache does not evict"),
        also_caught_by=("quality",), case="evicting_bounds", cause=r"the cache does not evict",
    ),
    FaultyCache(
        name="evicting_own_chunk", attr="EvictsOwnChunkCache", module=__name__, family="contract",
        check="check_evicting_bounds", model="llama",
        message=("check_evicting_bounds failed: EvictsOwnChunkCache on llama",
                 "prefill(69) into an empty cache: max|Δlogit| = ",
                 "likely cause: the cache evicts inside the forward that brings the tokens (its own chunk)"),
        also_caught_by=("quality",), case="evicting_bounds", cause=r"evicts inside the forward that brings the tokens",
    ),
    FaultyCache(
        name="evicting_crops_evicted", attr="CropsEvictedSinkCache", module=__name__, family="contract",
        check="check_evicting_crop", model="llama",
        message=("check_evicting_crop failed: CropsEvictedSinkCache on llama",
                 "crop(-2) after eviction was accepted, and the next logits differ from a fresh instance fed the "
                 "first 67 of the tokens",
                 "likely cause: the cache accepts a crop back past tokens it has already evicted"),
        also_caught_by=(), case="evicting_crop", cause=r"accepts a crop back past tokens it has already evicted",
    ),
    FaultyCache(
        name="evicting_reorder_window_only", attr="ReorderWindowOnlySinkCache", module=__name__, family="contract",
        check="check_evicting_ops", model="llama", case="evicting_reorder",
        message=("check_evicting_ops failed: ReorderWindowOnlySinkCache on llama",
                 "after reorder: max|Δlogit| = ",
                 "against a fresh instance of the same class fed the equivalent history",
                 "likely cause: reorder_cache() does not move every held tensor (sinks and window, per layer)"),
        also_caught_by=(), cause=r"reorder_cache\(\) does not move every held tensor",
    ),
    FaultyCache(
        name="evicting_sink_shift", attr="SinkShiftSinkCache", module=__name__, family="contract",
        check="check_evicting_held_exact", model="llama", case="evicting_held_exact",
        message=("check_evicting_held_exact failed: SinkShiftSinkCache on llama",
                 "decode 1 of 6 (row 0, 69 tokens seen, 64 held): max|Δlogit| = ",
                 "held: tokens [0..3, 9..68] at positions [5..68]"),
        also_caught_by=(), cause=r"keys re-rotated by a wrong shift \(e\.g\. sinks moved without subtracting",
    ),
]

