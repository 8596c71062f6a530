"""A from-scratch cache of our own grown in steps, as nanochat's ``KVCache`` grows: per block one
``[B, kv_heads, capacity, head_dim]`` buffer pair that starts at ``step`` tokens and, when a forward would write past
it, is reallocated ``step`` tokens (rounded up) larger with the old rows copied in. The model is the worked example's
(``kvconform.examples.tiny_decoder``); only where keys and values are kept differs::

    pytest --kvconform --kvconform-model tests/subjects/scratch_grown.py:GrownDecoder

``ResizeInPlace`` is the faulty variant nanochat shipped before it was fixed: it grows with ``tensor.resize_`` —
the storage is reinterpreted in the new shape, so after the first growth every row but the first of each head
holds another token's keys (right up to the first growth, wrong after it).
"""

from __future__ import annotations

import math

import torch

from kvconform.examples.tiny_decoder import TinyDecoder, TinyDecoderModel


class GrownModel(TinyDecoderModel):
    """The worked example's model keeping its keys and values in buffers grown in steps of ``layer["step"]``."""

    def grow(self, layer: dict, need: int):
        """Reallocate ``layer``'s buffers to hold ``need`` tokens (rounded up to the step), the old rows copied."""
        size = math.ceil(need / layer["step"]) * layer["step"]
        for name in ("key", "value"):
            old = layer[name]
            new = old.new_zeros(old.shape[0], old.shape[1], size, old.shape[3])
            new[:, :, :old.shape[2]] = old
            layer[name] = new

    def store(self, layer: dict, k, v, start: int):
        b, h, t, d = k.shape
        if "key" not in layer:
            layer["key"], layer["value"] = k.new_zeros(b, h, layer["step"], d), v.new_zeros(b, h, layer["step"], d)
        if start + t > layer["key"].shape[2]:
            self.grow(layer, start + t)
        layer["key"][:, :, start:start + t] = k
        layer["value"][:, :, start:start + t] = v
        n = start + t
        return layer["key"][:, :, :n], layer["value"][:, :, :n], torch.arange(n, device=k.device)


class GrownDecoder(TinyDecoder):
    """The adapter: the cache is one ``{"step": 16}`` dict per block, its buffers allocated by the first forward."""

    name = "grown_decoder"
    caches = {"GrownBufferCache": {}}
    step = 16

    def build(self, dtype, device, seed: int = 0):
        model = super().build(dtype, device, seed)
        model.__class__ = self.model_class
        return model

    model_class = GrownModel

    def new_cache(self, model, batch_size, max_len):
        return [{"step": self.step} for _ in model.blocks]

    def crop(self, cache, n):
        return cache  # the forward reads [:start + T]: the next write overwrites the dropped tokens

    def select(self, cache, rows):
        for layer in cache:
            if "key" in layer:
                layer["key"], layer["value"] = layer["key"][rows], layer["value"][rows]
        return cache

    def capacity(self, cache):
        return -1  # unbounded: it grows


class _ResizeModel(GrownModel):
    def grow(self, layer: dict, need: int):
        size = math.ceil(need / layer["step"]) * layer["step"]
        for name in ("key", "value"):
            b, h, _, d = layer[name].shape
            layer[name].resize_(b, h, size, d)  # in place: the old storage read in the new shape


class ResizeInPlace(GrownDecoder):
    """Faulty: grows its buffers with ``resize_`` (module docstring)."""

    name = "resize_in_place"
    caches = {"ResizedBufferCache": {}}
    model_class = _ResizeModel
