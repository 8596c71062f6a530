"""A vLLM-style page pool owned by the cache object, and faulty variants that only a count of what the cache owns
(or a refusal judged against the reference) can see.

``PagePoolCache`` keeps the keys and values of **every layer** in one pool tensor on the cache object,
``pool`` ``[pages, layers, 2, kv_heads, PAGE_TOKENS, head_dim]`` (dtype and device of the first states written), with
a **block table** per batch row (``block_tables[row]``: the page ids holding that row's tokens, in order) and a
**free list** (``free``: page ids allocated in the pool but holding no token). A page holds ``PAGE_TOKENS`` (4)
tokens of one row for all layers. The layers (``PoolLayer``) hold no tensor: each reaches the pool through a
back-reference to its cache (``layer.pool_owner``), as a vLLM attention layer reaches its KV cache through the engine.

Allocation: a forward that needs a new page takes the lowest free page id, else the pool grows by the pages still
missing (one ``torch.cat``). ``crop()`` returns the pages past the new end to the free list and gives back the pool's
trailing free pages; ``reset()`` releases the whole pool (a new sequence may have another batch size). So a cache
holding ``S`` tokens per row holds ``B · ceil(S / 4)`` pages: the bytes of ``2·L·B·H_kv·D·b · 4·ceil(S/4)``, within one
page per row and layer of the memory family's formula (it declares ``kvconform_page_size = 4``). Batch ops
(reorder, select, repeat) copy each new row's pages into pages of its own (no copy-on-write: correct, simple).

By hand, llama of the zoo (2 layers, 2 K/V heads, head size 16, float32) at batch 2: one page is
``2 layers · 2 · 2 heads · 4 tokens · 16 · 4 B = 2,048 B``; after ``prefill 12, chunk 4, decode 8`` (S = 24) the pool
holds ``2 rows · 6 pages = 12 pages = 24,576 B``, the formula ``2·2·2·2·24·16·4 = 24,576 B``; after ``reset, prefill
6`` 4 pages (8,192 B) against 6,144 B (the rest of the second page of each row, within the page allowance).

Faulty variants (every line that carries the bug is marked ``# BUG:``):

* ``LeakyPagePoolCache``: ``reset()`` and ``crop()`` drop pages from the block tables but never return them to the
  free list, so every page of every earlier sequence stays in the pool (exact logits: the leaked pages are never
  read). The memory family catches it only because it counts the pool on the cache object.
* ``ForkLeakPagePoolCache``: a reorder (beam search keeping two continuations of one beam, ``beam_fork``) gives each
  row fresh copies of its pages but never returns the pages the rows held before, so every reorder leaks a batch's
  worth of pages (exact logits: the leaked pages are never read again). Only a memory case that reorders sees it.
* ``StaleTablesPagePoolCache``: ``reset()`` empties each row's block table but keeps the rows, so the next sequence
  must have the old batch size: a batch of another size is refused (``"holds 4 rows, got a batch of 2"``), although
  the correct cache and kvconform's reference accept it. Memory and logits are right otherwise.
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvconform.compat import crop_tokens_to_remove
from kvconform.testing import FaultyCache

PAGE_TOKENS = 4
"""Tokens of one row per page of ``PagePoolCache``."""


class PoolLayer(CacheLayerMixin):
    """One attention layer of a ``PagePoolCache``: no tensor of its own; ``update`` writes into and reads from the
    cache's pool through ``pool_owner`` (the back-reference), at this layer's index ``layer_idx``.

    Args:
        owner: the ``PagePoolCache`` whose pool holds this layer's keys/values.
        layer_idx: the layer's index in the pool's layer axis.
        sliding_window: the model's window for a sliding layer (only sets ``is_sliding``: every token is kept).
    """

    is_compileable = False
    is_croppable = True

    def __init__(self, owner, layer_idx: int, sliding_window: int | None = None):
        # no CacheLayerMixin.__init__: it would assign keys/values, read-only properties here
        self.pool_owner, self.layer_idx = owner, layer_idx
        self.is_sliding = sliding_window is not None
        self.sliding_window = sliding_window
        self.is_initialized = False

    @property
    def keys(self) -> torch.Tensor | None:
        """The held keys ``[batch, kv_heads, length, head_dim]`` gathered from the pool (None before any write)."""
        return self.pool_owner.gather(self.layer_idx, 0)

    @property
    def values(self) -> torch.Tensor | None:
        """The held values, as ``keys``."""
        return self.pool_owner.gather(self.layer_idx, 1)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing: the pool is allocated by the cache as pages are needed."""
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write ``key_states`` / ``value_states`` ``[batch, kv_heads, n, head_dim]`` after the held tokens; return
        every held key and value, ``[batch, kv_heads, length, head_dim]`` each.

        Raises:
            ValueError: a batch of another size than the rows the cache holds (before anything is written).
        """
        self.is_initialized = True
        self.pool_owner.write(self.layer_idx, key_states, value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        """Tokens this layer holds per row (an ``int``)."""
        return self.pool_owner.lengths[self.layer_idx]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(held + query_length, 0)``: every token is kept, from position 0."""
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        """-1: pages are allocated on demand."""
        return -1

    get_max_cache_shape = get_max_length  # its name on transformers 5.5

    def reset(self) -> None:  # the cache resets the pool; a layer has nothing of its own
        self.is_initialized = False


class PagePoolCache(Cache):
    """A page pool owned by the cache object (see the module docstring).

    Args:
        config: the model's ``PretrainedConfig`` (its decoder's text config): ``num_decoder_layers`` layers where the
            config has them (t5), else ``num_hidden_layers``, each a ``PoolLayer``.
        **ignored_kwargs: ``max_cache_len``, ``batch_size``, ``device``, ``dtype``: the pool takes dtype, device,
            rows and head sizes from the first states written.

    Attributes:
        pool: ``[pages, layers, 2, kv_heads, PAGE_TOKENS, head_dim]`` or None (nothing allocated).
        block_tables: ``[[page id, ...] per row]`` (empty: no sequence yet).
        free: page ids in the pool that hold no token, ascending.
        lengths: tokens held per row, per layer.
    """

    kvconform_page_size = PAGE_TOKENS
    kvconform_supports = {"full_attention"}

    def __init__(self, config=None, **ignored_kwargs):
        text = config.get_text_config(decoder=True) if config is not None else None
        # an encoder-decoder's decoder may have fewer layers than its encoder (t5: num_decoder_layers)
        count = int(getattr(text, "num_decoder_layers", None) or getattr(text, "num_hidden_layers", 0) or 0)
        window = getattr(text, "sliding_window", None)
        types = list(getattr(text, "layer_types", None) or ["full_attention"] * count)
        super().__init__(layers=[PoolLayer(self, i, window if t != "full_attention" else None)
                                 for i, t in enumerate(types[:count])])
        self.pool: torch.Tensor | None = None
        self.block_tables: list[list[int]] = []
        self.free: list[int] = []
        self.lengths = [0] * count

    # ------------------------------------------------------------------------------------------ pages
    def _take_pages(self, count: int, like: torch.Tensor) -> list[int]:
        """``count`` page ids: the lowest free ones, then new pages appended to the pool (shaped after ``like``,
        ``[batch, kv_heads, n, head_dim]``)."""
        taken = self.free[:count]
        self.free = self.free[count:]
        missing = count - len(taken)
        if missing:
            shape = (missing, len(self.layers), 2, like.shape[1], PAGE_TOKENS, like.shape[-1])
            new = like.new_zeros(shape)
            start = 0 if self.pool is None else self.pool.shape[0]
            self.pool = new if self.pool is None else torch.cat([self.pool, new])
            taken += list(range(start, start + missing))
        return taken

    def _release(self, pages: list[int]) -> None:
        """Return ``pages`` to the free list, then give back the pool's trailing free pages."""
        self.free = sorted(set(self.free) | set(pages))
        if self.pool is None:
            return
        end = self.pool.shape[0]
        while end and self.free and self.free[-1] == end - 1:
            self.free.pop()
            end -= 1
        if end == 0:
            self.pool, self.free = None, []
        elif end < self.pool.shape[0]:
            self.pool = self.pool[:end].clone()

    def _positions(self, start: int, stop: int):
        """``(page ids, slots)``, both ``[rows, stop − start]`` int64, of token positions ``start … stop−1``."""
        pos = torch.arange(start, stop)
        tables = torch.tensor(self.block_tables, dtype=torch.long).reshape(len(self.block_tables), -1)
        return tables[:, pos // PAGE_TOKENS], (pos % PAGE_TOKENS).expand(len(self.block_tables), -1)

    def _check_rows(self, batch: int) -> None:
        if self.block_tables and len(self.block_tables) != batch:
            raise ValueError(f"{type(self).__name__} holds {len(self.block_tables)} rows, got a batch of {batch}")

    def write(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write one layer's new ``keys`` / ``values`` ``[batch, kv_heads, n, head_dim]`` at the row's next positions,
        taking the pages they need.

        Raises:
            ValueError: a batch of another size than the rows held (nothing written).
        """
        batch, n = keys.shape[0], keys.shape[-2]
        self._check_rows(batch)
        if not self.block_tables:
            self.block_tables = [[] for _ in range(batch)]
        start = self.lengths[layer_idx]
        need = -(-(start + n) // PAGE_TOKENS)
        for table in self.block_tables:
            if len(table) < need:
                table.extend(self._take_pages(need - len(table), keys))
        pages, slots = self._positions(start, start + n)
        assert self.pool is not None
        for half, states in ((0, keys), (1, values)):
            view = self.pool[:, layer_idx, half]  # [pages, heads, PAGE_TOKENS, head_dim]
            view[pages, :, slots] = states.to(view.dtype).permute(0, 2, 1, 3)
        self.lengths[layer_idx] = start + n

    def gather(self, layer_idx: int, half: int) -> torch.Tensor | None:
        """One layer's held keys (``half`` 0) or values (1), ``[batch, kv_heads, length, head_dim]`` (a new tensor),
        or None when the layer holds nothing."""
        length = self.lengths[layer_idx]
        if self.pool is None or not self.block_tables:
            return None
        pages, slots = self._positions(0, length)
        return self.pool[:, layer_idx, half][pages, :, slots].permute(0, 2, 1, 3)

    def kvconform_poison(self, value: float) -> int:
        """Fill every slot of the pool that holds no token with ``value`` (kvconform's poisoned-capacity cases): the
        pages on the free list and, in each row's last page, the slots past each layer's length. Returns the token
        slots filled (summed over pages, rows and layers). Those slots are never read: ``gather`` reads the held
        positions only."""
        if self.pool is None:
            return 0
        filled = 0
        if self.free:
            self.pool[self.free] = value
            filled += len(self.free) * PAGE_TOKENS * len(self.layers)
        for table in self.block_tables:
            for layer_idx, length in enumerate(self.lengths):
                for pos in range(length, len(table) * PAGE_TOKENS):
                    self.pool[table[pos // PAGE_TOKENS], layer_idx, :, :, pos % PAGE_TOKENS] = value
                    filled += 1
        return filled

    # ------------------------------------------------------------------------------------------ Cache API
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens held per row by layer ``layer_idx`` (0 for a layer the cache does not have)."""
        return self.lengths[layer_idx] if layer_idx < len(self.lengths) else 0

    def crop(self, max_length: int) -> None:
        """Forget the last tokens (the installed release's ``crop`` contract: ``compat.crop_tokens_to_remove``) and
        return the pages past the new end to the free list."""
        drop = crop_tokens_to_remove(int(max_length), lambda: max(self.lengths, default=0))
        self.lengths = [max(n - drop, 0) for n in self.lengths]
        keep = -(-max(self.lengths, default=0) // PAGE_TOKENS)
        freed = [page for table in self.block_tables for page in table[keep:]]
        self.block_tables = [table[:keep] for table in self.block_tables]
        self._free_pages(freed)

    def _free_pages(self, pages: list[int]) -> None:
        self._release(pages)

    def reset(self) -> None:
        """Release the pool and the block tables: the next sequence may have any batch size."""
        self._free_pages([page for table in self.block_tables for page in table])
        self.block_tables = []
        self.lengths = [0] * len(self.lengths)
        for layer in self.layers:
            layer.reset()

    def _map_rows(self, rows: list[int]) -> None:
        """Row ``i`` of the result is the old row ``rows[i]``: each gets pages of its own holding a copy of that
        row's (the old pages are returned to the free list first, so they are reused)."""
        if not self.block_tables or self.pool is None:
            return
        copies = [self.pool[self.block_tables[r]] for r in rows]  # advanced indexing: copies
        self._return_old_rows()
        like = self.pool.new_zeros(1, self.pool.shape[3], 1, self.pool.shape[-1])
        self.block_tables = []
        for content in copies:
            pages = self._take_pages(content.shape[0], like)
            self.pool[pages] = content
            self.block_tables.append(pages)
        self._release([])

    def _return_old_rows(self) -> None:
        """Put every page of the rows held before a reorder on the free list (their content is copied already)."""
        self.free = sorted(set(self.free) | {page for table in self.block_tables for page in table})

    def reorder_cache(self, beam_idx) -> None:
        """Rows reordered (``beam_idx``: row ``i`` becomes old row ``beam_idx[i]``)."""
        self._map_rows([int(i) for i in beam_idx])

    def batch_select_indices(self, indices) -> None:
        """Keep rows ``indices`` in that order."""
        self._map_rows([int(i) for i in indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row ``repeats`` times."""
        self._map_rows([r for r in range(len(self.block_tables)) for _ in range(int(repeats))])


class LeakyPagePoolCache(PagePoolCache):
    """A page pool whose ``crop()`` and ``reset()`` never return pages to the free list: every page of every earlier
    sequence stays in the pool (exact logits)."""

    def _free_pages(self, pages: list[int]) -> None:
        pass  # BUG: pages dropped from the block tables are never returned to the free list: they leak in the pool


class ForkLeakPagePoolCache(PagePoolCache):
    """``PagePoolCache`` whose reorders leak the pages the rows held before (see the module docstring)."""

    def _return_old_rows(self) -> None:
        pass  # BUG: the old rows' pages are never returned to the free list: the copies take pages of their own


class StaleTablesPagePoolCache(PagePoolCache):
    """A page pool whose ``reset()`` keeps its block tables' rows: the next sequence must have the old batch size."""

    def reset(self) -> None:
        rows = len(self.block_tables)
        super().reset()
        self.block_tables = [[] for _ in range(rows)]  # BUG: the rows of the previous batch are kept


class SharedPoolForkCache(PagePoolCache):
    """A page pool whose deep copy shares the pool tensor with the original (copy-on-write as its author meant it:
    "the prefix's pages are never written again"), copying only the block tables, the free list and the lengths.
    Right for a fork at a page boundary; at a fork mid-page, the copy and the original both write the free slots of
    their shared last page. Run one after the other, each reads back its own tokens (the last writer wins after the
    first has finished); decoding in turns, each reads the other's."""

    def __deepcopy__(self, memo):
        new = copy.copy(self)
        new.block_tables = [list(table) for table in self.block_tables]
        new.free, new.lengths = list(self.free), list(self.lengths)
        new.layers = [PoolLayer(new, layer.layer_idx, layer.sliding_window) for layer in self.layers]
        for old, layer in zip(self.layers, new.layers):
            layer.is_initialized = old.is_initialized
        # BUG: new.pool is self.pool: a row's last page is partly filled at a fork mid-page, and both write its slots
        return new


FAULTY = [
    FaultyCache(
        name="page_pool_leak", attr="LeakyPagePoolCache", module=__name__, family="memory",
        check="check_memory_bytes", model="llama", case="memory_decode",
        message=("check_memory_bytes failed: LeakyPagePoolCache on llama",
                 "cache object (shared by its layers) holds 32,768 B"),
        cause=r"pages are not freed by reset\(\): the pages \(4 tokens each\) of the sequence before reset\(\) are "
              r"still held after it",
    ),
    FaultyCache(
        name="page_pool_fork_leak", attr="ForkLeakPagePoolCache", module=__name__, family="memory",
        check="check_memory_bytes", model="llama", case="memory_beam",
        message=("check_memory_bytes failed: ForkLeakPagePoolCache on llama",
                 "cache object (shared by its layers) holds 73,728 B"),
        cause=r"bytes grow at a reorder of the rows \(beam search, after beam_fork\)",
    ),
    FaultyCache(
        name="page_pool_stale_tables", attr="StaleTablesPagePoolCache", module=__name__, family="lifecycle",
        check="check_reset_then_reuse", model="llama", case="reset_smaller_batch",
        message=("check_reset_then_reuse failed: StaleTablesPagePoolCache on llama",
                 "holds 4 rows, got a batch of 2", "ReferenceCache accepts it"),
        cause=r"after reset\(\) the cache still has buffers sized for the previous batch",
    ),
    FaultyCache(
        name="page_pool_shared_fork", attr="SharedPoolForkCache", module=__name__, family="prefix",
        check="check_prefix_fork", model="llama", case="prefix_fork_interleaved",
        message=("check_prefix_fork failed: SharedPoolForkCache on llama",
                 "the copies and the original in turns, one step each"),
        cause=r"the copy and the original share storage the deep copy did not copy",
    ),
]
