"""Faulty page pools that read slots they hold no token in: ``kvconform.testing.page_pool.PagePoolCache`` with one bug
each, caught by the poisoned-capacity cases (``check_poisoned_capacity``, ``kvconform/checks/poison.py``).

Both keep the correct cache's ``kvconform_poison`` hook (they believe the slots it names are never read). While those
slots hold zeros or a token that is still valid their logits are exact; filled with NaN, the read shows. Measured on
llama (every family but speed and speculative): ``WholePageReadPoolCache`` fails only ``poison_nan`` among the
logits, crop, batch, lifecycle, prefix, generate, memory and contract items (and the compile family, whose static
addresses it does not keep although it says it is compileable); ``UseAfterFreePoolCache`` fails ``poison_nan`` and
``poison_large``, two crop cases that decode into a new page after the crop (they get the freed page back), and
``memory_decode`` (its pool never shrinks). Every line
that carries the bug is marked ``# BUG:``.

``BlockReadRingCache`` is the ring's version (``kvconform.testing.allocation.RingWindowCache`` with a ring of two
windows): once the ring has wrapped, a decode step reads the whole ring as one block — the kept tokens and the stale
entries of tokens that left the window — and widens ``get_mask_sizes`` so the sliding-window mask hides the stale
ones. With old tokens (finite) there its logits are exact; the full-tier case ``poison_ring_nan`` fills the stale
entries with NaN through the ring's hook, and NaN × 0 shows (on mistral, gemma2 and gemma3:
``tests/caches/test_poison_ring.py``; not in ``FAULTY``, whose runs are the default tier's).
"""

from __future__ import annotations

import torch

from kvconform.compat import crop_tokens_to_remove
from kvconform.testing import FaultyCache
from kvconform.testing.allocation import RingSlidingLayer, RingWindowCache
from kvconform.testing.page_pool import PAGE_TOKENS, PagePoolCache, PoolLayer


class _WholePageLayer(PoolLayer):
    """Hands attention every slot of the row's pages (a block kernel's read) and a mask as long, trusting the causal
    mask to hide the positions past the held ones. Its reads have a shape fixed by the pages, so it says it is
    compileable (which also keeps the model's mask on single-token steps)."""

    is_compileable = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.is_initialized = True
        self.pool_owner.write(self.layer_idx, key_states, value_states)
        return self.pool_owner.gather_pages(self.layer_idx, 0), self.pool_owner.gather_pages(self.layer_idx, 1)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        held = self.get_seq_length() + query_length
        return -(-held // PAGE_TOKENS) * PAGE_TOKENS, 0  # BUG: whole pages: the unused tail of the last one too


class WholePageReadPoolCache(PagePoolCache):
    """A page pool whose attention reads whole pages, the unused tail of each row's last page included (masked
    causally: exact while that tail holds zeros)."""

    def __init__(self, config=None, **ignored_kwargs):
        super().__init__(config, **ignored_kwargs)
        self.layers = [_WholePageLayer(self, i, getattr(layer, "sliding_window", None))
                       for i, layer in enumerate(self.layers)]

    def gather_pages(self, layer_idx: int, half: int) -> torch.Tensor:
        """Keys (``half`` 0) or values of every slot of each row's pages, ``[batch, kv_heads, pages·4, head_dim]``."""
        assert self.pool is not None
        pages, slots = self._positions(0, len(self.block_tables[0]) * PAGE_TOKENS)  # BUG: past the held length
        return self.pool[:, layer_idx, half][pages, :, slots].permute(0, 2, 1, 3)


class UseAfterFreePoolCache(PagePoolCache):
    """A page pool whose ``crop()`` returns to the free list every page past the last *full* one, the partly filled
    page that still holds the row's last tokens included, while the block tables keep it (exact until that page is
    handed out again). Its pool keeps its pages once allocated (free pages wait on the free list for reuse)."""

    def _release(self, pages: list[int]) -> None:
        self.free = sorted(set(self.free) | set(pages))  # a pool that keeps its capacity: nothing given back

    def crop(self, max_length: int) -> None:
        drop = crop_tokens_to_remove(int(max_length), lambda: max(self.lengths, default=0))
        self.lengths = [max(n - drop, 0) for n in self.lengths]
        keep = -(-max(self.lengths, default=0) // PAGE_TOKENS)
        full = max(self.lengths, default=0) // PAGE_TOKENS  # BUG: floor: the partly filled page counts as free
        freed = [page for table in self.block_tables for page in table[full:]]
        self.block_tables = [table[:keep] for table in self.block_tables]
        self._free_pages(freed)


class _BlockReadRingLayer(RingSlidingLayer):
    """A ring of two windows whose decode step, once the ring has wrapped, returns the whole ring (oldest slot first)
    and lets the mask hide what left the window."""

    ring_factor = 2

    def _block_read(self, query_length: int) -> bool:
        ring = self._ring["keys"]
        return (query_length == 1 and not self.record_past and ring is not None and ring.dim() == 4
                and ring.shape[-2] == self.slots and self._held["keys"] >= self.sliding_window - 1
                and self.cumulative_length + 1 >= self.slots)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self._block_read(query_length):  # BUG: the block covers stale slots; "the sliding mask hides them"
            return self.slots, self.cumulative_length + 1 - self.slots
        return super().get_mask_sizes(query_length)

    def update(self, key_states, value_states, *args, **kwargs):
        ring = self._ring["keys"]
        block = self._block_read(key_states.shape[-2]) and ring.shape[:2] == key_states.shape[:2]
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        if not block:
            return keys, values
        out = []
        for name in ("keys", "values"):
            ring = self._ring[name]
            slots = ring.shape[-2]
            newest = (self._start[name] + self._held[name] - 1) % slots
            # BUG: every slot of the ring is read, the stale entries of tokens past the window included
            out.append(ring.index_select(-2, (newest + 1 + torch.arange(slots, device=ring.device)) % slots))
        return out[0], out[1]


class BlockReadRingCache(RingWindowCache):
    """FAULTY: a ring of two windows per sliding layer whose decode reads the whole ring under the mask (above)."""

    sliding_class = _BlockReadRingLayer


FAULTY = [
    FaultyCache(
        name="poison_whole_page_read", attr="WholePageReadPoolCache", module=__name__, family="logits",
        check="check_poisoned_capacity", model="llama", case="poison_nan",
        message=("check_poisoned_capacity failed: WholePageReadPoolCache on llama",
                 "with the unused slots filled with NaN", "slots filled by its kvconform_poison() hook"),
        cause=r"the cache reads slots it holds no token in",
        also_caught_by=("compile",),  # it says it is compileable: its reads of the pool are not static addresses
    ),
    FaultyCache(
        name="poison_use_after_free", attr="UseAfterFreePoolCache", module=__name__, family="logits",
        check="check_poisoned_capacity", model="llama", case="poison_nan",
        message=("check_poisoned_capacity failed: UseAfterFreePoolCache on llama",
                 "with the unused slots filled with NaN", "[failed at decode"),
        cause=r"the cache reads slots it freed: after crop",
        also_caught_by=("crop", "memory"),  # a crop case decoding into a new page gets the freed one back; the pool
        # never shrinks
    ),
]
