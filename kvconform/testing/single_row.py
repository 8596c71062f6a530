"""Caches that serve one sequence at a time (batch 1), as many research caches do: a batch of two is refused with a
clear ``ValueError``. Every memory and compression case runs at batch 2, so kvconform measures them at batch 1 as
well: their bytes get a verdict where they run.

* ``SingleRowCache``: ``DynamicCache`` refusing batches of more than one row; exact, and holds what an exact cache
  holds (its memory items fail for the refused batch, with a line saying its bytes are within the bound at batch 1).
* ``SingleRowKeepsHistory`` (FAULTY): also keeps every chunk it was given in a "cold tier" list that is never read
  or freed: about twice an exact cache's bytes, which only a batch-1 measurement can see.
* ``SingleRowCodecClaimsSaving`` (FAULTY): ``codec.CodecClaimsSaving`` (declares a memory saving, keeps the decoded
  floats) refusing batches of more than one row: its compression fails at batch 1.
"""

from __future__ import annotations

from transformers import DynamicCache

from kvconform.testing.codec import CodecClaimsSaving


def _refuse_batch(key_states) -> None:
    if key_states.shape[0] > 1:
        raise ValueError(f"this cache serves one sequence at a time (batch size 1), got a batch of "
                         f"{key_states.shape[0]}")


class SingleRowCache(DynamicCache):
    """``DynamicCache`` for batch 1. ``SingleRowCache(config)``; other keyword arguments are ignored.

    Raises:
        ValueError: from ``update()``, a batch of more than one row.
    """

    def __init__(self, config=None, **ignored):
        super().__init__(config=config)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        _refuse_batch(key_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


class SingleRowKeepsHistory(SingleRowCache):
    """FAULTY: every chunk is also kept in its layer's ``cold`` list (a tier that is never read, cropped or freed)."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        _refuse_batch(key_states)
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        layer = self.layers[layer_idx]
        if not hasattr(layer, "cold"):
            layer.cold = []
        layer.cold.append((key_states.clone(), value_states.clone()))  # BUG: a copy of every token, kept forever
        return out


class SingleRowCodecClaimsSaving(CodecClaimsSaving):
    """FAULTY: ``CodecClaimsSaving`` for batch 1 only."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        _refuse_batch(key_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)
