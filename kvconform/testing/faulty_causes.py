"""Faulty caches whose failures only a *measured* diagnosis explains: the likely cause must come from where the
exception was raised and what was measured there (the cache's layer count against the decoder's depth, the length
``update()`` returned against the tokens the cache should hold, NaN compared as NaN, a fixed-size cache attended
without its mask), not from the family that happened to run it.

Each class carries one small, realistic bug (the line is marked ``# BUG:``). ``FAULTY`` lists the check that must
catch each one, on which model, the message lines it must print and its likely-cause line (``cause``), pinned by
``tests/caches/test_faulty_caches.py``.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer, StaticCache

from kvconform.compat import crop_tokens_to_remove, layer_types_and_kwargs
from kvconform.families import FAMILIES
from kvconform.testing import FaultyCache

_ALL_FAMILIES = FAMILIES


# ------------------------------------------------------------------------------------------ layer count
class EncoderDepthCache(Cache):
    """Sizes its layer list the way a decoder-only cache reads a config, preferring ``encoder_layers`` /
    ``num_layers`` where the config has them: on an encoder-decoder those count the *encoder's* layers. Right on
    decoder-only models and on t5 (encoder 3 ≥ decoder 2: a spare layer), an IndexError at the first prefill on
    bart (encoder 2 < decoder 3)."""

    def __init__(self, config=None, **kwargs):
        # BUG: the encoder's depth on an encoder-decoder; the decoder's is decoder_layers / num_decoder_layers
        depth = getattr(config, "encoder_layers", None) or getattr(config, "num_layers", None) \
            or config.get_text_config(decoder=True).num_hidden_layers
        super().__init__(layers=[DynamicLayer() for _ in range(int(depth))])


# ------------------------------------------------------------------------------------------ update() length
class _OneShortLayer(DynamicLayer):
    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        # BUG: an off-by-one in the slice of the valid part ("the last slot is the write cursor"): one key too few
        held = keys.shape[-2]
        return keys[..., : held - 1, :], values[..., : held - 1, :]


class UpdateOneShortCache(Cache):
    """Stores every key/value, but ``update()`` returns one token fewer than the cache holds: attention gets keys
    that its mask (sized from ``get_mask_sizes``) cannot line up with."""

    kvconform_capabilities = ("forward", "reorder")  # what its pinned items need; every family would fail it

    def __init__(self, config=None, **kwargs):
        types, _ = layer_types_and_kwargs(config)
        super().__init__(layers=[_OneShortLayer() for _ in types])


# ------------------------------------------------------------------------------------------ crop keeps a token
class _CropKeepsOneLayer(DynamicLayer):
    def crop(self, tokens_to_remove: int) -> None:
        k = crop_tokens_to_remove(tokens_to_remove, self.get_seq_length)  # the installed release's contract
        # BUG: an off-by-one in the cut ("keep up to and including the new last position"): one token too few goes
        keep = self.get_seq_length() - k + 1
        if self.is_initialized and k > 0 and keep < self.get_seq_length():
            self.keys, self.values = self.keys[..., :keep, :], self.values[..., :keep, :]


class CropKeepsOneCache(Cache):
    """``crop(-k)`` removes ``k − 1`` tokens from the keys/values; ``get_seq_length()`` reads the key tensors, so
    it reports what is stored — 10 tokens where the cache should hold 9. The stored state is wrong, not a counter."""

    def __init__(self, config=None, **kwargs):
        Cache.__init__(self, layer_class_to_replicate=_CropKeepsOneLayer)


# ------------------------------------------------------------------------------------------ NaN in the prefix
class _NaNSlotLayer(DynamicLayer):
    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        if keys.shape[-2] > 3:
            # BUG: an uninitialised "scale" slot read back: position 3 of head 0 holds NaN from the prefill on
            self.keys[:, 0, 3, :] = float("nan")
        return self.keys, self.values


class NaNPrefixCache(Cache):
    """Writes NaN into one stored key (head 0, position 3) from the prefill on. The NaN is there before a fork and
    still there after it: a copy-independence check that compares NaN with ``==`` would blame ``__deepcopy__``."""

    kvconform_capabilities = ("forward", "deepcopy")  # what its pinned item needs; every family would fail it

    def __init__(self, config=None, **kwargs):
        types, _ = layer_types_and_kwargs(config)
        super().__init__(layers=[_NaNSlotLayer() for _ in types])


# ------------------------------------------------------------------------------------------ unmasked static
class NotCompileableStaticCache(StaticCache):
    """A StaticCache that says ``is_compileable = False`` ("keep torch.compile away from it"): the model then drops
    the attention mask of unpadded single-token steps and attends the empty slots of the fixed-size buffers."""

    kvconform_capabilities = ("forward",)  # what its pinned item needs

    # BUG: a fixed-size cache without is_compileable loses its mask on decode steps (SDPA's is_causal skip)
    is_compileable = False

    def __init__(self, config, max_cache_len=64, **kwargs):
        super().__init__(config=config, max_cache_len=max_cache_len)


# ------------------------------------------------------------------------------------------ one shared layer
class SharedLayerCache(Cache):
    """Lists one ``DynamicLayer`` object for every decoder layer (``[DynamicLayer()] * n``): layer 1 appends its
    keys to layer 0's, so the second layer's ``update()`` returns twice the tokens held."""

    kvconform_capabilities = ("forward",)  # what its pinned item needs; every family would fail it

    def __init__(self, config=None, **kwargs):
        types, _ = layer_types_and_kwargs(config)
        # BUG: list multiplication repeats one object: every decoder layer gets the same layer
        super().__init__(layers=[DynamicLayer()] * len(types))


# ------------------------------------------------------------------------------------------ values as keys
class _ValuesAsKeysLayer(DynamicLayer):
    def update(self, key_states, value_states, *args, **kwargs):
        # BUG: a copy-paste slip: the values are stored in place of the keys
        return super().update(value_states, value_states, *args, **kwargs)


class ValuesAsKeysCache(Cache):
    """Stores the values as keys. Wrong from the first cached step, with or without beams: a beam-search failure
    must not blame ``reorder_cache()`` (which it inherits from ``DynamicLayer`` and which is right)."""

    kvconform_capabilities = ("forward", "generate", "reorder")  # what its pinned item needs

    def __init__(self, config=None, **kwargs):
        types, _ = layer_types_and_kwargs(config)
        super().__init__(layers=[_ValuesAsKeysLayer() for _ in types])


# ------------------------------------------------------------------------------------------ narrow stored dtype
class _HalfStoreLayer(DynamicLayer):
    def update(self, key_states, value_states, *args, **kwargs):
        # BUG: "halve the memory": keys/values stored as bfloat16 whatever the model computes in, read back widened
        keys, values = super().update(key_states.to(torch.bfloat16), value_states.to(torch.bfloat16), *args, **kwargs)
        return keys.to(key_states.dtype), values.to(value_states.dtype)


class HalfStoreCache(Cache):
    """Stores keys/values as bfloat16 to halve its memory and widens them again on the way out: a float32 model then
    attends keys rounded to ~3 significant digits from the prefill on. Nothing is lost or shifted, so the cause is
    the stored dtype, not a length or an eviction."""

    kvconform_capabilities = ("forward",)  # what its pinned item needs; every family would fail it

    def __init__(self, config=None, **kwargs):
        types, _ = layer_types_and_kwargs(config)
        super().__init__(layers=[_HalfStoreLayer() for _ in types])


# ------------------------------------------------------------------------------------------ layer.keys
class _KeysElsewhereLayer(DynamicLayer):
    """Keeps its keys and values under its own names and returns them from ``update()``; ``layer.keys`` /
    ``layer.values`` stay None."""

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.k_store, self.v_store = key_states, value_states
        else:
            self.k_store = torch.cat([self.k_store, key_states], dim=-2)
            self.v_store = torch.cat([self.v_store, value_states], dim=-2)
        # BUG: self.keys / self.values are never set: transformers reads them directly where it does not call
        # update() (t5's and bart's cross-attention reuse layers[i].keys once the encoder's states are cached)
        self.keys = self.values = None
        return self.k_store, self.v_store

    def get_seq_length(self) -> int:
        return self.k_store.shape[-2] if self.is_initialized else 0

    def reset(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False


class KeysElsewhereCache(Cache):
    """Right wherever the model only calls ``update()`` (every decoder-only zoo model); an AttributeError on
    'NoneType' in t5's and bart's cross-attention, which read ``layer.keys``."""

    def __init__(self, config=None, **kwargs):
        types, _ = layer_types_and_kwargs(config.get_text_config(decoder=True))
        super().__init__(layers=[_KeysElsewhereLayer() for _ in types])


FAULTY = [
    FaultyCache(
        name="shared_layer", attr="SharedLayerCache", module=__name__, family="logits",
        check="check_prefill_then_decode", model="llama", case="decode_explicit_positions",
        message=("check_prefill_then_decode failed: SharedLayerCache on llama",),
        cause=r"the cache's 2 layers are fewer distinct objects \(1\): one layer object is listed for several "
              r"decoder layers",
        also_caught_by=_ALL_FAMILIES,
    ),
    FaultyCache(
        name="values_as_keys_beam", attr="ValuesAsKeysCache", module=__name__, family="batch",
        check="check_beam_search", model="llama", case="beam_search",
        message=("check_beam_search failed: ValuesAsKeysCache on llama",),
        cause=r"the cache is wrong without any reorder: greedy generate\(\) on the same prompts .* so the fault is "
              r"not in reorder_cache\(\)",
        also_caught_by=_ALL_FAMILIES,
    ),
    FaultyCache(
        name="keys_elsewhere", attr="KeysElsewhereCache", module=__name__, family="logits",
        check="check_prefill_then_decode", model="t5", case="decode_implicit_positions",
        message=("check_prefill_then_decode failed: KeysElsewhereCache on t5", "AttributeError"),
        cause=r"holds tokens \(get_seq_length\(\) > 0\) but answers None for layer.keys: transformers reads "
              r"layer.keys and layer.values directly",
        also_caught_by=_ALL_FAMILIES,  # every item on t5 that decodes past its first forward raises
    ),
    FaultyCache(
        name="encoder_depth", attr="EncoderDepthCache", module=__name__, family="logits",
        check="check_prefill_then_decode", model="bart", case="decode_implicit_positions",
        message=("check_prefill_then_decode failed: EncoderDepthCache on bart", "IndexError",
                 "[raised at prefill(12)]"),
        cause=r"the cache has 2 layers, but the model's decoder has 3 \(update\(layer_idx=2\) found no layer 2\): "
              r"the cache's layer count differs from the decoder depth",
        also_caught_by=_ALL_FAMILIES,  # every item on bart raises at its first forward
    ),
    FaultyCache(
        name="update_one_short", attr="UpdateOneShortCache", module=__name__, family="logits",
        check="check_prefill_then_decode", model="llama", case="decode_explicit_positions",
        message=("check_prefill_then_decode failed: UpdateOneShortCache on llama",),
        cause=r"update\(layer_idx=0\) returned keys of length 11 for a cache that should hold 12 tokens",
        also_caught_by=_ALL_FAMILIES,
    ),
    FaultyCache(
        name="crop_keeps_one", attr="CropKeepsOneCache", module=__name__, family="contract",
        check="check_length_bookkeeping", model="llama", case="length_bookkeeping",
        message=("check_length_bookkeeping failed: CropKeepsOneCache on llama",
                 "crop(-2): get_seq_length() = 10, but the cache should hold 9 tokens (its unbounded attention "
                 "layers store 10)"),
        cause=r"after crop\(-2\) the cache stores 10 tokens where it should hold 9 \(1 too many\): crop\(-2\) kept "
              r"tokens in its keys/values",
        also_caught_by=("crop", "fuzz", "prefix", "generate", "logits", "batch", "lifecycle", "memory"),
    ),
    FaultyCache(
        name="nan_prefix", attr="NaNPrefixCache", module=__name__, family="prefix",
        check="check_prefix_fork", model="llama", case="prefix_fork_chunk",
        message=("check_prefix_fork failed: NaNPrefixCache on llama", "[failed at prefill(8)]",
                 "update(layer_idx=0) returned NaN/inf keys[batch 0, head 0, position 3]"),
        cause=r"update\(\) returns or stores non-finite keys/values",
        also_caught_by=_ALL_FAMILIES,
    ),
    FaultyCache(
        name="not_compileable_static", attr="NotCompileableStaticCache", module=__name__, family="logits",
        check="check_prefill_then_decode", model="llama", case="decode_explicit_positions",
        message=("check_prefill_then_decode failed: NotCompileableStaticCache on llama", "[failed at decode 1]",
                 "→ the fault is in the subject"),
        cause=r"slots for 13 tokens but says is_compileable = False, so the model drops the attention mask of "
              r"single-token steps and the \d+ empty slots are attended",
        also_caught_by=_ALL_FAMILIES,
    ),
    FaultyCache(
        name="half_store", attr="HalfStoreCache", module=__name__, family="logits",
        check="check_prefill_then_decode", model="llama", case="decode_explicit_positions",
        message=("check_prefill_then_decode failed: HalfStoreCache on llama", "[failed at prefill(12)]"),
        cause=r"the cache stores keys/values as bfloat16 \(layers\[0\]\.keys.*\), narrower than the model's "
              r"float32",
        also_caught_by=_ALL_FAMILIES,
    ),
]
