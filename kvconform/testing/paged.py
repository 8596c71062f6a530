"""A correct paged KV cache: what the memory family must pass although it holds more bytes than the formula.

``PagedCache`` stores each attention layer's keys/values in **pages** of ``PAGE_SIZE`` (4) tokens, allocated when
the first token of a page arrives and freed by ``crop()`` and ``reset()`` (the block tables of vLLM-style
caches, here one page list per layer shared by the batch). A layer holding ``S`` tokens therefore holds
``ceil(S / 4)`` pages: up to 3 tokens' bytes per row more than the formula ``2·B·H_kv·D·b·S``, which is within the
one page per row and layer that the memory family allows a cache that declares its granularity
(``kvconform_page_size = 4``; see ``kvconform.checks.memory``).

Layers: ``full_attention``, ``sliding_attention`` and ``chunked_attention`` get a ``PagedAttentionLayer``
(sliding layers are kept whole: every token stays, the model's sliding mask hides the old ones, so
``get_max_length()`` is -1 and the formula is ``S``). Linear-attention (SSM) states and FalconH1's hybrid layers have
no token axis to page: they use kvconform's reference layers (``kvconform.reference.make_reference_layer``).
``crop`` is all-or-nothing across layers (``ReferenceCache.crop``: a linear layer that cannot rewind refuses before
any layer changed).

Used by ``tests/`` (the memory family's granularity rules) and as the correct design that the faulty variants of
``kvconform/testing/faulty_paged.py`` break.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from kvconform.compat import layer_types_and_kwargs
from kvconform.reference import ATTENTION_LAYER_TYPES, BatchOpsMixin, ReferenceCache, make_reference_layer

PAGE_SIZE = 4
"""Tokens per page of ``PagedCache``."""


class PagedAttentionLayer(BatchOpsMixin, CacheLayerMixin):
    """Keys and values of one attention layer in pages.

    ``key_pages[i]`` / ``value_pages[i]`` are ``[batch, kv_heads, page_size, head_dim]`` tensors (dtype and device of
    the states the model hands over) holding absolute positions ``i·page_size … (i+1)·page_size − 1``; ``length``
    tokens are valid, the rest of the last page is zeros. Exactly ``ceil(length / page_size)`` pages are held.

    Args:
        page_size: tokens per page (≥ 1).
        sliding_window: the window of a sliding / chunked layer, or None. It only sets ``is_sliding``: all tokens
            are kept and the model's sliding mask hides the old ones.
    """

    is_compileable = False
    is_croppable = True

    def __init__(self, page_size: int = PAGE_SIZE, sliding_window: int | None = None, **ignored_kwargs):
        # no CacheLayerMixin.__init__: it would assign self.keys, a read-only property here
        if page_size < 1:
            raise ValueError(f"page_size must be ≥ 1, got {page_size}")
        self.page_size = page_size
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.key_pages: list[torch.Tensor] = []
        self.value_pages: list[torch.Tensor] = []
        self.length = 0
        self.is_initialized = False

    # ------------------------------------------------------------------------------------------ pages
    def pages_needed(self, tokens: int) -> int:
        """Pages that hold ``tokens`` tokens: ``ceil(tokens / page_size)``."""
        return -(-tokens // self.page_size)

    def _allocate(self, pages: list, like: torch.Tensor, count: int) -> None:
        """Grow ``pages`` to ``count`` zero pages shaped after ``like`` ``[batch, heads, n, head_dim]``."""
        while len(pages) < count:
            pages.append(like.new_zeros(*like.shape[:-2], self.page_size, like.shape[-1]))

    def _free(self, count: int) -> None:
        """Keep the first ``count`` pages, free the others."""
        del self.key_pages[count:]
        del self.value_pages[count:]

    def _store(self, pages: list, states: torch.Tensor, start: int) -> None:
        """Copy ``states`` ``[batch, heads, n, head_dim]`` into positions ``start … start+n−1``: the rest of a partly
        filled page, then every further page in one ``_foreach_copy_`` (a prefill is not a Python loop of copies)."""
        self._allocate(pages, states, self.pages_needed(start + states.shape[-2]))
        pos, end = start, start + states.shape[-2]
        offset = pos % self.page_size
        if offset and pos < end:
            take = min(self.page_size - offset, end - pos)
            pages[pos // self.page_size][..., offset:offset + take, :].copy_(states[..., :take, :])
            pos += take
        if pos < end:
            chunks = list(states[..., pos - start:, :].split(self.page_size, dim=-2))
            first = pos // self.page_size
            targets = [page[..., :chunk.shape[-2], :] for page, chunk in zip(pages[first:first + len(chunks)], chunks)]
            torch._foreach_copy_(targets, chunks)

    def _read(self, pages: list) -> torch.Tensor | None:
        """The ``length`` valid positions of ``pages``, ``[batch, heads, length, head_dim]`` (a new tensor)."""
        if not pages:
            return None
        return torch.cat(pages, dim=-2)[..., : self.length, :]

    # ------------------------------------------------------------------------------------------ Cache API
    @property
    def keys(self) -> torch.Tensor | None:
        return self._read(self.key_pages)

    @property
    def values(self) -> torch.Tensor | None:
        return self._read(self.value_pages)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing is allocated ahead of time: pages are allocated as tokens arrive."""
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the new keys/values ``[batch, kv_heads, n, head_dim]`` after the held ones, allocating the pages they
        need; return all held keys and values, ``[batch, kv_heads, length, head_dim]`` each."""
        self.is_initialized = True
        self._store(self.key_pages, key_states, self.length)
        self._store(self.value_pages, value_states, self.length)
        self.length += key_states.shape[-2]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        """Tokens held (an ``int``)."""
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(held + query_length, 0)``: every token is kept, from absolute position 0."""
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        """-1: no maximum (pages are allocated on demand)."""
        return -1

    get_max_cache_shape = get_max_length  # its name on transformers 5.5

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens and free the pages past the new end.

        Raises:
            ValueError: ``tokens_to_remove > 0`` (``PagedCache.crop`` translates the legacy forms first).
        """
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative count of tokens to remove")
        self.length = max(self.length + tokens_to_remove, 0)
        self._free(self.pages_needed(self.length))

    def reset(self) -> None:
        """Free every page (the layer object and its page size stay)."""
        self._free(0)
        self.length = 0
        self.is_initialized = False

    def kvconform_poison(self, value: float) -> int:
        """Fill the slots of the last page past ``length`` with ``value`` (kvconform's poisoned-capacity cases; freed
        pages are deleted, so there is nothing else); returns the token slots filled (over the batch). They are never
        read: ``_read`` cuts at ``length``."""
        offset = self.length % self.page_size
        if not self.key_pages or not offset:
            return 0
        for pages in (self.key_pages, self.value_pages):
            pages[-1][..., offset:, :] = value
        return (self.page_size - offset) * self.key_pages[-1].shape[0]

    def _map_batch(self, fn) -> None:  # reorder_cache / batch_repeat_interleave / batch_select_indices
        self.key_pages = [fn(p) for p in self.key_pages]
        self.value_pages = [fn(p) for p in self.value_pages]


class PagedCache(ReferenceCache):
    """A paged cache (see the module docstring): ``PagedAttentionLayer`` pages of ``PAGE_SIZE`` tokens for every
    attention layer of ``config`` (lazily added per layer without a config, as each half of an
    ``EncoderDecoderCache`` needs), kvconform's reference layers for SSM states.

    Args:
        config: a transformers ``PretrainedConfig`` or None.
        **ignored_kwargs: ``max_cache_len``, ``batch_size``, ``device``, ``dtype``: pages take dtype and device
            from the states they store.

    Raises:
        ValueError: a layer type neither paged nor known to the reference (e.g. ``indexed_attention``).
    """

    kvconform_page_size = PAGE_SIZE
    layer_class = PagedAttentionLayer

    def __init__(self, config=None, **ignored_kwargs):
        if config is None:
            super(ReferenceCache, self).__init__(layer_class_to_replicate=self.layer_class)
            return
        types, kwargs = layer_types_and_kwargs(config)
        layers = [self.layer_class(sliding_window=kw.get("sliding_window") if t != "full_attention" else None)
                  if t in ATTENTION_LAYER_TYPES else make_reference_layer(t, kw) for t, kw in zip(types, kwargs)]
        super(ReferenceCache, self).__init__(layers=layers)
