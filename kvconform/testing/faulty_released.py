"""A cache that keeps memory alive after it is released: the memory family's formula checks see only what the live
cache object holds, so only ``check_memory_released`` (live tensors in the process after the cache is dropped,
CPU or GPU) catches it. ``FAULTY`` pins the check, case and likely-cause line (``tests/caches/test_faulty_caches.py``);
kvconform's ``PagedCache`` (pages allocated and dropped with the cache) is the correct cache of another design
that passes it."""

from __future__ import annotations

from transformers.cache_utils import Cache, DynamicLayer

from kvconform.compat import layer_types_and_kwargs
from kvconform.testing import FaultyCache

_POOL: list = []
"""The host-side "buffer pool" of ``PooledCache``: buffers are put in, never taken out or reused."""


class _PooledLayer(DynamicLayer):
    def lazy_initialization(self, key_states, value_states, *args, **kwargs):
        super().lazy_initialization(key_states, value_states, *args, **kwargs)
        # BUG: a staging buffer per layer and request is registered in a module-level pool for "reuse", but nothing
        # ever takes one out: the pool grows with every request and outlives every cache
        _POOL.append(key_states.new_empty((key_states.shape[0], key_states.shape[1], 64, key_states.shape[-1])))


class PooledCache(Cache):
    """Exact and within the byte formula while alive; every request leaves one 64-token staging buffer per layer
    in a module-level pool that is never emptied."""


    def __init__(self, config=None, **kwargs):
        types, _ = layer_types_and_kwargs(config)
        super().__init__(layers=[_PooledLayer() for _ in types])


FAULTY = [
    FaultyCache(
        name="pool_kept_after_release", attr="PooledCache", module=__name__, family="memory",
        check="check_memory_released", model="llama", case="memory_released",
        message=("check_memory_released failed: PooledCache on llama",
                 "more of live tensors remain than after the warm-up"),
        cause=r"the cache keeps tensors alive after it is released — a pool, list or dict at class or module level",
    ),
]
