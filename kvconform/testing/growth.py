"""A cache whose buffers grow in steps of 1,024 tokens (``GrowingCache``, correct) and its faulty variant that grows
them in place with ``Tensor.resize_`` (``ResizeGrowCache``, nanochat #187).

Each attention layer holds one key and one value buffer ``[batch, kv_heads, capacity, head_dim]``; ``capacity`` starts
at the first multiple of ``GROW_STEP`` that holds the first forward's tokens and grows by whole steps when a forward
needs more. ``GrowingCache`` grows into a new buffer and copies the held tokens; ``ResizeGrowCache`` calls
``resize_`` on the buffer, which keeps its flat storage: after the first growth only row 0, head 0 keeps its tokens in
place, every other (row, head) reads the storage of another. With a step of 1,024 no default case grows it (the
longest holds 260 tokens); the full tier's ``check_growth_steps`` cases do (``kvconform/checks/growth.py``).
Every line that carries the bug is marked ``# BUG:``.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from kvconform.compat import layer_types_and_kwargs
from kvconform.reference import ATTENTION_LAYER_TYPES, BatchOpsMixin, ReferenceCache, make_reference_layer

GROW_STEP = 1024
"""Tokens a buffer of ``GrowingCache`` grows by (nanochat's step)."""


class GrowingLayer(BatchOpsMixin, CacheLayerMixin):
    """One attention layer's keys and values in buffers grown by ``GROW_STEP`` tokens (see the module docstring).

    Args:
        sliding_window: the window of a sliding layer (only sets ``is_sliding``: every token is kept).
    """

    is_compileable = False
    is_croppable = True

    def __init__(self, sliding_window: int | None = None, **ignored_kwargs):
        # no CacheLayerMixin.__init__: it would assign self.keys, a read-only property here
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.key_buffer: torch.Tensor | None = None
        self.value_buffer: torch.Tensor | None = None
        self.length = 0
        self.is_initialized = False

    @property
    def keys(self) -> torch.Tensor | None:  # type: ignore[override]  # read-only: a view of the buffer
        return None if self.key_buffer is None else self.key_buffer[:, :, : self.length]

    @property
    def values(self) -> torch.Tensor | None:  # type: ignore[override]
        return None if self.value_buffer is None else self.value_buffer[:, :, : self.length]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def _grown(self, buffer: torch.Tensor | None, like: torch.Tensor, capacity: int) -> torch.Tensor:
        """``buffer`` with room for ``capacity`` tokens, its held tokens kept (a new buffer, the tokens copied)."""
        new = like.new_zeros(*like.shape[:-2], capacity, like.shape[-1])
        if buffer is not None:
            new[:, :, : self.length] = buffer[:, :, : self.length]
        return new

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the new keys/values ``[batch, kv_heads, n, head_dim]`` after the held ones (growing the buffers by
        whole ``GROW_STEP`` steps when they are full); return the held keys and values."""
        self.is_initialized = True
        end = self.length + key_states.shape[-2]
        if self.key_buffer is None or end > self.key_buffer.shape[-2]:
            capacity = -(-end // GROW_STEP) * GROW_STEP
            self.key_buffer = self._grown(self.key_buffer, key_states, capacity)
            self.value_buffer = self._grown(self.value_buffer, value_states, capacity)
        assert self.value_buffer is not None
        self.key_buffer[:, :, self.length:end] = key_states
        self.value_buffer[:, :, self.length:end] = value_states
        self.length = end
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    get_max_cache_shape = get_max_length  # its name on transformers 5.5

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens (the buffers keep their capacity).

        Raises:
            ValueError: ``tokens_to_remove > 0``.
        """
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative count of tokens to remove")
        self.length = max(self.length + tokens_to_remove, 0)

    def reset(self) -> None:
        """Forget every token and free the buffers."""
        self.key_buffer = self.value_buffer = None
        self.length = 0
        self.is_initialized = False

    def _map_batch(self, fn) -> None:
        if self.key_buffer is not None and self.value_buffer is not None:
            self.key_buffer, self.value_buffer = fn(self.key_buffer), fn(self.value_buffer)


class GrowingCache(ReferenceCache):
    """A cache of ``GrowingLayer`` attention layers (kvconform's reference layers for SSM states), built from a
    transformers ``config`` (lazily added per layer without one).

    Args:
        config: a transformers ``PretrainedConfig`` or None.
        **ignored_kwargs: ``max_cache_len``, ``batch_size``, ``device``, ``dtype``: buffers take dtype and device
            from the states they store.
    """

    layer_class = GrowingLayer

    def __init__(self, config=None, **ignored_kwargs):
        if config is None:
            super(ReferenceCache, self).__init__(layer_class_to_replicate=self.layer_class)
            return
        types, kwargs = layer_types_and_kwargs(config)
        layers = [self.layer_class(sliding_window=kw.get("sliding_window") if t != "full_attention" else None)
                  if t in ATTENTION_LAYER_TYPES else make_reference_layer(t, kw) for t, kw in zip(types, kwargs)]
        super(ReferenceCache, self).__init__(layers=layers)


class _ResizeGrowLayer(GrowingLayer):
    def _grown(self, buffer, like, capacity):
        if buffer is None:
            return super()._grown(buffer, like, capacity)
        buffer.resize_(*buffer.shape[:-2], capacity, buffer.shape[-1])  # BUG: keeps the flat storage: rows move
        buffer[:, :, self.length:].zero_()
        return buffer


class ResizeGrowCache(GrowingCache):
    """``GrowingCache`` whose buffers grow in place with ``resize_`` (nanochat #187): right until the first growth at
    1,024 tokens, then every (row, head) but (0, 0) reads scrambled keys/values."""

    layer_class = _ResizeGrowLayer
