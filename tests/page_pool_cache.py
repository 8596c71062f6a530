"""A page-pool KV cache written from scratch the way a vLLM-style author would: a design kvconform does not bundle.

``PagePoolCache`` owns one **pool** of pages (``pages``: page id → ``[2, kv_heads, PAGE, head_dim]`` tensor, keys
and values of ``PAGE`` tokens of one row of one layer), a **free list** of page ids to reuse and, per layer, a
**block table** per row (the page ids holding that row's tokens, in order). Its layers hold no tensor: each reaches
the pool through a back-reference to the cache. ``crop`` and ``reset`` give pages back to the free list (their
tensors are dropped); ``reorder_cache`` / ``batch_select_indices`` move block tables, and a row taken twice (a beam
fork, ``batch_repeat_interleave``) gets its own copies of the pages (copy on write, done at once). Attention layers
only (``kvconform_supports``).

Its decode gathers every page of a row (a Python loop): it is slower per step the longer the context, which the
speed family reports (``speed_flat_decode``); every other item of llama's default tier passes. Checked by hand on
llama: prefill 6 + decode 3 gives the same keys as ``DynamicCache`` (``torch.equal``), 3 pages of
each row of each layer, and a crop of 5 leaves 1 page per row and layer, the 2 others on the free list.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

PAGE = 4
"""Tokens per page."""


class PoolLayer(CacheLayerMixin):
    """One attention layer: its rows' block tables and its length; the pages live in the cache's pool."""

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(self, cache: PagePoolCache):
        # no CacheLayerMixin.__init__: it assigns self.keys, a property here
        self.cache = cache
        self.tables: list[list[int]] = []
        self.length = 0
        self.is_initialized = False

    # ---------------------------------------------------------------------------------------------- pool access
    def _gather(self, half: int) -> torch.Tensor | None:
        if not self.tables or self.length == 0:
            return None
        rows = [torch.cat([self.cache.pages[p][half] for p in table], dim=-2)[:, : self.length] for table in
                self.tables]
        return torch.stack(rows)

    @property
    def keys(self) -> torch.Tensor | None:
        return self._gather(0)

    @property
    def values(self) -> torch.Tensor | None:
        return self._gather(1)

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write ``[B, H, n, D]`` keys/values after the held tokens, taking pages from the pool as needed; return every
        held key and value, ``[B, H, length, D]``."""
        self.is_initialized = True
        batch, heads, n, dim = key_states.shape
        if not self.tables:
            self.tables = [[] for _ in range(batch)]
        for row in range(batch):
            pos = self.length
            while pos < self.length + n:
                index, offset = divmod(pos, PAGE)
                if index == len(self.tables[row]):
                    self.tables[row].append(self.cache.take(heads, dim, key_states))
                take = min(PAGE - offset, self.length + n - pos)
                page = self.cache.pages[self.tables[row][index]]
                src = slice(pos - self.length, pos - self.length + take)
                page[0, :, offset:offset + take] = key_states[row, :, src]
                page[1, :, offset:offset + take] = value_states[row, :, src]
                pos += take
        self.length += n
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    get_max_cache_shape = get_max_length

    def _keep(self, tokens: int) -> None:
        """Keep the first ``tokens`` of every row; give the pages past them back to the pool."""
        self.length = max(tokens, 0)
        need = -(-self.length // PAGE)
        for table in self.tables:
            for page in table[need:]:
                self.cache.give_back(page)
            del table[need:]

    def crop(self, max_length: int) -> None:
        """Remove the last ``-max_length`` tokens (transformers ≥ 5.14's contract).

        Raises:
            ValueError: a positive count (transformers ≥ 5.20 refuses it too).
        """
        if max_length > 0:
            raise ValueError(f"crop({max_length}): pass a negative count of tokens to remove")
        self._keep(self.length + max_length)

    def reset(self) -> None:
        self._keep(0)
        self.tables = []
        self.is_initialized = False

    def _rows(self, indices) -> None:
        """The rows ``indices`` (a row taken again gets copies of its pages); the pages of rows left go back."""
        used: set = set()
        new = []
        for i in [int(i) for i in indices]:
            if i in used:
                new.append([self.cache.copy(page) for page in self.tables[i]])
            else:
                new.append(self.tables[i])
                used.add(i)
        for i, table in enumerate(self.tables):
            if i not in used:
                for page in table:
                    self.cache.give_back(page)
        self.tables = new

    def reorder_cache(self, beam_idx) -> None:
        self._rows(beam_idx.tolist() if hasattr(beam_idx, "tolist") else beam_idx)

    def batch_select_indices(self, indices) -> None:
        self._rows(indices.tolist() if hasattr(indices, "tolist") else indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._rows([i for i in range(len(self.tables)) for _ in range(repeats)])


class PagePoolCache(Cache):
    """The cache object: the pool of pages, its free list, and one ``PoolLayer`` per decoder layer of ``config``."""

    kvconform_page_size = PAGE
    kvconform_supports = {"full_attention"}
    is_compileable = False

    def __init__(self, config, **ignored_kwargs):
        self.pages: dict[int, torch.Tensor] = {}
        self.free: list[int] = []
        self.next_id = 0
        text = config.get_text_config(decoder=True)
        super().__init__(layers=[PoolLayer(self) for _ in range(text.num_hidden_layers)])

    def take(self, heads: int, dim: int, like: torch.Tensor) -> int:
        """A page id from the free list (else a new one) holding a fresh zero page."""
        page = self.free.pop() if self.free else self._new_id()
        self.pages[page] = like.new_zeros(2, heads, PAGE, dim)
        return page

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def give_back(self, page: int) -> None:
        del self.pages[page]
        self.free.append(page)

    def copy(self, page: int) -> int:
        new = self.free.pop() if self.free else self._new_id()
        self.pages[new] = self.pages[page].clone()
        return new
