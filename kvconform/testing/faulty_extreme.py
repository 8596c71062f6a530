"""Faulty caches that only zero or extreme data shows: ``check_zero_key_rows`` and ``check_fp16_extreme``
(``kvconform/checks/extreme.py``) catch them.

``NonzeroCountStaticCache`` is ``StaticCache`` with the length of transformers before the fix of #30377: it counts the
slots of layer 0 whose key is non-zero. Random seeded weights never write an all-zero key, so nearly every other case
passes (measured on llama: a left-padded reorder and ``poison_large``, whose 1e4 tail counts as held, catch it too);
a token whose embedding row is zero (a real checkpoint's padding or reserved token) is not counted, and the positions
the model derives from ``get_seq_length()`` fall behind. ``Fp16NormScaleCache`` is a lossy int8 cache whose scale
is computed in the model's dtype: float16 overflows only on activations near the top of its range, which
``check_fp16_extreme`` (``kvconform/checks/extreme.py``) reaches by scaling a copy's key/value projections. Both are
pinned in ``FULL_TIER_FAULTY`` (their cases are full tier; ``tests/caches/test_poison_extreme_growth.py`` runs them).
Every line that carries a bug is marked ``# BUG:``.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import StaticCache

from kvconform.testing import FaultyCache
from kvconform.testing.lossy import Int8ResidualCache, Int8ResidualLayer


class NonzeroCountStaticCache(StaticCache):
    """``StaticCache`` whose ``get_seq_length()`` counts the filled slots of its buffer (a slot is filled when its key
    is not all zeros), as transformers' ``StaticCache`` did before #30377."""

    def get_seq_length(self, layer_idx: int = 0) -> int:
        layer: Any = self.layers[layer_idx]
        if not layer.is_initialized:
            return 0
        return int(layer.keys[0, 0].any(dim=-1).sum())  # BUG: a held token whose key is all zeros is not counted

    def crop(self, max_length: int) -> None:
        """Crop, then zero the dropped slots: the length is read from the contents, so they must look empty."""
        super().crop(max_length)
        layers: list[Any] = list(self.layers)
        for layer in layers:
            if layer.is_initialized:
                held = int(layer.cumulative_length)
                layer.keys[:, :, held:].zero_()
                layer.values[:, :, held:].zero_()


class _NormScaleLayer(Int8ResidualLayer):
    @staticmethod
    def quantize(x: torch.Tensor):
        """int8 with one scale per vector from its L2 norm (never clips: ``|x_i| ≤ ‖x‖``), ``[..., D]`` →
        ``(q int8, scale float32 [..., 1])``."""
        norm = x.pow(2).sum(dim=-1, keepdim=True).sqrt()  # BUG: in x's dtype: squares past 256 overflow float16
        scale = norm.float() / 127.0
        q = torch.round(x.float() / scale.clamp_min(torch.finfo(torch.float32).tiny)).clamp_(-127, 127)
        return q.to(torch.int8), scale


class Fp16NormScaleCache(Int8ResidualCache):
    """``Int8ResidualCache`` whose per-vector scale comes from the vector's L2 norm, computed in the model's dtype:
    in float16 a component past 256 squares to inf (65504 is float16's largest), the scale is inf and the token
    dequantizes to NaN — the overflow of vLLM #53334 (scales kept in float16), reached only by large activations."""

    kvconform_lossy = {"kl_max": 1e-2, "top1_min": 0.9}  # a norm scale is coarser than absmax: its own budget
    layer_class = _NormScaleLayer


FAULTY: list = []
"""None run by ``tests/caches/test_faulty_caches.py`` (default tier): the cases that catch these are full tier."""

FULL_TIER_FAULTY = [
    FaultyCache(
        name="nonzero_count_length", attr="NonzeroCountStaticCache", module=__name__, family="logits",
        check="check_zero_key_rows", model="llama", case="zero_key_rows",
        message=("check_zero_key_rows failed: NonzeroCountStaticCache on llama", "get_seq_length() returned"),
        cause=r"the length is counted from the cache's contents, and token 5 .* has all-zero keys at layer 0",
        also_caught_by=("batch", "crop"),  # a left-padded row swapped into row 0 is counted from its own keys; a
        # crop past the start is its own crop (no inherited known fault)
    ),
    FaultyCache(
        name="fp16_norm_scale", attr="Fp16NormScaleCache", module=__name__, family="logits",
        check="check_fp16_extreme", model="llama", case="fp16_extreme",
        message=("check_fp16_extreme failed: Fp16NormScaleCache on llama", "keys/values scaled to |x| ≤ 20000"),
        cause=r"overflows where they are large: a quantization scale or zero point, a norm or a sum of squares",
    ),
]
