"""A lossy cache with no memory promise, and its faulty variants: every new key/value token is rounded through an
int8 codec (per token and head: absmax scale, 255 levels) and the *decoded* floats are stored, as a cache does that
studies a codec's effect on quality under transformers (its memory is an exact cache's, by design).

* ``CodecRoundTripCache``: ``DynamicCache``'s layers, each ``update()`` rounding the new tokens through the codec
  before storing them. It declares ``kvconform_lossy = {..., "saves_memory": False}``: judged by quality against the
  float64 oracle and by self-consistency; ``check_compression_real`` skips, saying it promises no memory saving.

Faulty variants (pinned by ``tests/lossy/test_codec.py``):

* ``CodecClaimsSaving``: the same cache declaring a memory saving it does not make (no ``saves_memory``): fails
  ``check_compression_real`` with the true cause — the codec runs on every token (its stored keys differ from the
  exact ones), but the decoded floats are kept, not the codes.
* ``CodecNeverReached``: promises a saving, but its codec starts after 4,096 tokens (an "exact window" longer than
  any case): fails with "the compressor is never reached".
* ``CodecLengthLags``: ``get_seq_length()`` leaves out the newest token ("the one still in the residual"): every
  forward of kvconform's gets the same answer from a fresh instance (self-consistency cannot see it), but
  ``generate()`` continuing the cache for a second turn feeds a token twice: caught by
  ``check_generate_self_consistent``.
* ``CodecStaleReorder``: ``reorder_cache`` skips the last layer: caught by ``check_beam_search_self_consistent``
  (and by the batch family's reorder items).
* ``CodecCoarse``: no memory promise, like ``CodecRoundTripCache``, but its codec keeps 3 levels (-1, 0, +1 times
  the scale) under the same budget: its quality is still judged, and fails.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

LEVELS = 127


def round_trip(x: torch.Tensor, levels: int = LEVELS) -> torch.Tensor:
    """``x`` ``[B, H, T, D]`` encoded to ``2·levels + 1`` levels per token and head (scale = absmax / levels; int8
    by default) and decoded again; same shape and dtype."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / levels
    return (torch.round(x / scale).clamp(-levels, levels) * scale).to(x.dtype)


class CodecLayer(DynamicLayer):
    """``DynamicLayer`` whose ``update()`` stores the new keys/values rounded through ``round_trip`` (tokens past
    ``exact_tokens`` only: 0 by default, every token)."""

    exact_tokens = 0
    levels = LEVELS

    def update(self, key_states, value_states, *args, **kwargs):
        seen = self.get_seq_length() if self.is_initialized else 0
        if seen + key_states.shape[-2] > self.exact_tokens:
            key_states, value_states = round_trip(key_states, self.levels), round_trip(value_states, self.levels)
        return super().update(key_states, value_states, *args, **kwargs)


class CodecRoundTripCache(DynamicCache):
    """``DynamicCache`` rounding every new key/value through an int8 codec and storing the decoded floats (module
    docstring). ``CodecRoundTripCache(config)``; other keyword arguments are accepted and ignored. Full-attention
    models (the codec is per attention layer; sliding and linear layers are not rounded)."""

    layer_class = CodecLayer
    kvconform_lossy = {"kl_max": 1e-3, "top1_min": 0.9, "saves_memory": False}
    kvconform_supports = {"full_attention"}

    def __init__(self, config=None, **ignored):
        super().__init__(config=config)
        self.layers = [type(self).layer_class() if type(layer) is DynamicLayer else layer for layer in self.layers]


class CodecClaimsSaving(CodecRoundTripCache):
    """FAULTY: declares a memory saving (no ``saves_memory``) while it stores the decoded floats."""

    kvconform_lossy = {"kl_max": 1e-3, "top1_min": 0.9}


class _LateLayer(CodecLayer):
    exact_tokens = 4096  # BUG: "exact window" longer than any context: the codec is never reached


class CodecNeverReached(CodecRoundTripCache):
    """FAULTY: promises a memory saving; its codec starts after 4,096 tokens, so it never runs."""

    layer_class = _LateLayer
    kvconform_lossy = {"kl_max": 1e-3, "top1_min": 0.9}


class _CoarseLayer(CodecLayer):
    levels = 1  # BUG: 3 levels where the budget was set for int8


class CodecCoarse(CodecRoundTripCache):
    """FAULTY: a 3-level codec under the int8 codec's budget (no memory promise either)."""

    layer_class = _CoarseLayer


class CodecLengthLags(CodecRoundTripCache):
    """FAULTY: ``get_seq_length()`` is one less than the tokens fed (it counts only the tokens "out of the
    residual")."""

    def get_seq_length(self, layer_idx: int = 0) -> int:
        held = super().get_seq_length(layer_idx)
        return max(held - 1, 0)  # BUG: the newest token is not counted


class CodecStaleReorder(CodecRoundTripCache):
    """FAULTY: ``reorder_cache`` reorders every layer but the last."""

    def reorder_cache(self, beam_idx):
        for layer in self.layers[:-1]:  # BUG: the last layer keeps its old rows
            layer.reorder_cache(beam_idx)
