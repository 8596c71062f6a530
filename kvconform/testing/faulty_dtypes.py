"""Faulty caches that only low precision shows: right on a float32 model (they pass every float32 item), wrong on the
bfloat16 / float16 models GPU users run. Each is caught by a default-tier ``bf16_*`` / ``fp16_*`` case
(``conformance_cases/logits.toml``) with a measured likely-cause line, and transformers' ``DynamicCache`` passes
those cases.

* ``DefaultDtypeBufferCache``: buffers allocated in the default dtype (``torch.tensor([])`` without ``dtype=``:
  float32 whatever the model runs), so every ``update()`` concatenates into float32 and hands that to the attention.
* ``UpcastKeysCache``: stores the model's dtype but returns keys/values upcast to float32 "for precise scores".
* ``BfloatForHalfCache``: stores any 16-bit dtype as bfloat16 ("same size, more range"): lossless for a bfloat16
  model, three mantissa bits lost on a float16 one.
* ``HalfCountCache``: a growing buffer whose fill count is a running sum kept on the device in the keys' dtype:
  bfloat16 holds every integer only up to 256 (8 significant bits), so past 256 tokens ``256 + 1`` rounds back to
  256: the count stalls, each new token overwrites slot 256 and is never attended (``bf16_long_decode``).

Each class carries one bug (the line is marked ``# BUG:``); ``FAULTY`` pins the check, case and likely-cause line
(``tests/caches/test_faulty_caches.py``, ``tests/lossy/test_low_precision.py``). They are built for attention-only
decoder models
(the pinned model is llama).

Measured and left out (a running sum that *is* caught: ``HalfCountCache``): a running absmax scale kept and applied
in the half dtype (keys stored normalised, rescaled in place whenever the scale grows) sits at 1.08× the bf16 noise
floor on llama with these cases: no logit comparison at that dtype can tell it from rounding, so it would be a
faulty cache nothing catches.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvconform.compat import layer_types_and_kwargs
from kvconform.testing import FaultyCache


# ------------------------------------------------------------------------------------------ default-dtype buffers
class _DefaultDtypeBufferLayer(DynamicLayer):
    def lazy_initialization(self, key_states, value_states):
        super().lazy_initialization(key_states, value_states)
        # BUG: no dtype= — the buffers are torch.get_default_dtype() (float32) whatever the model computes in; every
        # update() then concatenates the states into them (torch.cat promotes) and returns float32
        self.keys = torch.tensor([], device=self.device)
        self.values = torch.tensor([], device=self.device)


class DefaultDtypeBufferCache(Cache):
    """Allocates its key/value buffers with ``torch.tensor([], device=...)`` and no ``dtype``: float32 on every
    model. Exact on a float32 model; a bfloat16 / float16 model gets float32 keys back from ``update()``."""

    kvconform_capabilities = ("forward", "crop")  # DynamicLayer.crop is right for it: declared, so crop is judged

    def __init__(self, config=None, **kwargs):
        types, _ = layer_types_and_kwargs(config)
        super().__init__(layers=[_DefaultDtypeBufferLayer() for _ in types])


# ------------------------------------------------------------------------------------------ upcast on return
class _UpcastKeysLayer(DynamicLayer):
    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        # BUG: "precise attention scores": the held keys/values are returned upcast to float32
        return keys.float(), values.float()


class UpcastKeysCache(Cache):
    """Stores keys/values in the model's dtype and returns them ``.float()``: a no-op on a float32 model, float32
    keys for a bfloat16 / float16 model's attention."""

    kvconform_capabilities = ("forward", "crop")  # DynamicLayer.crop is right for it: declared, so crop is judged

    def __init__(self, config=None, **kwargs):
        types, _ = layer_types_and_kwargs(config)
        super().__init__(layers=[_UpcastKeysLayer() for _ in types])


# ------------------------------------------------------------------------------------------ bf16 for any 16-bit
class _BfloatForHalfLayer(DynamicLayer):
    def update(self, key_states, value_states, *args, **kwargs):
        # BUG: any 16-bit dtype is stored as bfloat16 ("same bytes, more range"): a float16 model loses 3 mantissa bits
        store = torch.bfloat16 if key_states.element_size() == 2 else key_states.dtype
        keys, values = super().update(key_states.to(store), value_states.to(store), *args, **kwargs)
        return keys.to(key_states.dtype), values.to(value_states.dtype)


class BfloatForHalfCache(Cache):
    """Stores every 16-bit model's keys/values as bfloat16 and widens them back on the way out: exact for float32
    and bfloat16 models, rounded to bfloat16's 8-bit mantissa for a float16 model."""

    kvconform_capabilities = ("forward", "crop")  # DynamicLayer.crop is right for it: declared, so crop is judged

    def __init__(self, config=None, **kwargs):
        types, _ = layer_types_and_kwargs(config)
        super().__init__(layers=[_BfloatForHalfLayer() for _ in types])


# ------------------------------------------------------------------------------------------ a count in the half dtype
class _HalfCountLayer(DynamicLayer):
    """A preallocated buffer grown by doubling, with its fill count kept on the device as a 0-d tensor."""

    def lazy_initialization(self, key_states, value_states):
        super().lazy_initialization(key_states, value_states)
        batch, heads, _, dim = key_states.shape
        self.keys = key_states.new_zeros((batch, heads, 64, dim))
        self.values = value_states.new_zeros((batch, heads, 64, value_states.shape[-1]))
        # BUG: the fill count is made "like the keys" (their dtype, so no host sync): bfloat16 counts every integer
        # only up to 256, float16 up to 2048; past that, count + 1 rounds back and the count stalls
        self.count = torch.zeros((), dtype=key_states.dtype, device=key_states.device)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, new = int(self.count), key_states.shape[-2]
        if start + new > self.keys.shape[-2]:  # double the capacity
            grow = max(self.keys.shape[-2], start + new - self.keys.shape[-2])
            self.keys = torch.cat([self.keys, self.keys.new_zeros(self.keys.shape[:2] + (grow, self.keys.shape[3]))],
                                  dim=-2)
            self.values = torch.cat([self.values, self.values.new_zeros(self.values.shape[:2] + (grow,
                                                                        self.values.shape[3]))], dim=-2)
        self.keys[:, :, start:start + new] = key_states
        self.values[:, :, start:start + new] = value_states
        self.count += new
        held = int(self.count)
        return self.keys[:, :, :held], self.values[:, :, :held]

    def get_seq_length(self) -> int:
        return int(self.count) if self.is_initialized else 0


class HalfCountCache(Cache):
    """Keys/values in a doubling buffer of the model's dtype with a 0-d fill count in that dtype too: exact on
    float32 models (and below 256 tokens at bfloat16); past 256 tokens a bfloat16 model's count stops at 256."""

    kvconform_capabilities = ("forward",)

    def __init__(self, config=None, **kwargs):
        types, _ = layer_types_and_kwargs(config)
        super().__init__(layers=[_HalfCountLayer() for _ in types])


FAULTY = [
    FaultyCache(
        name="default_dtype_buffer", attr="DefaultDtypeBufferCache", module=__name__, family="logits",
        check="check_prefill_then_decode", model="llama", case="bf16_decode_padded",
        message=("check_prefill_then_decode failed: DefaultDtypeBufferCache on llama (bf16, batch 2)",
                 "[raised at prefill(12)]"),
        cause=r"update\(layer_idx=0\) returned keys of dtype float32 for key/value states of dtype bfloat16",
        also_caught_by=("crop",),  # bf16_crop_padded raises the same way
    ),
    FaultyCache(
        name="upcast_keys", attr="UpcastKeysCache", module=__name__, family="logits",
        check="check_prefill_then_decode", model="llama", case="fp16_decode_padded",
        message=("check_prefill_then_decode failed: UpcastKeysCache on llama (fp16, batch 2)",
                 "[raised at prefill(12)]"),
        cause=r"update\(layer_idx=0\) returned keys of dtype float32 for key/value states of dtype float16",
        also_caught_by=("crop",),  # bf16_crop_padded raises the same way
    ),
    FaultyCache(
        name="bfloat_for_half", attr="BfloatForHalfCache", module=__name__, family="logits",
        check="check_prefill_then_decode", model="llama", case="fp16_decode_padded",
        message=("check_prefill_then_decode failed: BfloatForHalfCache on llama (fp16, batch 2)",
                 "within the float16 tolerance", "less precisely than the model's float16"),
        cause=r"the cache stores keys/values as bfloat16 \(layers\[0\]\.keys.*\), narrower than the model's "
              r"float16",
    ),
    FaultyCache(
        name="half_count", attr="HalfCountCache", module=__name__, family="logits",
        check="check_prefill_then_decode", model="llama", case="bf16_long_decode",
        message=("check_prefill_then_decode failed: HalfCountCache on llama (bf16, batch 2)",
                 "[raised at decode 5]"),
        cause=r"returned keys of length 256 for a cache that should hold 257 tokens.* 256 is where bfloat16 stops "
              r"holding every integer: a token or fill count kept in the model's dtype",
        # float32 too: a doubling buffer holds up to twice the tokens (memory) and it implements only forward (contract)
        also_caught_by=("contract", "memory"),
    ),
]
