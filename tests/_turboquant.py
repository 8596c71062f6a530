"""turboquant 0.2.0's ``TurboQuantCache`` as kvconform subjects (used by ``tests/caches/test_real_caches.py``).

Import this module only where turboquant is installed (``pytest.importorskip("turboquant")`` first). turboquant
0.2.0 needs two adaptations to run at all on what the project supports, both outside the cache's own logic:

* numpy ≥ 2.4 removed ``np.trapz``, which turboquant's codebook construction calls: aliased to ``np.trapezoid``;
* its ``update(key_states, value_states, layer_idx, cache_kwargs=None)`` does not take the keyword transformers 5.24
  passes (``update(..., kwargs=...)``): ``TQShim.update`` accepts and drops the extra arguments (turboquant ignores
  ``cache_kwargs`` anyway).

``TurboQuantCache(bits=3)`` is built without the model config, as turboquant's README shows: given a config,
``DynamicCache.__init__`` pre-builds plain ``DynamicLayer``s and ``TurboQuantCache.update`` then never adds its own
quantizing layers (``TQ3_cfg``: a "3-bit" cache that never quantizes, kept here to show that the compression check
sees it).
"""

from __future__ import annotations

import numpy as _np

if not hasattr(_np, "trapz"):  # numpy 2.4 removed trapz; turboquant 0.2.0's core.py calls np.trapz
    _np.trapz = _np.trapezoid

from turboquant.cache import TurboQuantCache, TurboQuantLayer  # noqa: E402

from kvconform import Budget, CacheSpec  # noqa: E402

RESIDUAL = 128
"""turboquant's default ``residual_len``: the last 128 tokens of every layer stay exact."""

# Measured on the quality_long case (240 tokens, fp32, batch 2; tests/caches/test_real_caches.py prints the numbers):
# 3-bit KL 1.5e-2 / 6.4e-4, top-1 0.70 / 0.96 (llama / gpt2; on a 272-token variant also phi3 8.5e-3, 0.78 and qwen2
# 1.0e-2, 0.74); 4-bit KL 4.9e-3 / 2.1e-4, top-1 0.84 / 0.97. Budgets: about 3× on KL, 0.1–0.15 on top-1.
TQ3_BUDGET = Budget(kl_max=5e-2, top1_min=0.55)
TQ4_BUDGET = Budget(kl_max=1.5e-2, top1_min=0.7)

CAPABILITIES = frozenset({"forward", "generate", "reset", "reorder", "crop", "deepcopy"})


class TQShim(TurboQuantCache):
    """``TurboQuantCache`` whose ``update`` accepts transformers 5.24's extra arguments (dropped: turboquant ignores
    ``cache_kwargs``)."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return TurboQuantCache.update(self, key_states, value_states, layer_idx)


def tq3():
    """``TurboQuantCache(bits=3)`` (residual 128), as its README builds it."""
    return TQShim(bits=3)


def tq4():
    """``TurboQuantCache(bits=4)`` (residual 128)."""
    return TQShim(bits=4)


def tq3_cfg(config):
    """``TurboQuantCache(bits=3, config=config)``: plain ``DynamicLayer``s, nothing is ever quantized."""
    return TQShim(bits=3, config=config)


class TQLeanLayer(TurboQuantLayer):
    """A ``TurboQuantLayer`` that does not keep its dequantized full-precision view (``keys`` / ``values``) after
    ``update`` returns it: what turboquant's compression would hold if the view were not kept."""

    def update(self, key_states, value_states, cache_kwargs=None):
        keys, values = super().update(key_states, value_states, cache_kwargs)
        self.keys = self.values = None  # the view is handed to attention, not kept
        return keys, values


class TQLean(TQShim):
    """``TQShim`` with ``TQLeanLayer``s (forward only: ``crop`` / ``reorder`` / ``reset`` of ``DynamicLayer`` read
    ``keys``)."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        while len(self.layers) <= layer_idx:
            self.layers.append(TQLeanLayer(bits=self.bits))
        return self.layers[layer_idx].update(key_states, value_states)


def tq3_lean():
    return TQLean(bits=3)


def spec(name: str, factory, budget: Budget = TQ3_BUDGET, capabilities=CAPABILITIES) -> CacheSpec:
    """A lossy ``CacheSpec`` of ``factory`` under ``name``."""
    return CacheSpec(name, factory, capabilities=frozenset(capabilities), kind="lossy", budget=budget,
                     source="python")
