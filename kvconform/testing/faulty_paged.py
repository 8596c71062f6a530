"""Faulty paged caches: ``kvconform.testing.paged.PagedCache`` with one bug each — an allocation bug for the
``memory`` family (the first two), and pages shared by a deep copy for the ``prefix`` family
(``SharedPagesForkCache``).

Both declare their page size (``kvconform_page_size = 4``), so the memory family grants them one page per row and
layer of slack, and both still hold more than that. Their logits stay exact (reads go through ``length``), so only
the memory family can see the bug. Every line that carries the bug is marked ``# BUG:``.
"""

from __future__ import annotations

import copy

import torch

from kvconform.testing import FaultyCache
from kvconform.testing.paged import PagedAttentionLayer, PagedCache


class _PagePerTokenLayer(PagedAttentionLayer):
    """Gives every token a page of its own: ``key_pages`` holds one ``[batch, heads, n, page_size, head_dim]`` block
    of ``n`` pages per update, token ``i`` of the update in slot 0 of page ``i``."""

    def _store(self, pages, states, start):
        # BUG: one page per token instead of ceil(tokens / page_size) pages: page_size × the bytes
        block = states.new_zeros(*states.shape[:-1], self.page_size, states.shape[-1])
        block[..., 0, :] = states
        pages.append(block)

    def _read(self, pages):
        if not pages:
            return None
        return torch.cat([block[..., 0, :] for block in pages], dim=-2)[..., : self.length, :]

    def pages_needed(self, tokens: int) -> int:
        return tokens  # one page per token (see _store)

    def _free(self, count: int) -> None:  # crop / reset: keep the first ``count`` pages
        if count == 0:
            self.key_pages, self.value_pages = [], []
            return
        self.key_pages = [torch.cat(self.key_pages, dim=-3)[..., :count, :, :].clone()]
        self.value_pages = [torch.cat(self.value_pages, dim=-3)[..., :count, :, :].clone()]


class PagePerTokenCache(PagedCache):
    """A paged cache that allocates a whole page for every token (only the first slot of each page is used):
    exact logits, ``page_size`` × the bytes."""

    kvconform_capabilities = ("forward", "generate", "reset", "crop")
    layer_class = _PagePerTokenLayer


class _NeverFreeLayer(PagedAttentionLayer):
    """Keeps its pages for reuse after ``crop()`` and ``reset()``."""

    def _free(self, count: int) -> None:
        pass  # BUG: "a pool to reuse": pages past the end are never freed, by crop() nor by reset()

    def _store(self, pages, states, start):
        if pages and pages[0].shape[:-2] != states.shape[:-2]:  # a new batch size: the pool cannot be reused
            pages.clear()
        super()._store(pages, states, start)


class NeverFreedPagesCache(PagedCache):
    """A paged cache whose ``crop()`` and ``reset()`` only move the length back: the pages of the longest sequence
    seen stay allocated (exact logits: they are overwritten before they are read)."""

    kvconform_capabilities = ("forward", "generate", "reset", "crop")
    layer_class = _NeverFreeLayer


class _SharedPagesLayer(PagedAttentionLayer):
    """Copy-on-write without the copy: a deep copy gets its own page lists holding the original's page tensors."""

    def __deepcopy__(self, memo):
        new = copy.copy(self)
        # BUG: new lists, but the same page tensors: a copy's write into the last, partly filled page lands in the
        # original's page too (a fork at a page boundary hides it: the copy's first write takes a fresh page)
        new.key_pages, new.value_pages = list(self.key_pages), list(self.value_pages)
        return new


class SharedPagesForkCache(PagedCache):
    """A paged cache whose deep copies share their pages with the original (exact logits for each sequence run
    alone; the original's last page is overwritten past its length by a copy's first decode)."""

    kvconform_capabilities = ("forward", "generate", "reset", "crop", "deepcopy")
    layer_class = _SharedPagesLayer


FAULTY = [
    FaultyCache(
        name="page_per_token", attr="PagePerTokenCache", module=__name__, family="memory",
        check="check_memory_bytes", model="llama", case="memory_decode",
        message=("check_memory_bytes failed: PagePerTokenCache on llama", "(4.00× the formula)",
                 "+ one page per row (4 tokens", "granularity of layer 0: pages of 4 tokens, declared",
                 "likely cause: a new page (4 tokens, 2048 B) is allocated for every token"),
        cause=r"a new page \(4 tokens, 2048 B\) is allocated for every token",
    ),
    FaultyCache(
        name="never_freed_pages", attr="NeverFreedPagesCache", module=__name__, family="memory",
        check="check_memory_bytes", model="llama", case="memory_decode",
        message=("check_memory_bytes failed: NeverFreedPagesCache on llama", "after the reset",
                 "granularity of layer 0: pages of 4 tokens, declared",
                 "likely cause: pages are not freed by reset()"),
        cause=r"pages are not freed by reset\(\)",
    ),
    FaultyCache(
        name="shared_pages_fork", attr="SharedPagesForkCache", module=__name__, family="prefix",
        check="check_prefix_fork", model="llama", case="prefix_fork_mid_page",
        message=("check_prefix_fork failed: SharedPagesForkCache on llama",
                 "the original cache changed while its deep copies were extended"),
        also_caught_by=("fuzz",),  # fuzz_quick forks mid-page and then decodes the original: 2.8 off
        cause=r"__deepcopy__ shares tensors",
    ),
]
