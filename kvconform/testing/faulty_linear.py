"""A recurrent (linear-attention) layer that claims ``is_croppable`` and rolls back nothing, and a cache of the same
build that refuses crop clearly.

Both reuse transformers' own layers the way a README-style cache for Mamba-style models does (``DynamicCache``
built from the config, its ``LinearAttentionLayer`` slots replaced by a subclass). The faulty one says
``is_croppable = True`` — "the conv state is a rolling window, so crop is safe" — and its ``crop()`` does nothing:
the conv and recurrent (SSM) states keep the tokens crop should have removed. Assisted decoding trusts the flag, so
the next tokens continue from a state that saw the rejected ones. Caught by ``check_crop_contract`` on mamba2 in the
default tier (``crop_linear_recording``); the bundled correct cache of the same build (``RefusingLinearCache``:
``is_croppable`` False, ``crop()`` raises a clear ``RuntimeError`` before touching anything) and kvconform's
``ReferenceCache`` (its own layers, which refuse a crop once a recurrent state is held) pass the same case.
"""

from __future__ import annotations

from transformers.cache_utils import DynamicCache, DynamicLayer, LinearAttentionLayer

try:  # the hybrid layer of FalconH1 (a recurrent state and attention in one layer object); absent on old releases
    from transformers.cache_utils import LinearAttentionAndFullAttentionLayer
except ImportError:  # pragma: no cover - transformers < 5.6
    LinearAttentionAndFullAttentionLayer = None

from kvconform.testing import FaultyCache


class _CroppableLinearLayer(LinearAttentionLayer):
    # BUG: claims a rollback it cannot do: a recurrent state summarises every token it saw and cannot be rewound
    is_croppable = True  # type: ignore[assignment]  # transformers' is a property

    def crop(self, tokens_to_remove: int) -> None:
        # BUG: "the conv state is a fixed window and the SSM state has no length": nothing is rolled back
        return None


class _CroppableFlagLinearLayer(LinearAttentionLayer):
    # BUG: the flag alone ("DynamicLayer is croppable, so is this"): transformers' own crop() then refuses without
    # past recording (a refusal the flag promised would not come) and, with it, rolls back the conv state only
    is_croppable = True  # type: ignore[assignment]  # transformers' is a property

    def activate_past_recording(self, *args, **kwargs) -> None:
        # not the bug: transformers 5.25 stores recurrent_states_to_keep = None here, which its mixers cannot take
        # (known fault linear-recording-none-count); the author keeps the count at 0, as kvconform's reference does
        super().activate_past_recording(*args, **kwargs)
        if getattr(self, "recurrent_states_to_keep", 0) is None:
            self.recurrent_states_to_keep = 0


class _RefusingLinearLayer(LinearAttentionLayer):
    """A ``LinearAttentionLayer`` that never claims a rollback and refuses ``crop`` clearly, before any change."""

    is_croppable = False  # type: ignore[assignment]  # transformers' is a property

    def crop(self, tokens_to_remove: int) -> None:
        """Raises ``RuntimeError`` for any crop that would remove tokens (``crop(0)`` is a no-op): a recurrent
        (SSM) state summarises every token seen and cannot be rewound."""
        if tokens_to_remove:
            raise RuntimeError(f"{type(self).__name__} cannot crop({tokens_to_remove}): a recurrent (SSM) state "
                               f"cannot be rewound; build a new cache and prefill the kept tokens instead")


def _with_linear_layers(cache: DynamicCache, layer_class) -> DynamicCache:
    """Replace each plain ``LinearAttentionLayer`` of ``cache`` (built from a config, still empty) by ``layer_class``
    with the same number of states."""
    for i, layer in enumerate(cache.layers):
        if type(layer) is LinearAttentionLayer:
            cache.layers[i] = layer_class(number_of_states=layer.number_of_states)
    return cache


class CroppableLinearCache(DynamicCache):
    """``DynamicCache`` whose linear-attention layers say ``is_croppable = True`` and ignore ``crop()``."""

    kvconform_capabilities = ("forward", "generate", "crop")

    def __init__(self, config=None, **kwargs):
        super().__init__(config=config)
        _with_linear_layers(self, _CroppableLinearLayer)


class CroppableFlagLinearCache(DynamicCache):
    """``DynamicCache`` whose linear-attention layers say ``is_croppable = True`` and keep transformers' ``crop()``."""

    kvconform_capabilities = ("forward", "generate", "crop")

    def __init__(self, config=None, **kwargs):
        super().__init__(config=config)
        _with_linear_layers(self, _CroppableFlagLinearLayer)


class _SilentHybridLayer(LinearAttentionAndFullAttentionLayer or object):  # type: ignore[misc]
    # BUG: "crop is the attention part's job": claims a rollback and crops the keys/values only, silently keeping
    # the conv and recurrent states that saw the removed tokens
    is_croppable = True  # type: ignore[assignment]  # transformers' is a property

    def crop(self, tokens_to_remove: int) -> None:
        DynamicLayer.crop(self, tokens_to_remove)


class HybridSilentCropCache(DynamicCache):
    """``DynamicCache`` whose hybrid layers (a recurrent state next to attention in one layer object: FalconH1's
    ``LinearAttentionAndFullAttentionLayer``) say ``is_croppable = True`` and crop only their keys/values. On the
    zoo only falcon_h1 has such layers; its pure linear-attention models are untouched (they pass)."""

    kvconform_capabilities = ("forward", "generate", "crop")

    def __init__(self, config=None, **kwargs):
        super().__init__(config=config)
        for i, layer in enumerate(self.layers):
            if LinearAttentionAndFullAttentionLayer is not None and type(layer) is LinearAttentionAndFullAttentionLayer:
                self.layers[i] = _SilentHybridLayer(number_of_states=layer.number_of_states)


class _RefusingHybridLayer(LinearAttentionAndFullAttentionLayer or object):  # type: ignore[misc]
    """FalconH1's hybrid layer that never claims a rollback and refuses ``crop`` clearly, before any change."""

    is_croppable = False  # type: ignore[assignment]  # transformers' is a property

    def crop(self, tokens_to_remove: int) -> None:
        """Raises ``RuntimeError`` for any crop that would remove tokens (``crop(0)`` is a no-op)."""
        if tokens_to_remove:
            raise RuntimeError(f"{type(self).__name__} cannot crop({tokens_to_remove}): its recurrent (SSM) state "
                               f"cannot be rewound; build a new cache and prefill the kept tokens instead")


class RefusingHybridCache(DynamicCache):
    """The correct design of the same build as ``HybridSilentCropCache``: its hybrid layers say
    ``is_croppable = False`` and refuse ``crop()`` clearly."""

    kvconform_capabilities = ("forward", "generate", "crop")

    def __init__(self, config=None, **kwargs):
        super().__init__(config=config)
        for i, layer in enumerate(self.layers):
            if LinearAttentionAndFullAttentionLayer is not None and type(layer) is LinearAttentionAndFullAttentionLayer:
                self.layers[i] = _RefusingHybridLayer(number_of_states=layer.number_of_states)


class RefusingLinearCache(DynamicCache):
    """``DynamicCache`` whose linear-attention layers say ``is_croppable = False`` and refuse ``crop()`` clearly
    (the correct design of the same build as ``CroppableLinearCache``)."""

    kvconform_capabilities = ("forward", "generate", "crop")

    def __init__(self, config=None, **kwargs):
        super().__init__(config=config)
        _with_linear_layers(self, _RefusingLinearLayer)


FAULTY = [
    FaultyCache(
        name="hybrid_silent_crop", attr="HybridSilentCropCache", module=__name__, family="crop",
        check="check_crop_then_continue", model="falcon_h1", case="crop_short",
        message=("check_crop_then_continue failed: HybridSilentCropCache on falcon_h1", "[failed at decode 1]"),
        cause=r"crop\(-2\) was accepted, but the recurrent state still holds the removed tokens: is_croppable is True "
              r"on a linear-attention layer that holds a recurrent \(SSM\) state",
    ),
    FaultyCache(
        name="linear_croppable_noop", attr="CroppableLinearCache", module=__name__, family="crop",
        check="check_crop_then_continue", model="mamba", case="crop_short",
        message=("check_crop_then_continue failed: CroppableLinearCache on mamba",),
        # up to 5.24 the Δ at decode 1; from 5.25 the layer counts its tokens, and the no-op crop keeps that count
        cause=r"crop\(-2\) was accepted, but the recurrent state still holds the removed tokens: is_croppable is True "
              r"on a linear-attention layer that holds a recurrent \(SSM\) state \(layer 0, layer 1\)"
              r"|crop\(\) removed a different number of tokens than asked",
    ),
    FaultyCache(
        name="linear_croppable_flag", attr="CroppableFlagLinearCache", module=__name__, family="crop",
        # crop_short (no recording): transformers' crop() refuses what the flag promised, on every release (with
        # recording, 5.25's own layers rewind decode steps, so the flag no longer lies there)
        check="check_crop_then_continue", model="mamba", case="crop_short",
        message=("check_crop_then_continue failed: CroppableFlagLinearCache on mamba",),
        cause=r"is_croppable is True on a linear-attention layer that holds a recurrent \(SSM\) state"),
]
