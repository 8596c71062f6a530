"""Faulty quantized caches (and one encoder-decoder fault).

Each quantized one declares a quantization (its fake-quant twin) and gets one realistic thing wrong beyond the
rounding that quantization allows. Each such attr is a ``CacheSpec`` (``--kvconform-cache
kvconform.testing.faulty_quant:KeysAt2BitsCache``), built like the built-in ``QuantizedCache_quanto4`` subject:
quanto, 4 bits, residual 4, group ``gcd(64, kv_heads · head_dim)``.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from transformers import QuantizedCache, StaticCache
from transformers.cache_utils import QuantoQuantizedLayer

from kvconform.quant import QuantConfig, group_size_for, twin_factory
from kvconform.subjects import QUANTIZED_BUDGETS, CacheSpec, full_attention_only
from kvconform.testing import FaultyCache

DECLARED = QuantConfig("quanto", nbits=4)


def _layer_kwargs(config):
    return dict(nbits=DECLARED.nbits, axis_key=DECLARED.axis_key, axis_value=DECLARED.axis_value,
                q_group_size=group_size_for(config), residual_length=DECLARED.residual_length)


def _cache_with(layer_cls):
    def build(config):
        cache = QuantizedCache("quanto", config, **_layer_kwargs(config))
        cache.layers = [layer_cls(**_layer_kwargs(config)) for _ in cache.layers]
        return cache

    return build


# Faults these caches inherit from transformers' QuantizedLayer (kvconform/known_faults.toml), not their own bug.
INHERITED = {
    "check_crop_refused": "inherited from transformers' QuantizedLayer: crop() raises IndexError / drops the residual",
}


def _spec(name, layer_cls, capabilities=("forward", "generate", "reorder", "reset")):
    return CacheSpec(name, _cache_with(layer_cls), capabilities=frozenset(capabilities), twin=twin_factory(DECLARED),
                     kind="lossy", budget=QUANTIZED_BUDGETS["QuantizedCache_quanto4"], applies_to=full_attention_only,
                     source=f"{__name__}:{name}", expected_failures=INHERITED,
                     requires={"optimum.quanto": "pip install kvconform[quanto]"})


class _KeysAt2BitsLayer(QuantoQuantizedLayer):
    """Keys get their own qtype, which is 2-bit although the layer declares (and its values use) 4 bits."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        from optimum.quanto import qint2

        self.key_qtype = qint2  # BUG: should be self.qtype (qint4 for nbits=4)
        self._quantized = 0

    def _quantize(self, tensor, axis):
        from optimum.quanto import quantize_weight

        # QuantizedLayer.update always quantizes the keys first, then the values
        qtype = self.key_qtype if self._quantized % 2 == 0 else self.qtype
        self._quantized += 1
        scale, zeropoint = self.optimizer(tensor, qtype, axis, self.q_group_size)
        return quantize_weight(tensor, qtype, axis, scale, zeropoint, self.q_group_size)


class _ReorderResidualOnlyLayer(QuantoQuantizedLayer):
    """reorder_cache reorders the exact residual only (what transformers 5.5–5.18 did)."""

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        # BUG: the quantized part (self._quantized_keys/_values) keeps the old row order
        if self.keys is not None and self.keys.dim() == 4 and self.keys.shape[-2] > 0:
            self.keys = self.keys.index_select(0, beam_idx.to(self.keys.device))
            self.values = self.values.index_select(0, beam_idx.to(self.values.device))


class _FlushOneLateLayer(QuantoQuantizedLayer):
    """The residual window is one token longer than declared: every flush comes one step late."""

    def __init__(self, residual_length=128, **kwargs):
        # BUG: "keep residual_length exact tokens, then the new one" — the window is off by one
        super().__init__(residual_length=residual_length + 1, **kwargs)


class _ShallowCopyQuantizedCache(QuantizedCache):
    """deepcopy "works" by copying the container only: the copy and the original share their layers."""

    def __deepcopy__(self, memo):
        # BUG: quanto's tensors refuse copy.deepcopy, so only the cache object is copied; the layers are shared
        return copy.copy(self)


def _shallow_copy_cache(config):
    return _ShallowCopyQuantizedCache("quanto", config, **_layer_kwargs(config))


KeysAt2BitsCache = _spec("KeysAt2BitsCache", _KeysAt2BitsLayer)
ShallowCopyQuantizedCache = dataclasses.replace(_spec("ShallowCopyQuantizedCache", QuantoQuantizedLayer),
                                                factory=_shallow_copy_cache)
ReorderForgetsQuantizedCache = _spec("ReorderForgetsQuantizedCache", _ReorderResidualOnlyLayer)
FlushOneLateCache = _spec("FlushOneLateCache", _FlushOneLateLayer)

FAULTY = [
    FaultyCache(
        name="keys_at_2_bits", attr="KeysAt2BitsCache", module=__name__, family="logits",
        cause=r"differ from its declared quantization \(its fake-quant twin\) as soon as it reads stored tokens back",
        check="check_prefill_then_decode", model="llama", case="decode_explicit_positions",
        message=("check_prefill_then_decode failed: KeysAt2BitsCache on llama", "vs its fake-quant twin",
                 "[failed at decode 1]", "→ the fault is in the subject"),
        also_caught_by=("generate", "quality", "batch", "lifecycle", "memory"),
    ),
    FaultyCache(
        name="reorder_forgets_quantized", attr="ReorderForgetsQuantizedCache", module=__name__, family="batch",
        cause=r"reorder_cache\(\) moved part of the cache but not all of it: the quantized part",
        check="check_reorder_after_flush", model="llama", case="flush_then_reorder",
        message=("check_reorder_after_flush failed: ReorderForgetsQuantizedCache on llama", "vs its fake-quant twin",
                 "[failed at decode 1 after reorder]", "twin: FakeQuantCache (quanto 4-bit",
                 "kept the old row order"),
    ),
    FaultyCache(
        name="shallow_deepcopy", attr="ShallowCopyQuantizedCache", module=__name__, family="prefix",
        cause=r"__deepcopy__ shares tensors or counters between the copy and the original",
        check="check_deepcopy_refused", model="llama", case="deepcopy_after_flush",
        message=("check_deepcopy_refused failed: ShallowCopyQuantizedCache on llama",
                 "extending the deepcopy changed the original: get_seq_length() 16 → 17",
                 "shares tensors or counters between the copy and the original"),
    ),
    FaultyCache(
        name="flush_one_late", attr="FlushOneLateCache", module=__name__, family="logits",
        cause=r"matches its fake-quant twin for the first 16 positions and departs from it at position 16: it "
              r"quantizes at other steps than it declares — its residual flush \(residual_length 4\)",
        check="check_prefill_then_decode", model="llama", case="decode_explicit_positions",
        message=("check_prefill_then_decode failed: FlushOneLateCache on llama", "vs its fake-quant twin",
                 "[failed at decode 5]", "→ the fault is in the subject"),
        also_caught_by=("generate", "batch", "lifecycle"),
    ),
]


# ------------------------------------------------------------------------------------------ encoder-decoder
class LengthIsCapacityCache(StaticCache):
    """A static cache whose get_seq_length() reports its capacity (max_cache_len) once anything is stored.

    Harmless-looking for a cross-attention sub-cache (sized to the encoder input, so full at once), wrong for the
    self-attention one; caught on t5/bart by the encoder-decoder sub-cache check.
    """

    kvconform_capabilities = ("forward", "generate", "reset")

    def get_seq_length(self, layer_idx: int = 0) -> int:
        held = super().get_seq_length(layer_idx)
        # BUG: the buffer size is reported instead of the number of tokens written into it
        return self.layers[layer_idx].max_cache_len if held > 0 else 0


FAULTY.append(FaultyCache(
    name="length_is_capacity", attr="LengthIsCapacityCache", module=__name__, family="contract",
    cause=r"get_seq_length\(\) of the self-attention sub-cache does not count the decoder tokens",
    check="check_encoder_decoder_subcaches", model="t5", case="encdec_subcaches",
    message=("check_encoder_decoder_subcaches failed: LengthIsCapacityCache on t5",
             "self-attention sub-cache holds", "but should hold the 5 decoder tokens fed"),
    also_caught_by=("logits", "generate", "lifecycle"),
))
