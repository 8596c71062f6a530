"""Fixed-size (static) caches that decode right in eager mode but break what a fixed-size cache promises to
``torch.compile`` and CUDA graphs: ``update()`` handing attention copies instead of its own buffers, buffers
allocated beyond ``max_cache_len``. Both are caught by ``check_static_addresses`` (compile family) on CPU.

``SliceWriteStaticCache`` is the correct cache of another design (slice assignment and a Python length instead of
``StaticLayer``'s ``index_copy_`` and length tensor) that passes the same check. Each faulty class carries one bug
(marked ``# BUG:``); ``FAULTY`` pins the check, case and likely-cause line (``tests/caches/test_faulty_caches.py``).
Written for the installed transformers' ``StaticLayer`` (5.24: ``StaticLayer(max_cache_len)``).
"""

from __future__ import annotations

from transformers.cache_utils import Cache, StaticCache, StaticLayer

from kvconform.compat import layer_types_and_kwargs
from kvconform.testing import FaultyCache


class _CopyingStaticLayer(StaticLayer):
    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        # BUG: "defensive" copies: attention gets fresh tensors, not the buffers written in place
        return keys.clone(), values.clone()


class CopyingStaticCache(StaticCache):
    """A ``StaticCache`` whose ``update()`` returns ``.clone()`` of its buffers: right logits eagerly, but a CUDA
    graph captured on the copies replays stale keys, and the in-place contract torch.compile relies on is gone."""


    def __init__(self, config, max_cache_len=64, **kwargs):
        super().__init__(config=config, max_cache_len=max_cache_len)
        for layer in self.layers:
            if type(layer) is StaticLayer:
                layer.__class__ = _CopyingStaticLayer


class OversizedStaticCache(StaticCache):
    """A ``StaticCache`` that allocates twice ``max_cache_len`` slots per layer ("room to grow"): right logits,
    twice the memory, and a mask over slots nobody asked for."""


    def __init__(self, config, max_cache_len=64, **kwargs):
        # BUG: the buffers are sized from a doubled length, not the max_cache_len asked for
        super().__init__(config=config, max_cache_len=2 * max_cache_len)


class _SliceWriteLayer(StaticLayer):
    """Fixed-size buffers written by slice assignment at a Python offset; returns its own buffers."""

    def __init__(self, max_cache_len: int):
        super().__init__(max_cache_len=max_cache_len)
        self.length = 0

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        self.keys[:, :, self.length:self.length + n].copy_(key_states)
        self.values[:, :, self.length:self.length + n].copy_(value_states)
        self.length += n
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def reset(self) -> None:
        super().reset()
        self.length = 0


class SliceWriteStaticCache(Cache):
    """A correct fixed-size cache of another design than ``StaticCache``: full-attention layers only, written by
    slice assignment at a Python offset (no ``index_copy_``, no length tensor), handing attention its own buffers."""

    def __init__(self, config=None, max_cache_len=64, **kwargs):
        types, _ = layer_types_and_kwargs(config)
        super().__init__(layers=[_SliceWriteLayer(max_cache_len) for _ in types])


FAULTY = [
    FaultyCache(
        name="static_update_copies", attr="CopyingStaticCache", module=__name__, family="compile",
        check="check_static_addresses", model="llama", case="static_addresses",
        message=("check_static_addresses failed: CopyingStaticCache on llama",
                 "returned keys/values that are not the cache's own buffers"),
        cause=r"update\(\) returns copies \(.clone\(\), torch.cat, a sliced-and-copied tensor\) instead of the "
              r"buffers it wrote into",
        # transformers' StaticLayer faults it keeps (calls super().update, inherits crop): known faults
        # 'static-capacity-indexerror' (lifecycle) and 'static-crop-unclamped' (crop)
        also_caught_by=("lifecycle", "crop"),
    ),
    FaultyCache(
        name="static_oversized", attr="OversizedStaticCache", module=__name__, family="compile",
        check="check_static_addresses", model="llama", case="static_addresses",
        message=("check_static_addresses failed: OversizedStaticCache on llama",
                 "layer 0 allocated 128 slots for its keys, but the cache was built with max_cache_len=64"),
        cause=r"the cache allocates its fixed-size buffers from another length than max_cache_len",
        # crop: it inherits StaticLayer.crop, whose upstream fault (known fault 'static-crop-unclamped') shows too
        also_caught_by=("memory", "crop"),
    ),
]
