"""A cache whose ``update()`` copies the new keys/values token by token in Python: one op per token, so a decode
step (one token) costs what any cache's does, while a prefill of N tokens runs N Python iterations per layer —
invisible to the decode budgets (``check_speed_flat_decode``, ``check_speed_vs_uncached`` time decode only), caught
by ``check_speed_prefill`` (a cached prefill of N tokens against the uncached forward of the same N tokens, side
by side). Logits and held bytes are exact. The bundled correct caches of other designs (transformers'
``DynamicCache``: one ``torch.cat`` per update; ``StaticCache``: one ``index_copy_`` into a preallocated buffer;
kvconform's ``ReferenceCache``: a list of chunks) pass the same item.
"""

from __future__ import annotations

from transformers.cache_utils import Cache, DynamicLayer

from kvconform.compat import layer_types_and_kwargs
from kvconform.testing import FaultyCache


class _TokenLoopLayer(DynamicLayer):
    is_croppable = False

    def crop(self, tokens_to_remove):
        raise NotImplementedError(f"{type(self).__name__} does not support crop")

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        held, new = (self.keys.shape[-2] if self.keys.dim() == 4 else 0), key_states.shape[-2]
        keys = key_states.new_empty(*key_states.shape[:2], held + new, key_states.shape[-1])
        values = value_states.new_empty(*value_states.shape[:2], held + new, value_states.shape[-1])
        if held:
            keys[:, :, :held], values[:, :, :held] = self.keys, self.values
        # BUG: the new tokens are written one at a time (a per-token bookkeeping loop carried over from a decode-only
        # design): a prefill of N tokens is N Python iterations per layer instead of one slice copy
        for t in range(new):
            keys[:, :, held + t] = key_states[:, :, t]
            values[:, :, held + t] = value_states[:, :, t]
        self.keys, self.values = keys, values
        return keys, values

    def reset(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False


class TokenLoopPrefillCache(Cache):
    """Stores each forward's keys/values with a Python loop over its tokens (O(N) Python ops per prefill)."""

    kvconform_capabilities = ("forward", "generate", "reset")

    def __init__(self, config, **kwargs):
        types, _ = layer_types_and_kwargs(config.get_text_config(decoder=True))
        super().__init__(layers=[_TokenLoopLayer() for _ in types])


FAULTY = [
    FaultyCache(
        name="token_loop_prefill", attr="TokenLoopPrefillCache", module=__name__, family="speed",
        check="check_speed_prefill", model="llama", case="speed_prefill",
        message=("check_speed_prefill failed: TokenLoopPrefillCache on llama", "a cached prefill of 1024 tokens took",
                 "× the uncached forward of the same tokens"),
        cause=r"the prefill does work per token in Python",
    ),
]
