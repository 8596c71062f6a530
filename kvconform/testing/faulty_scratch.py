"""Faulty variants of the worked from-scratch decoder (``kvconform.examples.tiny_decoder``): the mistakes an
author of a model written from scratch makes in their own KV cache, each one override of the correct model or
adapter. Each is caught by name (``tests/subjects/test_scratch.py``)::

    pytest --kvconform --kvconform-model kvconform.testing.faulty_scratch:NoCausalMaskInChunk

* ``NoCausalMaskInChunk``: the attention applies the causal mask only when queries and keys are as long (a prefill),
  so a chunk of several tokens into a warm cache attends its own later tokens; single-token decode is exact.
* ``RingBufferChunks``: a sliding-window ring buffer of ``window`` slots written before it is read: a chunk that
  wraps overwrites keys its own earlier queries still need.
* ``PositionsRestartAfterCrop``: the model counts positions in its cache, and its rollback resets the counter.
* ``AliasedFork``: ``fork`` copies the list of per-block dicts, not the dicts: the fork and the original share them.
* ``StaticSetupOnce``: a preallocated (static) cache whose setup returns early when buffers exist: reused (its own
  ``reset``) for a smaller batch, it keeps the old batch and the forward raises a shape error.
* ``LengthFromContents``: a static cache that counts the tokens it holds as its nonzero slots (no counter to keep
  in sync; its crop zeroes the slots it drops): right on every case until the unused slots hold anything else —
  the poisoned-capacity cases fill them (the worked example's ``poison``) and its next write lands past them.
* ``LengthCounterNotRewound``: a maskless model whose cache counts its tokens in a counter (``seq_length``) that its
  ``crop`` forgets to rewind: the logits stay right (kvconform passes ``start``), the count is wrong after a crop.
* ``Float32RotaryAtBf16``: rotary tables kept in float32 promote q and k while v stays bfloat16 / float16: every
  forward at those dtypes raises, the uncached one too — the model's fault, whatever the cache (its low-precision
  items skip once with that reason; float32 and float64 are exact).
* ``SelectIgnoresRows``: a model without a padding mask (``takes_mask = False``) whose ``select`` keeps as many rows
  as asked but the first ones, in their old order ("the beams stay in order"): a reorder or a select then decodes
  the wrong rows' history (only the unpadded batch cases reach such a model).
* ``Float64MaskOverflow``: the padding mask is built in float32 and multiplied by the scores' dtype's minimum: at
  float64 it overflows to -inf and 0 × -inf = NaN (refused when the session is built: the oracle cannot run).
"""

from __future__ import annotations

import math

import torch

from kvconform.examples.tiny_decoder import TinyDecoder, TinyDecoderModel, TinyMasklessDecoder, TinySlidingDecoder


# ---------------------------------------------------------------------------------------- no causal mask in chunks
class _NoCausalChunkModel(TinyDecoderModel):
    def attend(self, q, k, v, slots, start, mask):
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if q.shape[2] == k.shape[2]:  # a prefill: causal mask; otherwise "decode", which needs none
            causal = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
            scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
        if mask is not None:
            scores = scores.masked_fill(~mask[:, None, None, slots].bool(), torch.finfo(scores.dtype).min)
        return torch.softmax(scores, dim=-1) @ v


class NoCausalMaskInChunk(TinyDecoder):
    """A chunk into a warm cache attends without the causal mask (module docstring)."""

    name = "no_causal_chunk"
    caches = {"NoCausalChunkCache": {}}
    model_class = _NoCausalChunkModel

    def build(self, dtype, device, seed: int = 0):
        return _rebuild(super().build(dtype, device, seed), _NoCausalChunkModel)


def _rebuild(model, cls):
    """The same module (same seeded weights) with its class swapped for the faulty subclass ``cls``."""
    model.__class__ = cls
    return model


# ---------------------------------------------------------------------------------------------- ring buffer
class _RingModel(TinyDecoderModel):
    def store(self, layer_cache, k, v, start):
        w, t = self.window, k.shape[2]
        if "key" not in layer_cache:  # the prefill attends its own keys, then keeps the last window of them
            b, h, _, d = k.shape
            layer_cache["key"], layer_cache["value"] = k.new_zeros(b, h, w, d), v.new_zeros(b, h, w, d)
            layer_cache["slot_pos"] = torch.full((w,), -1, dtype=torch.long)
            keep = torch.arange(max(start + t - w, start), start + t)
            layer_cache["key"][:, :, keep % w] = k[:, :, keep - start]
            layer_cache["value"][:, :, keep % w] = v[:, :, keep - start]
            layer_cache["slot_pos"][keep % w] = keep
            return k, v, torch.arange(start, start + t)
        if t > w:
            raise ValueError(f"a chunk of {t} tokens is longer than the window ({w}): not supported")
        idx = torch.arange(start, start + t) % w  # a chunk: written into the ring, then the ring is read — the bug
        layer_cache["key"][:, :, idx] = k
        layer_cache["value"][:, :, idx] = v
        layer_cache["slot_pos"][idx] = torch.arange(start, start + t)
        return layer_cache["key"], layer_cache["value"], layer_cache["slot_pos"]


class RingBufferChunks(TinySlidingDecoder):
    """A sliding-window ring buffer fed chunks across its wrap (module docstring)."""

    name = "ring_chunks"
    caches = {"RingBufferCache": {}}

    def build(self, dtype, device, seed: int = 0):
        return _rebuild(super().build(dtype, device, seed), _RingModel)

    def capacity(self, cache) -> int:
        return self.window  # a ring of the window: at most that many tokens per row

    def crop(self, cache, n: int):
        for layer in cache:
            if "slot_pos" in layer:
                newest = int(layer["slot_pos"].max())
                layer["slot_pos"][layer["slot_pos"] > newest - n] = -1
        return cache


# ------------------------------------------------------------------------------------- positions after a rollback
class PositionsRestartAfterCrop(TinyDecoder):
    """The model keeps its own position counter in the cache; rollback resets it (module docstring)."""

    name = "restart_positions"
    caches = {"CountingCache": {}}

    def new_cache(self, model, batch_size, max_len):
        return {"blocks": [{} for _ in model.blocks], "pos": 0}

    def forward(self, model, ids, cache, start, mask=None):
        logits = model(ids, cache["blocks"], cache["pos"], mask)  # its own counter, not start
        cache["pos"] += ids.shape[1]
        return logits, cache

    def crop(self, cache, n):
        super().crop(cache["blocks"], n)
        cache["pos"] = 0  # "rollback": the author restarts the counter
        return cache

    def select(self, cache, rows):
        super().select(cache["blocks"], rows)
        return cache

    def tensors(self, cache):
        return super().tensors(cache["blocks"])


# --------------------------------------------------------------------------------------------- aliased fork
class AliasedFork(TinyDecoder):
    """``fork`` copies the list but shares the per-block dicts (module docstring)."""

    name = "aliased_fork"
    caches = {"AliasedForkCache": {}}

    def fork(self, cache):
        return list(cache)


# ------------------------------------------------------------------------------------------ static setup once
class _StaticModel(TinyDecoderModel):
    def store(self, layer_cache, k, v, start):
        b, h, t, d = k.shape
        if "key" not in layer_cache:  # setup: allocates once, returns early when buffers exist (gpt-fast style)
            layer_cache["key"] = k.new_zeros(b, h, layer_cache["max_len"], d)
            layer_cache["value"] = v.new_zeros(b, h, layer_cache["max_len"], d)
        layer_cache["key"][:, :, start:start + t] = k
        layer_cache["value"][:, :, start:start + t] = v
        n = start + t
        return layer_cache["key"][:, :, :n], layer_cache["value"][:, :, :n], torch.arange(n)


class StaticSetupOnce(TinyDecoder):
    """A static cache whose setup returns early when buffers exist (module docstring)."""

    name = "static_setup_once"
    caches = {"StaticSetupCache": {}}

    def build(self, dtype, device, seed: int = 0):
        return _rebuild(super().build(dtype, device, seed), _StaticModel)

    def new_cache(self, model, batch_size, max_len):
        return [{"max_len": max_len} for _ in model.blocks]

    def reset(self, cache):
        for layer in cache:  # reuse the buffers: zeroed, kept at the batch they were allocated for
            for name in ("key", "value"):
                if name in layer:
                    layer[name].zero_()
        return cache

    def crop(self, cache, n):
        return cache  # the write position is the start kvconform passes: nothing to rewind

    def tensors(self, cache):
        return {f"{i}.{n}": layer[n] for i, layer in enumerate(cache) for n in ("key", "value") if n in layer}


# ------------------------------------------------------------------------------------ length read from contents
def _filled(layer) -> int:
    """The slots of a static buffer that hold a token, counted as its nonzero key rows (row 0, head 0)."""
    return int((layer["key"][0, 0].abs().sum(-1) != 0).sum()) if "key" in layer else 0


class _CountingStaticModel(TinyDecoderModel):
    def store(self, layer_cache, k, v, start):
        if "capacity" not in layer_cache:
            return super().store(layer_cache, k, v, start)
        b, h, t, d = k.shape
        if "key" not in layer_cache:
            layer_cache["key"] = k.new_zeros(b, h, layer_cache["capacity"], d)
            layer_cache["value"] = v.new_zeros(b, h, layer_cache["capacity"], d)
        held = _filled(layer_cache)  # BUG: "no counter to keep in sync": the tokens held are the nonzero slots
        layer_cache["key"][:, :, held:held + t] = k
        layer_cache["value"][:, :, held:held + t] = v
        n = held + t
        return layer_cache["key"][:, :, :n], layer_cache["value"][:, :, :n], torch.arange(n)


class LengthFromContents(TinyDecoder):
    """A static cache that counts the tokens it holds as its nonzero slots (module docstring)."""

    name = "length_from_contents"
    caches = {"NonzeroStaticCache": {"static": True}}

    def build(self, dtype, device, seed: int = 0):
        return _rebuild(super().build(dtype, device, seed), _CountingStaticModel)

    def crop(self, cache, n):
        for layer in cache:  # zero the dropped slots, so the count stays right
            held = _filled(layer)
            for name in ("key", "value"):
                if name in layer:
                    layer[name][:, :, max(held - n, 0):held] = 0
        return cache


# ------------------------------------------------------------------------------------------ length counter
class LengthCounterNotRewound(TinyMasklessDecoder):
    """A cache that counts its tokens in a counter its ``crop`` forgets (module docstring)."""

    name = "counter_not_rewound"
    caches = {"CountedCache": {}}

    def new_cache(self, model, batch_size, max_len):
        return {"blocks": [{} for _ in model.blocks], "n": 0}

    def forward(self, model, ids, cache, start, mask=None):
        logits = model(ids, cache["blocks"], start, None)
        cache["n"] += ids.shape[1]
        return logits, cache

    def crop(self, cache, n):
        super().crop(cache["blocks"], n)  # BUG: cache["n"] is not rewound
        return cache

    def select(self, cache, rows):
        super().select(cache["blocks"], rows)
        return cache

    def seq_length(self, cache):
        return cache["n"]

    def capacity(self, cache):
        return -1  # it grows

    def poison(self, cache, start, value):
        return 0  # no unused slot


# ------------------------------------------------------------------------------------------ float32 rotary
class _Float32RotaryModel(TinyDecoderModel):
    def attend(self, q, k, v, slots, start, mask):
        up = torch.promote_types(q.dtype, torch.float32)  # BUG: rotary tables kept in float32 promote q and k
        return super().attend(q.to(up), k.to(up), v, slots, start, mask)


class Float32RotaryAtBf16(TinyDecoder):
    """A model whose rotary tables promote q and k to float32 while v stays in the weights' dtype (module
    docstring)."""

    name = "float32_rotary"
    caches = {"Fp32RotaryDictCache": {}, "Fp32RotaryStaticCache": {"static": True}}

    def build(self, dtype, device, seed: int = 0):
        return _rebuild(super().build(dtype, device, seed), _Float32RotaryModel)


# ------------------------------------------------------------------------------------------ select ignores rows
class SelectIgnoresRows(TinyMasklessDecoder):
    """A maskless model whose ``select`` keeps the first rows in their old order (module docstring)."""

    name = "select_ignores_rows"
    caches = {"FirstRowsCache": {}}

    def select(self, cache, rows):
        n = int(rows.shape[0])
        for layer in cache:
            if "key" in layer:  # BUG: "beams stay in order": only the batch size follows rows, the rows do not
                layer["key"], layer["value"] = layer["key"][:n], layer["value"][:n]
        return cache


# --------------------------------------------------------------------------------------- float64 mask overflow
class _Float32MaskModel(TinyDecoderModel):
    def attention_bias(self, q_pos, k_pos, key_mask, dtype):
        if key_mask is None:
            return super().attention_bias(q_pos, k_pos, key_mask, dtype)
        allowed = (k_pos[:, None, :] <= q_pos[:, :, None]) & key_mask[:, None, :].bool()
        blocked = (~allowed).to(torch.float32)  # built in float32 ...
        return (blocked * torch.finfo(dtype).min)[:, None]  # ... times float64's minimum: -inf, and 0 × -inf = NaN


class Float64MaskOverflow(TinyDecoder):
    """A padding mask built in float32 that overflows at float64 (module docstring)."""

    name = "float64_mask_overflow"
    caches = {"Float32MaskCache": {}}

    def build(self, dtype, device, seed: int = 0):
        return _rebuild(super().build(dtype, device, seed), _Float32MaskModel)
