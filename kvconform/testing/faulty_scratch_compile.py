"""A faulty compiled decode step of the worked from-scratch decoder (``kvconform.examples.tiny_decoder``), the
mistake an author compiling a static cache gpt-fast style makes (``tests/subjects/test_scratch_compile.py``)::

    pytest --kvconform --kvconform-full --kvconform-model kvconform.testing.faulty_scratch_compile:PythonIntFillCounter

* ``PythonIntFillCounter``: the static cache counts the tokens it holds in a Python int (``cache[i]["filled"]``,
  as torchtune's ``KVCache.size`` before pytorch/torchtune#1663) and the decode step reads its write position from
  it. Every logit is right, eager and compiled; but ``torch.compile`` specialises on the int, so every decode step
  misses the compiled graph and recompiles (``dynamic=False``: until the recompile limit, then it runs eagerly).
"""

from __future__ import annotations

import torch

from kvconform.examples.tiny_decoder import TinyDecoderTwoCaches


class PythonIntFillCounter(TinyDecoderTwoCaches):
    """A static cache whose fill position is a Python int kept in the cache (module docstring)."""

    name = "int_fill_counter"
    caches = {"IntCounterStaticCache": {"static": True}}
    compiled_decode = {"fullgraph": True, "caches": ["IntCounterStaticCache"]}

    def forward(self, model, ids, cache, start: int, mask=None):
        """The eager forward of the static cache, which also keeps the fill counter."""
        logits = model(ids, cache, start, mask)
        for layer in cache:
            layer["filled"] = start + ids.shape[1]
        return logits, cache

    def decode_step(self, model, ids, cache, pos):
        """The compiled step: writes where its own counter says (``pos`` unused), then counts the new tokens."""
        filled = cache[0]["filled"]
        logits = model.decode(ids, cache, torch.tensor(filled, device=ids.device))
        for layer in cache:
            layer["filled"] = filled + ids.shape[1]
        return logits, cache

    def crop(self, cache, n: int):
        """Rewind the counter by ``n`` tokens (a static cache reads ``[:filled]``)."""
        for layer in cache:
            layer["filled"] = max(layer.get("filled", 0) - n, 0)
        return cache
