"""A cache that stages a chunk's tail and rolls back only its main buffer: exact for prefill, decode, chunked
continuation and every crop that follows a single-token step, wrong only when a crop follows a multi-token forward
into a warm cache — which is what every step of speculative decoding does (one verification forward of the current
token and its candidates, then a crop of the rejected ones). Caught by ``check_speculative_greedy`` (family
``speculative``); the crop family's cases crop after decode steps, and pass. ``ReferenceCache`` and transformers'
``DynamicCache`` pass the same case.

``FirstLayerCropMtpCache``: an ``MtpCache`` (the MTP layers' cache of ``generate(use_mtp=True)``) whose ``crop``
rolls back only its first layer. Caught by ``check_speculative_mtp``; it is no model's own cache, so no other family
runs it, and transformers' ``MtpCache`` and kvconform's reference MtpCache pass the same case.

``DecodeTailCache``: the mirror image of ``StagedChunkCache``. Single-token decode writes go to a small tail buffer
(appended there, not to the whole sequence), flushed into the main buffer by the next multi-token update; ``crop``
trims the main buffer only. As the target's cache of assisted decoding or prompt lookup it is exact: the target's
crops follow a verification chunk, which flushed the tail. As the draft's cache it fails: the draft writes its
candidates one token at a time, so its crop after a rejection finds them in the tail, keeps them and cuts accepted
tokens instead. Caught by ``assisted_draft_cache`` and not by the target-role speculative cases (the crop and batch
families, whose cases crop after decode steps, catch it too)."""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvconform.compat import layer_types_and_kwargs, tokens_removed_by_crop
from kvconform.testing import FaultyCache


class _SideBufferLayer(DynamicLayer):
    """A dynamic layer with a side buffer (``side_keys`` / ``side_values``) held after its main buffer: counted in its
    length and mask, merged into the main buffer by ``_merge``, emptied by ``reset``; its ``crop`` carries the bug the
    two caches below share. Subclasses decide what goes to the side buffer (``update``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.side_keys: Any = None
        self.side_values: Any = None
        self.keys: Any
        self.values: Any

    def _merge(self):
        if self.side_keys is not None:
            self.keys = torch.cat([self.keys, self.side_keys], dim=-2)
            self.values = torch.cat([self.values, self.side_values], dim=-2)
            self.side_keys = self.side_values = None

    def get_seq_length(self, *args, **kwargs) -> int:
        side = 0 if self.side_keys is None else self.side_keys.shape[-2]
        return (self.keys.shape[-2] if self.is_initialized else 0) + side

    def get_mask_sizes(self, query_length, *args, **kwargs):
        return self.get_seq_length() + query_length, 0

    def crop(self, argument: int) -> None:
        removed = tokens_removed_by_crop(argument, self.get_seq_length())
        if not removed or not self.is_initialized:
            return
        # BUG: the rollback trims the main buffer only; the side buffer (a chunk's staged tail, or a decode tail:
        # where rejected candidates are) survives, and accepted tokens are cut from the main buffer instead
        self.keys, self.values = self.keys[..., :-removed, :], self.values[..., :-removed, :]

    def reset(self) -> None:
        super().reset()
        self.side_keys = self.side_values = None


class _StagedChunkLayer(_SideBufferLayer):
    """Writes the first token of a warm multi-token forward to its main buffer and keeps the rest in the side buffer,
    merged into the main buffer at the next update (a write-behind for chunked continuation)."""

    def update(self, key_states, value_states, *args, **kwargs):
        self._merge()
        if not self.is_initialized or key_states.shape[-2] == 1:
            return super().update(key_states, value_states, *args, **kwargs)
        keys, values = super().update(key_states[..., :1, :], value_states[..., :1, :], *args, **kwargs)
        self.side_keys, self.side_values = key_states[..., 1:, :].clone(), value_states[..., 1:, :].clone()
        return torch.cat([keys, self.side_keys], dim=-2), torch.cat([values, self.side_values], dim=-2)


class StagedChunkCache(Cache):
    """Every layer a ``_StagedChunkLayer`` (attention models)."""

    def __init__(self, config=None, **kwargs):
        types, _ = layer_types_and_kwargs(config)
        super().__init__(layers=[_StagedChunkLayer() for _ in types])


class _DecodeTailLayer(_SideBufferLayer):
    """Appends single-token writes to the side buffer (a write-combining decode tail), merged into the main buffer
    at the next multi-token update."""

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized or key_states.shape[-2] != 1:
            self._merge()
            return super().update(key_states, value_states, *args, **kwargs)
        if self.side_keys is None:
            self.side_keys, self.side_values = key_states, value_states
        else:
            self.side_keys = torch.cat([self.side_keys, key_states], dim=-2)
            self.side_values = torch.cat([self.side_values, value_states], dim=-2)
        return torch.cat([self.keys, self.side_keys], dim=-2), torch.cat([self.values, self.side_values], dim=-2)


class DecodeTailCache(Cache):
    """Every layer a ``_DecodeTailLayer`` (attention models)."""

    def __init__(self, config=None, **kwargs):
        types, _ = layer_types_and_kwargs(config)
        super().__init__(layers=[_DecodeTailLayer() for _ in types])


FAULTY = [
    FaultyCache(
        name="staged_chunk_rollback", attr="StagedChunkCache", module=__name__, family="speculative",
        check="check_speculative_greedy", model="llama", case="assisted_draft",
        message=("check_speculative_greedy failed: StagedChunkCache on llama",),
        cause=r"crop\(\) after a verification chunk keeps a rejected candidate or drops an accepted token",
    ),
    FaultyCache(
        name="mtp_first_layer_crop", attr="FirstLayerCropMtpCache", module=__name__, family="speculative",
        check="check_speculative_mtp", model="glm4_mtp", case="mtp",
        message=("check_speculative_mtp failed: FirstLayerCropMtpCache on glm4_mtp",
                 "the MTP layers drafted other tokens with the subject as their cache"),
        cause=r"crop\(-num_mtp_layers\) after a step that accepted no candidate",
    ),
    FaultyCache(
        name="decode_tail_rollback", attr="DecodeTailCache", module=__name__, family="speculative",
        check="check_speculative_greedy", model="llama", case="assisted_draft_cache",
        message=("check_speculative_greedy failed: DecodeTailCache on llama",
                 "the draft proposed other tokens with the subject as its cache"),
        also_caught_by=("crop", "batch"),
        cause=r"the draft's crop\(\) after a step whose candidates the target rejected keeps a rejected candidate",
    ),
]



def _mtp_cache_class():
    from transformers.cache_utils import MtpCache

    class FirstLayerCropMtpCache(MtpCache):
        """An MtpCache written for a model with one MTP layer: ``crop`` rolls back the first MTP layer only. Exact
        wherever a single layer is cropped; with two MTP layers, the second keeps the drafts of a step that
        accepted no candidate, and its next drafts attend to them."""

        def crop(self, max_length: int):
            # BUG: one MTP layer assumed; the deeper layers keep their rejected drafts
            self.layers[0].crop(max_length)  # type: ignore[union-attr]

    return FirstLayerCropMtpCache


def FirstLayerCropMtpCache(config=None, **kwargs):  # noqa: N802 - a cache class's name (5.25's MtpCache)
    """A fresh ``FirstLayerCropMtpCache`` (``_mtp_cache_class``); transformers is imported when it is built."""
    return _mtp_cache_class()(config=config)
