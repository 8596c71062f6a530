"""A cache scoped to the models it supports, as most published caches are: attention layers only.

* ``AttentionOnlyCache``: ``DynamicCache``'s own layers for full-attention and sliding-window layers; a model with
  any other decoder layer type (linear attention, hybrid: mamba, jamba, falcon_h1) is refused at construction with
  ``NotImplementedError`` naming the layer type — the clear way for a cache to say it does not support a model. It
  declares ``kvconform_supports = {"full_attention", "sliding_attention", "decoder_only"}``, so kvconform skips
  those models' items with that reason (and encoder-decoder models too, which it was not written for).
* ``UndeclaredAttentionOnlyCache``: the same cache without the declaration: its items on those models fail with
  "does not support …" (not as a keyword-argument problem), naming the declaration that scopes it.
"""

from __future__ import annotations

from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from kvconform.compat import layer_types_and_kwargs


class AttentionOnlyCache(Cache):
    """Full-attention and sliding-window layers as ``DynamicCache`` builds them. ``AttentionOnlyCache(config)``;
    other keyword arguments are accepted and ignored.

    Raises:
        NotImplementedError: ``config`` has a decoder layer type other than ``full_attention`` /
            ``sliding_attention`` (named in the message).
    """

    kvconform_supports = {"full_attention", "sliding_attention", "decoder_only"}

    def __init__(self, config=None, **ignored_kwargs):
        if config is None:
            super().__init__(layer_class_to_replicate=DynamicLayer)
            return
        layers = []
        for layer_type, kw in zip(*layer_types_and_kwargs(config)):
            if layer_type == "full_attention":
                layers.append(DynamicLayer())
            elif layer_type == "sliding_attention" and kw.get("sliding_window"):
                layers.append(DynamicSlidingWindowLayer(sliding_window=kw["sliding_window"]))
            else:
                raise NotImplementedError(f"AttentionOnlyCache supports attention layers only, not {layer_type!r} "
                                          f"layers")
        super().__init__(layers=layers)


class UndeclaredAttentionOnlyCache(AttentionOnlyCache):
    """``AttentionOnlyCache`` without ``kvconform_supports``: what it does not support fails its items, with the
    cause "does not support …"."""

    kvconform_supports = None
