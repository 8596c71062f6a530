"""ShareEvictingCache: a correct cache that evicts a *share* of its tokens at every step (H2O-style adaptive budgets,
``keep_ratio``), and faulty variants. The worked example of ``Budget.keep_ratio`` (README, "Evicting caches").

Every full-attention layer holds every token while it has seen at most ``tokens_exact`` tokens; past that, after
each forward, it keeps the first ``sinks`` tokens and the most recent ones, ``tokens_exact + ceil(keep_ratio · (seen
− tokens_exact))`` tokens in all. Eviction comes after the forward that brings the tokens (``update`` returns every
held token plus the whole new chunk); ``get_seq_length()`` counts the tokens seen; ``get_mask_sizes(q)`` announces
``(held + q, seen − held)`` (the recent tokens keep their true positions; keys keep their original rotation). Sliding
layers are transformers' window (``SinkWindowLayer(sliding_window=...)``), linear-attention states kept as
kvconform's reference keeps them. It declares the share, its exactness below ``tokens_exact`` and its scope:

    kvconform_evicting = {"kl_max": ..., "top1_min": ..., "keep_ratio": 0.5, "tokens_exact": 16}
    kvconform_supports = {"full_attention", "sliding_attention", "linear_attention", "decoder_only"}

``crop`` is exact while nothing was evicted and refused (``ValueError``, nothing changed) after: a share cannot be
rolled back, so it does not declare ``crop``.

Faulty variants (``FAULTY`` is empty: they are pinned by ``tests/semantics/test_share_evicting.py``):
``ShareKeepsTooMuch`` keeps 0.75 of the tokens while declaring 0.5 (held tokens and bytes over the declared bound);
``ShareEvictsEarly`` evicts from the first forward while declaring ``tokens_exact = 16`` (wrong logits on cases
below 16 tokens, where it promised exactness).
"""

from __future__ import annotations

import math

import torch
from transformers.cache_utils import Cache

from kvconform.compat import crop_tokens_to_remove, layer_types_and_kwargs
from kvconform.testing.evicting import SinkWindowLayer, make_sink_window_layer

KEEP_RATIO = 0.5
TOKENS_EXACT = 16
SINKS = 4


class ShareEvictingLayer(SinkWindowLayer):
    """One full-attention layer holding ``held_bound(seen)`` tokens after each forward (module docstring).

    Args:
        keep_ratio: share kept of the tokens past ``tokens_exact``, in (0, 1].
        tokens_exact: tokens seen before anything is evicted (≥ ``sinks``).
        sinks: first tokens always kept.
    """

    def __init__(self, keep_ratio: float = KEEP_RATIO, tokens_exact: int = TOKENS_EXACT, sinks: int = SINKS,
                 **ignored):
        super().__init__(sinks=sinks, window=0)
        self.keep_ratio, self.tokens_exact = keep_ratio, max(tokens_exact, sinks)

    def held_bound(self, seen: int) -> int:
        """Tokens kept after ``seen`` tokens: all of them up to ``tokens_exact``, then the share."""
        if seen <= self.tokens_exact:
            return seen
        return self.tokens_exact + math.ceil(self.keep_ratio * (seen - self.tokens_exact) - 1e-9)

    @property
    def tokens_max(self) -> int:
        return self.held_bound(self.seen)

    def _evict(self, t: torch.Tensor) -> torch.Tensor:
        n, limit = t.shape[-2], self.tokens_max
        if n <= limit:
            return t
        return torch.cat([t[..., : self.sinks, :], t[..., n - (limit - self.sinks):, :]], dim=-2)

    def _visible(self) -> int:
        return self.held

    def kvconform_held(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens, positions)`` of every held token (the next forward attends them all; keys keep their own
        rotation): see ``SinkWindowLayer.kvconform_held``."""
        tokens = self.held_token_indices()
        return tokens, tokens.clone()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Add ``[batch, kv_heads, q, head_dim]`` keys/values; return every held token plus the new chunk, then
        evict down to the share of the tokens seen."""
        self.is_initialized = True
        if self.keys is None:
            keys, values = key_states.clone(), value_states.clone()
        else:
            keys = torch.cat([self.keys, key_states], dim=-2)
            values = torch.cat([self.values, value_states], dim=-2)
        self.seen += key_states.shape[-2]
        self.keys, self.values = (keys, values) if self.record_past else (self._evict(keys), self._evict(values))
        return keys, values

    def crop_problem(self, tokens_to_remove: int) -> str | None:
        if -tokens_to_remove <= 0 or self.held == self.seen:
            return None
        return (f"it has evicted {self.seen - self.held} of its {self.seen} tokens (a share of them at every step): "
                f"a crop cannot bring them back")


class ShareEvictingCache(Cache):
    """Evicts a share of each attention layer's tokens at every step past ``tokens_exact`` (module docstring).
    ``ShareEvictingCache(config)``; other keyword arguments are accepted and ignored.

    Raises:
        NotImplementedError: a layer type it does not support (hybrid, chunked or indexed attention).
    """

    keep_ratio = KEEP_RATIO
    kvconform_evicting = {"kl_max": 0.3, "top1_min": 0.3, "keep_ratio": KEEP_RATIO, "tokens_exact": TOKENS_EXACT}
    kvconform_supports = {"full_attention", "sliding_attention", "linear_attention", "decoder_only"}
    kvconform_capabilities = {"forward", "generate", "deepcopy", "reorder", "batch_repeat", "batch_select", "reset"}

    def __init__(self, config=None, **ignored):
        ratio = type(self).keep_ratio
        if config is None:
            super().__init__(layer_class_to_replicate=lambda: type(self).layer_class(ratio))
            return
        layers = []
        for layer_type, kw in zip(*layer_types_and_kwargs(config)):
            if layer_type == "full_attention":
                layers.append(type(self).layer_class(ratio))
            elif layer_type in ("sliding_attention", "linear_attention", "conv"):
                layers.append(make_sink_window_layer(layer_type, kw, 0, 0))
            else:
                raise NotImplementedError(f"ShareEvictingCache does not support {layer_type!r} layers")
        super().__init__(layers=layers)

    layer_class = ShareEvictingLayer

    @property
    def is_compileable(self) -> bool:
        return False

    def kvconform_held(self, layer_idx: int):
        """``(tokens, positions)`` int64 ``[n]`` that layer ``layer_idx``'s next forward attends (its held tokens at
        their own positions), None for a layer without keys: read by kvconform's exact evicting check."""
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        return layer.kvconform_held() if isinstance(layer, SinkWindowLayer) else None

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens, only while nothing was evicted.

        Raises:
            ValueError: a layer has evicted tokens (nothing is changed then), or a positive argument on
                transformers ≥ 5.20.
        """
        count = -crop_tokens_to_remove(tokens_to_remove, self.get_seq_length)
        for idx, layer in enumerate(self.layers):
            problem = layer.crop_problem(count) if isinstance(layer, SinkWindowLayer) else None
            if problem:
                raise ValueError(f"ShareEvictingCache cannot crop({tokens_to_remove}): layer {idx} {problem}")
        for layer in self.layers:
            layer.crop(count)


# ------------------------------------------------------------------------------------------------ faulty variants
class ShareKeepsTooMuch(ShareEvictingCache):
    """FAULTY: keeps 0.75 of the tokens past ``tokens_exact`` while declaring ``keep_ratio`` 0.5."""

    keep_ratio = 0.75  # BUG: the share actually kept; the declaration (inherited) says 0.5


class _EarlyLayer(ShareEvictingLayer):
    def held_bound(self, seen: int) -> int:
        return max(self.sinks, math.ceil(self.keep_ratio * seen))  # BUG: evicts from the first forward


class ShareEvictsEarly(ShareEvictingCache):
    """FAULTY: evicts half its tokens from the first forward on, while declaring ``tokens_exact = 16`` (exact until
    16 tokens seen)."""

    layer_class = _EarlyLayer


FAULTY: list = []
