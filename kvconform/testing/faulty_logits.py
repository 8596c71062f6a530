"""Faulty caches for the ``logits`` family."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvconform.compat import layer_types_and_kwargs

from kvconform.testing import FaultyCache


class _ForgetfulLayer(DynamicLayer):
    """A DynamicLayer that, after each update, keeps only the newest ``keep`` tokens — a "memory saving" cap."""

    keep = 16

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        # BUG: silently drops every token older than `keep` (the layer still claims to be full attention)
        self.keys, self.values = self.keys[..., -self.keep:, :], self.values[..., -self.keep:, :]
        return keys, values


class HiddenWindowCache(Cache):
    """Full-attention layers silently drop tokens older than 16 (a hidden window): correct for short sequences,
    wrong from the 18th token on."""

    def __init__(self, config=None, **kwargs):
        types, _ = layer_types_and_kwargs(config)
        super().__init__(layers=[_ForgetfulLayer() for _ in types])


class _ChunkTailLayer(DynamicLayer):
    def update(self, key_states, value_states, *args, **kwargs):
        warm = self.get_seq_length() > 0
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        k = key_states.shape[-2]
        if warm and k > 1:
            # BUG: of a chunk fed into a warm cache only its last token is kept (a "decode fast path" reused)
            self.keys = torch.cat([keys[..., :-k, :], keys[..., -1:, :]], dim=-2)
            self.values = torch.cat([values[..., :-k, :], values[..., -1:, :]], dim=-2)
        return keys, values


class ChunkTailOnlyCache(Cache):
    """A chunk of k>1 tokens fed into a warm cache is attended correctly, but only its last token is stored."""

    def __init__(self, config=None, **kwargs):
        types, _ = layer_types_and_kwargs(config)
        super().__init__(layers=[_ChunkTailLayer() for _ in types])


FAULTY = [
    FaultyCache(
        name="hidden_window_16", attr="HiddenWindowCache", module=__name__, family="logits",
        check="check_prefill_then_decode", model="llama",
        message=("check_prefill_then_decode failed: HiddenWindowCache on llama",
                 "max|Δlogit| = ", "but should be ≤ ", "noise floor", "[failed at decode 6]",
                 "→ the fault is in the subject", "older tokens are being evicted"),
        also_caught_by=("generate", "prefix", "fuzz"),  # any long enough sequence shows a hidden window
    ),
    FaultyCache(
        name="chunk_tail_only", attr="ChunkTailOnlyCache", module=__name__, family="logits",
        check="check_chunked_continuation", model="llama",
        message=("check_chunked_continuation failed: ChunkTailOnlyCache on llama",
                 "→ the fault is in the subject", "tokens at once into a warm cache"),
        also_caught_by=("contract", "prefix", "fuzz"),  # every family that feeds chunks sees it
    ),
]
