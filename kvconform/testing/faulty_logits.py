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


class _ScalesInputsLayer(DynamicLayer):
    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = super().update(key_states.clone(), value_states.clone(), *args, **kwargs)
        # BUG: "normalises" the caller's tensors in place after storing its own copies: what the cache holds and
        # returns is right, the model's key_states are not (harmless here, wrong for whoever reads them next)
        key_states.mul_(0.5)
        return keys, values


class ScalesInputsCache(Cache):
    """Stores exact copies of the keys/values it is given, then scales the caller's ``key_states`` in place: the
    logits are exact, the caller's tensors are not."""

    kvconform_capabilities = ("forward", "generate", "reset")

    def __init__(self, config=None, **kwargs):
        types, _ = layer_types_and_kwargs(config)
        super().__init__(layers=[_ScalesInputsLayer() for _ in types])


class _NaNStoredLayer(DynamicLayer):
    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        if keys.shape[-2] > 12:
            # BUG: an overflowed "compressed" slot: position 12 of head 0 holds inf from the first decode on
            self.keys[:, 0, 12, :] = float("inf")
        return self.keys, self.values


class NonFiniteSlotCache(Cache):
    """Writes inf into one stored key (head 0, position 12) once the cache holds more than 12 tokens."""

    kvconform_capabilities = ("forward", "generate", "reset")

    def __init__(self, config=None, **kwargs):
        types, _ = layer_types_and_kwargs(config)
        super().__init__(layers=[_NaNStoredLayer() for _ in types])


FAULTY = [
    FaultyCache(
        name="scales_inputs", attr="ScalesInputsCache", module=__name__, family="logits",
        cause=r"update\(\) modifies the caller's key/value tensors in place",
        check="check_prefill_then_decode", model="llama", case="decode_explicit_positions",
        message=("check_prefill_then_decode failed: ScalesInputsCache on llama",
                 "update(layer_idx=0) wrote into the key_states it was given",
                 "likely cause: update() modifies the caller's key/value tensors in place"),
        also_caught_by=("generate", "prefix", "lifecycle", "fuzz", "contract", "memory", "batch", "crop"),
    ),
    FaultyCache(
        name="non_finite_slot", attr="NonFiniteSlotCache", module=__name__, family="logits",
        cause=r"update\(\) returns or stores non-finite keys/values",
        check="check_prefill_then_decode", model="llama", case="decode_explicit_positions",
        message=("check_prefill_then_decode failed: NonFiniteSlotCache on llama",
                 "update(layer_idx=0) returned NaN/inf keys[batch 0, head 0, position 12]",
                 "likely cause: update() returns or stores non-finite keys/values"),
        also_caught_by=("generate", "prefix", "lifecycle", "fuzz", "contract", "memory", "batch", "crop"),
    ),
    FaultyCache(
        name="hidden_window_16", attr="HiddenWindowCache", module=__name__, family="logits",
        cause=r"update\(layer_idx=0\) returned keys of length 17 for a cache that should hold 18 tokens — "
              r"correct for the first 17 positions, wrong from position 17: older tokens are being evicted",
        check="check_prefill_then_decode", model="llama", case="decode_explicit_positions",
        message=("check_prefill_then_decode failed: HiddenWindowCache on llama",
                 "max|Δlogit| = ", "but should be ≤ ", "noise floor", "[failed at decode 6]",
                 "→ the fault is in the subject", "older tokens are being evicted"),
        also_caught_by=("generate", "prefix", "fuzz"),  # any long enough sequence shows a hidden window
    ),
    FaultyCache(
        name="chunk_tail_only", attr="ChunkTailOnlyCache", module=__name__, family="logits",
        cause=r"update\(layer_idx=0\) returned keys of length 15 for a cache that should hold 16 tokens — "
              r"feeding 2 tokens at once into a warm cache loses or misplaces state",
        check="check_chunked_continuation", model="llama", case="chunk2",
        message=("check_chunked_continuation failed: ChunkTailOnlyCache on llama",
                 "→ the fault is in the subject", "tokens at once into a warm cache"),
        also_caught_by=("contract", "prefix", "fuzz"),  # every family that feeds chunks sees it
    ),
]
