"""Caches that a vision-language model exposes and a text model does not (the zoo VLMs: ``kvconform/vision.py``).

``ImageSegmentCache`` is a correct cache of another design, the kind a VLM author writes to reuse an image across
turns (nanoVLM-style): model-aware (its factory takes ``model`` and returns ``(cache, context)``), its context
watches each forward's ``input_ids`` and each layer keeps the keys/values of the image block apart from the text's,
putting them back in sequence order whenever attention reads them. On a text model it never sees an image token and
is a plain list-of-chunks cache. Its faulty variants each carry one bug (marked ``# BUG:``):

* ``ShiftedImageCache`` puts the image block back at the front ("the image opens the prompt"), but the prompt has a
  text token before it: at the prefill the image's keys sit at the wrong positions under the causal mask;
* ``ForkDropsImageCache`` copies (``deepcopy``, the prefix copy for a next turn) the text segment but not the image
  segment: the copy continues without the image;
* ``TypeBlindStaticCache`` is transformers' ``StaticCache`` driven through a fixed-signature call path (what
  static-shape engines do for ``torch.compile``: only ``input_ids``, positions, mask and cache reach the model), which
  drops ``token_type_ids``: gemma3's image block loses its bidirectional attention at the prefill. transformers'
  own ``StaticCache`` keeps it on 5.24 (gemma3_vlm: prefill, chunk and decode within 2.3e-6 of the uncached forward,
  where dropping the block moves the logits by 2.6; ``tests/subjects/test_vlm.py``).

A text model runs all three unchanged (no image token, no ``token_type_ids``). ``FAULTY`` pins the check, case and
likely-cause line of each (``tests/engine/test_cause_lines.py``).
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import Cache, StaticCache

from kvconform.compat import layer_types_and_kwargs
from kvconform.reference import ReferenceAttentionLayer
from kvconform.testing import FaultyCache


class _Inbox:
    """What the context saw of the forward running now: ``image`` ``[B, T]`` bool (image-token positions of its
    ``input_ids``), None outside a forward or for one without input ids."""

    def __init__(self, image_token_id: int | None):
        self.image_token_id = image_token_id
        self.image = None


class _WatchInputs:
    """Per-call context: a forward pre-hook on the model records where the image tokens of each forward's
    ``input_ids`` are (into the shared ``_Inbox``); removed on exit."""

    def __init__(self, model, inbox: _Inbox):
        self.model, self.inbox, self.handle = model, inbox, None

    def _see(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.inbox.image = None if ids is None or self.inbox.image_token_id is None \
            else (ids == self.inbox.image_token_id).cpu()

    def __enter__(self):
        self.handle = self.model.register_forward_pre_hook(self._see, with_kwargs=True)
        return self

    def __exit__(self, *exc):
        self.handle.remove()
        self.inbox.image = None
        return False


class ImageSegmentLayer(ReferenceAttentionLayer):
    """A full-attention layer keeping the image block's keys/values (``image_keys``, ``[B, H, K, D]``) apart from
    the text's chunks; ``image_at`` ``[B]`` int64 is where the block starts in each row's sequence. ``keys`` /
    ``values`` are the whole sequence in order (text before the block, the block, text after)."""

    def __init__(self, inbox, **kwargs):
        super().__init__(**kwargs)
        self._inbox = lambda: inbox  # a function: deepcopy and memory walks leave the shared inbox alone
        self.image_keys = self.image_values = self.image_at = None

    def _assemble(self, text, image):
        if image is None:
            return text
        rows = [torch.cat([text[b, :, :s], image[b], text[b, :, s:]], dim=-2)
                for b, s in enumerate(self.image_at.tolist())]
        return torch.stack(rows)

    @property
    def keys(self):
        text = torch.cat(self.key_chunks, dim=-2) if self.key_chunks else None
        return text if text is None else self._assemble(text, self.image_keys)

    @property
    def values(self):
        text = torch.cat(self.value_chunks, dim=-2) if self.value_chunks else None
        return text if text is None else self._assemble(text, self.image_values)

    def update(self, key_states, value_states, *args, **kwargs):
        """The first forward's image block goes to the image segment, everything else to the text chunks; returns
        the whole sequence in order."""
        image = self._inbox().image
        if self.key_chunks or self.image_keys is not None or image is None or not bool(image.any()) \
                or image.shape[-1] != key_states.shape[-2]:
            return super().update(key_states, value_states, *args, **kwargs)
        self.is_initialized = True
        starts = image.long().argmax(-1)
        n = int(image[0].sum())
        pick = [torch.arange(s, s + n) for s in starts.tolist()]
        rest = [torch.cat([torch.arange(0, s), torch.arange(s + n, key_states.shape[-2])]) for s in starts.tolist()]
        self.image_keys = torch.stack([key_states[b, :, p] for b, p in enumerate(pick)]).clone()
        self.image_values = torch.stack([value_states[b, :, p] for b, p in enumerate(pick)]).clone()
        self.key_chunks = [torch.stack([key_states[b, :, r] for b, r in enumerate(rest)])]
        self.value_chunks = [torch.stack([value_states[b, :, r] for b, r in enumerate(rest)])]
        self.image_at = starts.to(key_states.device)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return super().get_seq_length() + (0 if self.image_keys is None else int(self.image_keys.shape[-2]))

    def _fold(self) -> None:
        """Put the image back into the text chunks (one chunk in sequence order): before a crop."""
        if self.image_keys is not None:
            keys, values = self.keys, self.values
            self.key_chunks, self.value_chunks = [keys], [values]
            self.image_keys = self.image_values = self.image_at = None

    def crop(self, tokens_to_remove: int) -> None:
        self._fold()
        super().crop(tokens_to_remove)

    def reset(self) -> None:
        super().reset()
        self.image_keys = self.image_values = self.image_at = None

    def _map_batch(self, fn) -> None:
        super()._map_batch(fn)
        if self.image_keys is not None:
            self.image_keys, self.image_values, self.image_at = (fn(self.image_keys), fn(self.image_values),
                                                                 fn(self.image_at))


class _ShiftedImageLayer(ImageSegmentLayer):
    def _assemble(self, text, image):
        if image is None:
            return text
        # BUG: the image block is put back at the front ("the image opens the prompt"), not where it was
        return torch.cat([image, text], dim=-2)


class _ForkDropsImageLayer(ImageSegmentLayer):
    def __deepcopy__(self, memo):
        new = copy.copy(self)
        new.key_chunks = [t.clone() for t in self.key_chunks]
        new.value_chunks = [t.clone() for t in self.value_chunks]
        # BUG: the copy for the next turn takes the text segment only; the image segment stays behind
        new.image_keys = new.image_values = new.image_at = None
        return new


class ImageSegmentCache(Cache):
    """A cache of ``ImageSegmentLayer`` (or ``layer``) per decoder layer; full-attention models only. Build it with
    ``image_segment_cache(config, model)``, which also returns the per-call context that shows it each forward's
    image tokens.

    Raises:
        ValueError: the model has a layer that is not full attention.
    """

    def __init__(self, config, inbox, layer=ImageSegmentLayer, **ignored_kwargs):
        types, _ = layer_types_and_kwargs(config)
        if set(types) != {"full_attention"}:
            raise ValueError(f"ImageSegmentCache keeps full-attention layers only, the model has {sorted(set(types))}")
        super().__init__(layers=[layer(inbox) for _ in types])

    @property
    def is_compileable(self) -> bool:
        return False


def _image_token_id(model):
    return getattr(model.config, "image_token_id", None)


def image_segment_cache(config, model):
    """A correct ``ImageSegmentCache`` for ``model`` and its per-call context (``(cache, context)``)."""
    inbox = _Inbox(_image_token_id(model))
    return ImageSegmentCache(config, inbox), _WatchInputs(model, inbox)


def shifted_image_cache(config, model):
    """``ImageSegmentCache`` that puts the image block back at the front of the sequence (faulty)."""
    inbox = _Inbox(_image_token_id(model))
    return ImageSegmentCache(config, inbox, layer=_ShiftedImageLayer), _WatchInputs(model, inbox)


def fork_drops_image_cache(config, model):
    """``ImageSegmentCache`` whose ``deepcopy`` leaves the image segment behind (faulty)."""
    inbox = _Inbox(_image_token_id(model))
    return ImageSegmentCache(config, inbox, layer=_ForkDropsImageLayer), _WatchInputs(model, inbox)


class _FixedSignature:
    """Per-call context of a static-shape call path: a forward pre-hook keeps only the inputs a compiled static
    forward takes; removed on exit."""

    KEPT = ("input_ids", "attention_mask", "position_ids", "pixel_values", "cache", "past_key_values", "use_cache",
            "inputs_embeds", "return_dict", "mm_encoder_outputs")

    def __init__(self, model):
        self.model, self.handle = model, None

    @staticmethod
    def _narrow(module, args, kwargs):
        # BUG: token_type_ids are not in the fixed signature, so gemma3 builds a plain causal mask at the prefill
        return args, {k: v for k, v in kwargs.items() if k in _FixedSignature.KEPT}

    def __enter__(self):
        self.handle = self.model.register_forward_pre_hook(self._narrow, with_kwargs=True)
        return self

    def __exit__(self, *exc):
        self.handle.remove()
        return False


class FixedShapeStaticCache(StaticCache):
    """transformers' ``StaticCache`` for a static-shape call path: what would change its shapes (a crop, a batch
    resize) is refused with a clear error."""

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("FixedShapeStaticCache serves static shapes: crop() is not supported")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("FixedShapeStaticCache serves static shapes: the batch size cannot change")

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError("FixedShapeStaticCache serves static shapes: the batch size cannot change")


def type_blind_static_cache(config, model, max_cache_len=64):
    """``FixedShapeStaticCache`` behind a fixed-signature call path that drops ``token_type_ids`` (faulty on
    gemma3's image block)."""
    return FixedShapeStaticCache(config=config, max_cache_len=max_cache_len), _FixedSignature(model)


# an eager cache of lists (no compile); the same declaration on its faulty variants
for _factory in (image_segment_cache, shifted_image_cache, fork_drops_image_cache):
    _factory.kvconform_capabilities = {"forward", "generate", "crop", "deepcopy", "reorder",  # type: ignore[attr-defined]
                                       "batch_repeat", "batch_select", "reset"}
# what the call path of type_blind_static_cache serves: static shapes, so no crop or batch resizing (transformers'
# StaticCache's own faults there are known faults of StaticCache, not this cache's)
type_blind_static_cache.kvconform_capabilities = {"forward", "generate", "deepcopy", "reorder", "reset"}  # type: ignore[attr-defined]

_M = "kvconform.testing.faulty_vision"
FAULTY = [
    FaultyCache("image_shifted_at_prefill", "shifted_image_cache", _M, "logits", "check_prefill_then_decode",
                "llava", ("max|Δlogit|", "prefill(12)"),
                also_caught_by=("prefix", "generate", "lifecycle", "fuzz", "crop"),  # crop: crop_assisted_depth's
                # prefill(12) holds the image block too
                case="decode_explicit_positions",
                cause=r"prefill of the image prompt is wrong at position 0, before the image block at positions "
                      r"1\.\.4: the image tokens' keys/values are not returned where the prompt put them"),
    FaultyCache("image_left_behind_by_fork", "fork_drops_image_cache", _M, "prefix", "check_prefix_fork",
                "llava", ("max|Δlogit|", "copy 1: decode 1"), case="prefix_fork_steps",
                cause=r"the deep copy counts its tokens wrong: right after copy\.deepcopy its get_seq_length\(\) = 4, "
                      r"the original's = 8"),
    FaultyCache("image_block_causal_in_static", "type_blind_static_cache", _M, "logits", "check_prefill_then_decode",
                "gemma3_vlm", ("max|Δlogit|", "prefill(12)"), also_caught_by=("prefix", "lifecycle", "fuzz"),
                case="decode_explicit_positions",
                cause=r"the image block \(positions 1\.\.4\) was attended causally at the prefill"),
]
