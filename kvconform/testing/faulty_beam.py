"""A paged cache with a page table per batch row that reorders rows by moving page references: right for every
permutation, wrong when beam search keeps one beam twice. Caught by ``check_reorder_then_decode``'s
``beam_fork_padded`` case (``reorder_cache([0, 0, 2])``, then the two copies decode different tokens). ``FAULTY``
pins the check, case and likely-cause line (``tests/caches/test_faulty_caches.py``); the built-in caches, kvconform's
``ReferenceCache`` and the bundled ``PagedCache``, ``Int8ResidualCache`` and ``SinkWindowCache`` pass the same case.

Each row's keys and values live in pages of ``PAGE_SIZE`` tokens (``[H, PAGE_SIZE, D]``), written in place, and
``reorder_cache`` rewrites the page tables and copies nothing, which is what makes it cheap. With
``beam_idx = [0, 0, 2]`` rows 0 and 1 then point at the same pages: each writes its next token into their shared,
partly filled last page, and one overwrites the other's. The page needed copy-on-write.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvconform.compat import layer_types_and_kwargs
from kvconform.testing import FaultyCache

PAGE_SIZE = 4


class _RowPagedLayer(CacheLayerMixin):
    """``pages[b]``: the ``[H, PAGE_SIZE, D]`` key and value pages of row ``b`` (a page table per row), written in
    place; ``length`` tokens are valid in every row. Full attention only (the model's sliding masks hide old
    tokens)."""

    is_compileable = False
    is_croppable = False

    def __init__(self, sliding_window=None):
        # no CacheLayerMixin.__init__: it would assign self.keys, a read-only property here
        self.is_sliding = sliding_window is not None
        self.key_pages: list[list[torch.Tensor]] = []
        self.value_pages: list[list[torch.Tensor]] = []
        self.length = 0
        self.is_initialized = False

    def lazy_initialization(self, key_states, value_states) -> None:
        self.key_pages = [[] for _ in range(key_states.shape[0])]
        self.value_pages = [[] for _ in range(key_states.shape[0])]
        self.is_initialized = True

    @staticmethod
    def _write(pages: list, states: torch.Tensor, start: int) -> None:
        """Write ``states`` ``[H, n, D]`` (one row) at positions ``start …``, allocating pages as they fill."""
        for i in range(states.shape[-2]):  # a Python loop is fine for a bundled faulty cache of the batch family
            pos = start + i
            if pos // PAGE_SIZE == len(pages):
                pages.append(states.new_zeros(states.shape[0], PAGE_SIZE, states.shape[-1]))
            pages[pos // PAGE_SIZE][:, pos % PAGE_SIZE] = states[:, i]

    def _read(self, table: list) -> torch.Tensor | None:
        if not self.is_initialized or not self.length:
            return None
        return torch.stack([torch.cat(pages, dim=-2)[:, :self.length] for pages in table])

    @property
    def keys(self):
        return self._read(self.key_pages)

    @property
    def values(self):
        return self._read(self.value_pages)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        for b in range(key_states.shape[0]):
            self._write(self.key_pages[b], key_states[b], self.length)
            self._write(self.value_pages[b], value_states[b], self.length)
        self.length += key_states.shape[-2]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    get_max_cache_shape = get_max_length  # its name on transformers 5.5

    def reorder_cache(self, beam_idx) -> None:
        # BUG: each new row gets the page *list* of its source row, the pages themselves by reference: a row taken
        # twice shares its pages with its copy (a correct cache copies the pages of a row the second time the index
        # names it, or on the first write into a shared page)
        order = [int(i) for i in beam_idx.tolist()]
        self.key_pages = [list(self.key_pages[i]) for i in order]
        self.value_pages = [list(self.value_pages[i]) for i in order]

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("RowPagedCache does not support crop")

    def reset(self) -> None:
        self.key_pages, self.value_pages, self.length = [], [], 0
        self.is_initialized = False


class RowPagedCache(Cache):
    """Pages of ``PAGE_SIZE`` tokens per row and layer; ``reorder_cache`` moves page references (no copy-on-write)."""

    kvconform_capabilities = ("forward", "generate", "reset", "reorder")
    kvconform_page_size = PAGE_SIZE
    is_croppable = False

    def __init__(self, config=None, **kwargs):
        text = config.get_text_config(decoder=True)
        types, _ = layer_types_and_kwargs(text)
        window = getattr(text, "sliding_window", None)
        super().__init__(layers=[_RowPagedLayer(window if t == "sliding_attention" else None) for t in types])


FAULTY = [
    FaultyCache(
        name="beam_fork_shares_pages", attr="RowPagedCache", module=__name__, family="batch",
        check="check_reorder_then_decode", model="llama", case="beam_fork_padded",
        message=("check_reorder_then_decode failed: RowPagedCache on llama", "beam_fork → decode×3"),
        cause=r"reorder_cache\(\) with a beam index that holds one row twice .* left the two copies sharing a part "
              r"that one of them then overwrote",
    ),
]
