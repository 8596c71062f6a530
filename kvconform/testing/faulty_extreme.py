"""Faulty caches that only extreme data shows: ``check_zero_key_rows`` (``kvconform/checks/extreme.py``) catches them.

``NonzeroCountStaticCache`` is ``StaticCache`` with the length of transformers before the fix of #30377: it counts the
slots of layer 0 whose key is non-zero. Random seeded weights never write an all-zero key, so every other case passes;
a token whose embedding row is zero (a real checkpoint's padding or reserved token) is not counted, and the positions
the model derives from ``get_seq_length()`` fall behind. The line that carries the bug is marked ``# BUG:``.
"""

from __future__ import annotations

from transformers import StaticCache

from kvconform.testing import FaultyCache


class NonzeroCountStaticCache(StaticCache):
    """``StaticCache`` whose ``get_seq_length()`` counts the filled slots of its buffer (a slot is filled when its key
    is not all zeros), as transformers' ``StaticCache`` did before #30377."""

    def get_seq_length(self, layer_idx: int = 0) -> int:
        layer = self.layers[layer_idx]
        if not layer.is_initialized:
            return 0
        return int(layer.keys[0, 0].any(dim=-1).sum())  # BUG: a held token whose key is all zeros is not counted


FAULTY = [
    FaultyCache(
        name="nonzero_count_length", attr="NonzeroCountStaticCache", module=__name__, family="logits",
        check="check_zero_key_rows", model="llama", case="zero_key_rows",
        message=("check_zero_key_rows failed: NonzeroCountStaticCache on llama", "get_seq_length() returned"),
        cause=r"the length is counted from the cache's contents, and token 5 .* has all-zero keys at layer 0",
    ),
]
