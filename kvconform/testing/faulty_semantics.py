"""Faulty caches for the cache-semantics families: crop, prefix, batch, lifecycle, contract, fuzz.

Each class carries one small, realistic bug (the line is marked ``# BUG:``) and is built like any subject,
``Cls(config=..., max_cache_len=...)``. ``FAULTY`` lists which check must catch each one, on which model, and the
message lines that check must print (pinned by ``tests/semantics/test_semantics.py`` and
``tests/caches/test_faulty_caches.py``).
Static-layer caches declare
``kvconform_capabilities`` without the ops whose transformers faults they would inherit (not theirs to report).
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import (Cache, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer, StaticCache,
                                      StaticLayer)

from kvconform.compat import crop_tokens_to_remove
from kvconform.testing import FaultyCache

# Faulty caches built on transformers' layers would inherit their known faults (known_faults.toml): static layers
# have no batch ops, crop below zero and return a live length tensor; linear-attention layers have no batch ops and
# crop only the conv state. The classes below neither declare those capabilities nor keep those quirks, so that each
# one shows only its own bug.
_STATIC_CAPABILITIES = ("forward", "generate", "crop", "deepcopy", "reorder", "reset")
_LINEAR_CAPABILITIES = ("forward", "generate", "deepcopy", "reorder", "reset")


class _CleanStaticLayer(StaticLayer):
    """StaticLayer minus two transformers quirks: get_seq_length returns an int; crop clamps at an empty cache."""

    def get_seq_length(self) -> int:
        return int(self.cumulative_length) if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count of tokens to remove")
        self.cumulative_length.sub_(min(abs(tokens_to_remove), int(self.cumulative_length)))


# ------------------------------------------------------------------------------------------------ crop
class CropFirstLayerOnlyCache(DynamicCache):
    """``crop`` rolls back only the first layer: the others keep the tokens that should be gone (a loop bound bug)."""

    def crop(self, tokens_to_remove: int) -> None:
        for layer in self.layers[:1]:  # BUG: should be every layer
            layer.crop(tokens_to_remove)


class _SlidingCropAnywayLayer(DynamicSlidingWindowLayer):
    def crop(self, tokens_to_remove: int) -> None:
        # record_past does not exist on transformers 5.5 (no past recording there)
        if self.get_seq_length() >= self.sliding_window and not getattr(self, "record_past", False):
            # BUG: "fixes" the RuntimeError by trimming what is left, though the evicted states cannot come back
            k = crop_tokens_to_remove(tokens_to_remove, self.get_seq_length)  # the installed release's contract
            self.keys, self.values = self.keys[..., :-k, :], self.values[..., :-k, :]
            self.cumulative_length -= k
            return
        super().crop(tokens_to_remove)


class SlidingCropAnywayCache(DynamicCache):
    """Sliding-window layers accept a crop after the window filled (past recording off) and keep is_croppable True,
    although the tokens the rollback needs were already evicted."""

    def __init__(self, config=None, **kwargs):
        super().__init__(config=config)
        self.layers = [_SlidingCropAnywayLayer(sliding_window=layer.sliding_window)
                       if isinstance(layer, DynamicSlidingWindowLayer) else layer for layer in self.layers]


# ------------------------------------------------------------------------------------------------ prefix
class ForkSharesStateCache(DynamicCache):
    """``copy.deepcopy`` copies the attention layers but shares the linear-attention (SSM) layers "to save memory";
    the models update conv and recurrent states in place, so a copy's decode rewrites the original's state."""

    kvconform_capabilities = _LINEAR_CAPABILITIES

    def __deepcopy__(self, memo):
        new = self.__class__.__new__(self.__class__)
        new.__dict__.update({k: copy.deepcopy(v, memo) for k, v in self.__dict__.items() if k != "layers"})
        # BUG: linear-attention layers are shared with the original instead of copied
        new.layers = [layer if hasattr(layer, "conv_states") else copy.deepcopy(layer, memo) for layer in self.layers]
        return new


# ------------------------------------------------------------------------------------------------ batch
class _RepeatTilesLayer(DynamicLayer):
    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.get_seq_length() > 0:
            # BUG: tiles the batch ([b0, b1, b0, b1]) instead of repeating each row ([b0, b0, b1, b1])
            self.keys = self.keys.repeat(repeats, 1, 1, 1)
            self.values = self.values.repeat(repeats, 1, 1, 1)


class RepeatTilesCache(DynamicCache):
    """``batch_repeat_interleave`` tiles the batch instead of repeating each row in place."""

    def __init__(self, config=None, **kwargs):
        Cache.__init__(self, layer_class_to_replicate=_RepeatTilesLayer)


# ------------------------------------------------------------------------------------------------ lifecycle
class _ReallocatingResetLayer(_CleanStaticLayer):
    def reset(self) -> None:
        if self.is_initialized:
            # BUG: fresh tensors instead of zero_() in place: compiled graphs / CUDA graphs keep the old addresses
            self.keys = torch.zeros_like(self.keys)
            self.values = torch.zeros_like(self.values)
            self.cumulative_length = torch.zeros_like(self.cumulative_length)


class ResetReallocatesCache(StaticCache):
    """A static cache whose ``reset()`` allocates new zero tensors instead of zeroing in place (is_compileable
    True): the logits stay right, but captured data pointers go stale."""

    kvconform_capabilities = _STATIC_CAPABILITIES

    def __init__(self, config, max_cache_len=64, **kwargs):
        super().__init__(config=config, max_cache_len=max_cache_len)
        self.layers = [_ReallocatingResetLayer(max_cache_len=max_cache_len) for _ in self.layers]


class _WrapAroundLayer(_CleanStaticLayer):
    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        # BUG: a "ring buffer" without any window semantics: past max_cache_len it overwrites the oldest tokens
        position = (torch.arange(n, device=self.device) + self.cumulative_length) % self.max_cache_len
        self.cumulative_length.add_(n)
        self.keys.index_copy_(2, position, key_states)
        self.values.index_copy_(2, position, value_states)
        return self.keys, self.values

    def get_seq_length(self):
        return int(min(int(self.cumulative_length), self.max_cache_len)) if self.is_initialized else 0


class WrapAroundStaticCache(StaticCache):
    """Full-attention static layers silently wrap around past ``max_cache_len`` (overwriting the oldest tokens)
    instead of raising."""

    kvconform_capabilities = _STATIC_CAPABILITIES

    def __init__(self, config, max_cache_len=64, **kwargs):
        super().__init__(config=config, max_cache_len=max_cache_len)
        self.layers = [_WrapAroundLayer(max_cache_len=max_cache_len) for _ in self.layers]


# ------------------------------------------------------------------------------------------------ contract
class SelectNotImplementedCache(DynamicCache):
    """``batch_select_indices`` is a stub that raises NotImplementedError, though the class claims every
    capability."""

    def batch_select_indices(self, indices: torch.Tensor):
        raise NotImplementedError("TODO: batch_select_indices")  # BUG: left as a stub


class _CountingLayer(DynamicLayer):
    """Keeps the length in a counter (to avoid reading tensor shapes); crop() forgets to update it."""

    def __init__(self, **kwargs):
        super().__init__()
        self.length = 0

    def update(self, key_states, value_states, *args, **kwargs):
        self.length += key_states.shape[-2]
        return super().update(key_states, value_states, *args, **kwargs)

    def get_seq_length(self) -> int:
        return self.length

    def reset(self) -> None:
        super().reset()
        self.length = 0

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)  # BUG: self.length is not reduced


class CropStaleLengthCache(DynamicCache):
    """``get_seq_length`` comes from a counter that ``crop`` does not update (keys and values are cropped right,
    so logits with explicit position_ids stay correct)."""

    def __init__(self, config=None, **kwargs):
        Cache.__init__(self, layer_class_to_replicate=_CountingLayer)


# ------------------------------------------------------------------------------------------------ fuzz
class _LazyRepeatLayer(DynamicLayer):
    """``batch_repeat_interleave`` is deferred to the next ``update`` (one copy instead of two)."""

    pending_repeat = 1

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.pending_repeat *= repeats  # applied lazily in update()

    def update(self, key_states, value_states, *args, **kwargs):
        if self.pending_repeat > 1 and self.get_seq_length() > 0:
            self.keys = self.keys.repeat_interleave(self.pending_repeat, dim=0)
            self.values = self.values.repeat_interleave(self.pending_repeat, dim=0)
        self.pending_repeat = 1
        return super().update(key_states, value_states, *args, **kwargs)

    # BUG: reorder_cache / batch_select_indices / reset act on the not-yet-repeated tensors and keep the pending
    # repeat: fine after a forward, wrong when they come right after batch_repeat_interleave


class LazyRepeatCache(DynamicCache):
    """``batch_repeat_interleave`` is applied lazily at the next update; any batch op or reset in between works on
    the unexpanded rows. Every single op is correct on its own; only sequences show it."""

    def __init__(self, config=None, **kwargs):
        Cache.__init__(self, layer_class_to_replicate=_LazyRepeatLayer)


FAULTY = [
    FaultyCache(
        name="crop_first_layer_only", attr="CropFirstLayerOnlyCache", module=__name__, family="crop",
        cause=r"update\(layer_idx=1\) returned keys of length 6 for a cache that should hold 4 tokens — "
              r"crop\(-2\) removed the wrong tokens or left stale state behind",
        check="check_crop_then_continue", model="llama", case="crop_short",
        message=("check_crop_then_continue failed: CropFirstLayerOnlyCache on llama", "[failed at decode 1]",
                 "→ the fault is in the subject", "crop(-2) removed the wrong tokens or left stale state behind"),
    ),
    FaultyCache(
        name="sliding_crop_anyway", attr="SlidingCropAnywayCache", module=__name__, family="crop",
        cause=r"crop\(-3\) left the cache in a state its next update cannot handle \(update\(layer_idx=\d+\) "
              r"returned keys of length \d+, but get_mask_sizes\(\) sized the attention mask for \d+",
        check="check_crop_contract", model="mistral", case="crop_past_window",
        message=("check_crop_contract failed: SlidingCropAnywayCache on mistral", "[raised at decode 1]",
                 "crop(-3) left the cache in a state its next update cannot handle"),
        # its layers are transformers' DynamicSlidingWindowLayer, which keeps a view of the whole prefill buffer
        also_caught_by=("memory",),
    ),
    FaultyCache(
        name="fork_shares_state", attr="ForkSharesStateCache", module=__name__, family="prefix",
        cause=r"__deepcopy__ shares tensors \(key/value buffers, conv/recurrent states",
        check="check_prefix_fork", model="mamba2", case="prefix_fork_steps",
        message=("check_prefix_fork failed: ForkSharesStateCache on mamba2",
                 "the original cache changed while its deep copies were extended", "conv_states",
                 "__deepcopy__ shares tensors"),
        also_caught_by=("fuzz",),
    ),
    FaultyCache(
        name="repeat_tiles", attr="RepeatTilesCache", module=__name__, family="batch",
        cause=r"repeat_interleave, not tile",
        check="check_repeat_then_decode", model="llama", case="repeat_padded",
        message=("check_repeat_then_decode failed: RepeatTilesCache on llama", "[failed at decode 1]",
                 "left-padded batch", "→ the fault is in the subject", "repeat_interleave, not tile"),
    ),
    FaultyCache(
        name="reset_reallocates", attr="ResetReallocatesCache", module=__name__, family="lifecycle",
        cause=r"reset\(\) \(or the next update\) reallocates tensors instead of zeroing them in place",
        check="check_reset_then_reuse", model="llama", case="reset_reuse",
        message=("check_reset_then_reuse failed: ResetReallocatesCache on llama",
                 "is_compileable is True, but reset() and reuse moved", "layers[0].keys",
                 "reallocates tensors instead of zeroing them in place"),
    ),
    FaultyCache(
        name="wrap_around_static", attr="WrapAroundStaticCache", module=__name__, family="lifecycle",
        cause=r"past max_cache_len 12 the cache accepted tokens but overwrote or dropped older ones silently",
        check="check_capacity", model="llama", case="capacity",
        message=("check_capacity failed: WrapAroundStaticCache on llama", "(max_cache_len=12)",
                 "[failed at decode 1]", "→ the fault is in the subject",
                 "past max_cache_len 12 the cache accepted tokens but overwrote or dropped older ones silently"),
    ),
    FaultyCache(
        name="select_not_implemented", attr="SelectNotImplementedCache", module=__name__, family="contract",
        cause=r"does not implement batch_select_indices\(indices\)",
        check="check_api_contract", model="llama", case="api_surface",
        message=("check_api_contract failed: SelectNotImplementedCache on llama", "1 of 13 contract items fail",
                 "batch_select_indices(indices) — NotImplementedError: TODO: batch_select_indices",
                 "needed by contrastive search"),
        also_caught_by=("batch",),
    ),
    FaultyCache(
        name="crop_stale_length", attr="CropStaleLengthCache", module=__name__, family="contract",
        cause=r"get_seq_length\(\) does not count what update\(\) stored",
        check="check_length_bookkeeping", model="llama", case="length_bookkeeping",
        message=("check_length_bookkeeping failed: CropStaleLengthCache on llama",
                 "crop(-2): get_seq_length() = 11, but the cache should hold 9 tokens (its unbounded attention "
                 "layers store 9)",
                 "get_seq_length() does not count what update() stored"),
        also_caught_by=("crop", "fuzz"),
    ),
    FaultyCache(
        name="lazy_repeat", attr="LazyRepeatCache", module=__name__, family="fuzz",
        cause=r"an interaction between these ops that no single-op case covers",
        check="check_op_sequences", model="llama", case="fuzz_quick",
        message=("check_op_sequences failed: LazyRepeatCache on llama", "a random op program fails (shrunk by",
                 "repeat(2) →", "as a case: ops = [", "→ the fault is in the subject"),
    ),
]
