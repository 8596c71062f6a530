"""Faulty paged caches for the ``memory`` family: ``kvconform.testing.paged.PagedCache`` with one allocation bug each.

Both declare their page size (``kvconform_page_size = 4``), so the memory family grants them one page per row and
layer of slack, and both still hold more than that. Their logits stay exact (reads go through ``length``), so only
the memory family can see the bug. Every line that carries the bug is marked ``# BUG:``.
"""

from __future__ import annotations

import torch

from kvconform.testing import FaultyCache
from kvconform.testing.paged import PagedAttentionLayer, PagedCache


class _PagePerTokenLayer(PagedAttentionLayer):
    """Gives every token a page of its own (slot 0 of page ``i`` holds token ``i``)."""

    def pages_needed(self, tokens: int) -> int:
        return tokens  # BUG: one page per token instead of ceil(tokens / page_size): page_size × the bytes

    def _store(self, pages, states, start):
        self._allocate(pages, states, self.pages_needed(start + states.shape[-2]))
        for i in range(states.shape[-2]):
            pages[start + i][..., :1, :].copy_(states[..., i:i + 1, :])

    def _read(self, pages):
        if not pages:
            return None
        return torch.cat([p[..., :1, :] for p in pages[: self.length]], dim=-2)


class PagePerTokenCache(PagedCache):
    """A paged cache that allocates a whole page for every token (only the first slot of each page is used):
    exact logits, ``page_size`` × the bytes."""

    kvconform_capabilities = ("forward", "generate", "reset", "crop")
    layer_class = _PagePerTokenLayer


class _NeverFreeLayer(PagedAttentionLayer):
    """Keeps its pages for reuse after ``crop()`` and ``reset()``."""

    def _free(self, count: int) -> None:
        pass  # BUG: "a pool to reuse": pages past the end are never freed, by crop() nor by reset()


class NeverFreedPagesCache(PagedCache):
    """A paged cache whose ``crop()`` and ``reset()`` only move the length back: the pages of the longest sequence
    seen stay allocated (exact logits: they are overwritten before they are read)."""

    kvconform_capabilities = ("forward", "generate", "reset", "crop")
    layer_class = _NeverFreeLayer


FAULTY = [
    FaultyCache(
        name="page_per_token", attr="PagePerTokenCache", module=__name__, family="memory",
        check="check_memory_bytes", model="llama", case="memory_decode",
        message=("check_memory_bytes failed: PagePerTokenCache on llama", "(4.00× the formula)",
                 "+ one page per row (4 tokens", "granularity of layer 0: pages of 4 tokens, declared",
                 "likely cause: a new page (4 tokens, 2048 B) is allocated for every token"),
    ),
    FaultyCache(
        name="never_freed_pages", attr="NeverFreedPagesCache", module=__name__, family="memory",
        check="check_memory_bytes", model="llama", case="memory_decode",
        message=("check_memory_bytes failed: NeverFreedPagesCache on llama", "after the reset",
                 "granularity of layer 0: pages of 4 tokens, declared",
                 "likely cause: pages are not freed by reset()"),
    ),
]
