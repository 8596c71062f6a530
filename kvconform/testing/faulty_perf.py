"""Faulty caches for the ``compile``, ``memory`` and ``speed`` families.

Each keeps the logits exact (the logits family passes them), so only the performance family it targets can see the
bug. Every line that carries the bug is marked ``# BUG:``. Each declares only the capabilities it needs
(``kvconform_capabilities``) so that no unrelated family is run on it.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer, StaticLayer

from kvconform.compat import layer_types_and_kwargs

from kvconform.testing import FaultyCache


def _text_config(config):
    return config.get_text_config(decoder=True)


class _NoCrop:
    """These caches do not declare ``crop``: they refuse it clearly (what the crop families expect)."""

    is_croppable = False

    def crop(self, tokens_to_remove):
        raise NotImplementedError(f"{type(self).__name__} does not support crop")


STATIC_BATCH = {"reset_batch": "static buffers are allocated once, for the first batch (a static shape for "
                               "torch.compile): another batch size after reset() is refused, clearly"}
"""The refusal the static caches below declare (``kvconform_refuses``): by design, not a fault of theirs."""


class _CarefulStaticLayer(_NoCrop, StaticLayer):
    """A StaticLayer done right everywhere the faults below do not touch: ``get_seq_length()`` returns a snapshot
    (not the live length tensor), and writing past ``max_cache_len`` raises a clear error before anything changes
    (checked eagerly only: under torch.compile the check would be a data-dependent branch); a batch of another size
    than the one its buffers were allocated for is refused clearly (a static shape: no graph break)."""

    def get_seq_length(self):
        return self.cumulative_length.clone() if self.is_initialized else 0

    def _check_capacity(self, new_tokens: int):
        if not torch.compiler.is_compiling() and self.is_initialized:
            if int(self.cumulative_length) + new_tokens > self.max_cache_len:
                raise ValueError(f"static cache full: {int(self.cumulative_length)} + {new_tokens} tokens exceed "
                                 f"max_cache_len {self.max_cache_len}")

    def update(self, key_states, value_states, *args, **kwargs):
        if self.is_initialized and key_states.shape[0] != self.keys.shape[0]:
            raise ValueError(f"batch size {key_states.shape[0]} differs from the batch size {self.keys.shape[0]} "
                             f"this static cache was allocated for; build a new cache for another batch size")
        self._check_capacity(key_states.shape[-2])
        return super().update(key_states, value_states, *args, **kwargs)


# ------------------------------------------------------------------------------------------------------ compile
class _BoundsCheckedStaticLayer(_CarefulStaticLayer):
    def _check_capacity(self, new_tokens: int):
        # BUG: the same capacity check without the is_compiling() guard: it branches on the length *tensor*, a
        # data-dependent graph break under torch.compile (fullgraph=True refuses it; without fullgraph every step
        # runs in two graphs)
        if self.cumulative_length + new_tokens > self.max_cache_len:
            raise ValueError(f"static cache full: more than max_cache_len {self.max_cache_len} tokens")


class BoundsCheckedStaticCache(Cache):
    """A static cache whose ``update()`` raises on overflow by testing the length tensor in Python: correct eagerly,
    a graph break under ``torch.compile`` although it declares ``is_compileable``."""

    kvconform_capabilities = ("forward", "generate", "reset", "compile")
    kvconform_refuses = STATIC_BATCH

    def __init__(self, config, max_cache_len=64, **kwargs):
        types, _ = layer_types_and_kwargs(_text_config(config))
        super().__init__(layers=[_BoundsCheckedStaticLayer(max_cache_len=int(max_cache_len)) for _ in types])


class _CountingStaticLayer(_CarefulStaticLayer):
    def __init__(self, max_cache_len, **kwargs):
        super().__init__(max_cache_len=max_cache_len)
        self.updates = 0

    def update(self, key_states, value_states, *args, **kwargs):
        # BUG: a Python-int statistics counter; dynamo guards on its value, so every decode step misses the compiled
        # graph (a recompile per step with dynamic=False, a SymInt re-record per step under CUDA graphs)
        self.updates += 1
        return super().update(key_states, value_states, *args, **kwargs)

    def reset(self):
        super().reset()
        self.updates = 0


class UpdateCounterStaticCache(Cache):
    """A static cache that counts ``update()`` calls in a Python int (harmless eagerly, a recompile per step under
    ``torch.compile``)."""

    kvconform_capabilities = ("forward", "generate", "reset", "compile")
    kvconform_refuses = STATIC_BATCH

    def __init__(self, config, max_cache_len=64, **kwargs):
        types, _ = layer_types_and_kwargs(_text_config(config))
        super().__init__(layers=[_CountingStaticLayer(max_cache_len=int(max_cache_len)) for _ in types])


# ------------------------------------------------------------------------------------------------------ memory
class _OutOfPlaceStaticLayer(_CarefulStaticLayer):
    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        # BUG: "functional" bookkeeping: the buffers are re-allocated after every write (a copy per step, as
        # x = x.index_copy(...) instead of x.index_copy_(...) would): the returned keys/values are right, but the
        # addresses CUDA graphs and torch.compile captured are stale from the second step on
        self.keys, self.values = self.keys.clone(), self.values.clone()
        return keys, values


class OutOfPlaceStaticCache(Cache):
    """A static cache that declares ``is_compileable`` but re-allocates its key/value buffers at every update:
    exact logits eagerly (and compiled on CPU), stale addresses for CUDA graphs."""

    kvconform_capabilities = ("forward", "generate", "reset", "compile")
    kvconform_refuses = STATIC_BATCH

    def __init__(self, config, max_cache_len=64, **kwargs):
        types, _ = layer_types_and_kwargs(_text_config(config))
        super().__init__(layers=[_OutOfPlaceStaticLayer(max_cache_len=int(max_cache_len)) for _ in types])


class _RepeatedKVLayer(_NoCrop, DynamicLayer):
    def __init__(self, n_rep: int = 1):
        super().__init__()
        self.n_rep = n_rep

    def update(self, key_states, value_states, *args, **kwargs):
        # BUG: stores keys/values expanded to the query heads ("saves the repeat_kv in attention"): n_rep × the
        # memory, while the model only ever needs the H_kv heads it handed over
        keys = key_states.repeat_interleave(self.n_rep, dim=1)
        values = value_states.repeat_interleave(self.n_rep, dim=1)
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        self.keys = torch.cat([self.keys, keys], dim=-2)
        self.values = torch.cat([self.values, values], dim=-2)
        return self.keys[:, :: self.n_rep], self.values[:, :: self.n_rep]

    def reset(self) -> None:
        # Not the bug: drop the states, as DynamicLayer.reset does since transformers 5.18 (before, the inherited
        # reset zeroed them in place and kept their length: a known fault this class should not show on 5.5)
        self.keys = self.values = None
        self.is_initialized = False


class RepeatedKVCache(Cache):
    """Stores keys/values repeated across the query heads (GQA expanded): exact logits, ``H/H_kv`` × the bytes."""

    kvconform_capabilities = ("forward", "generate", "reset")

    def __init__(self, config, **kwargs):
        text = _text_config(config)
        heads = int(text.num_attention_heads)
        n_rep = heads // int(getattr(text, "num_key_value_heads", None) or heads)
        types, _ = layer_types_and_kwargs(text)
        super().__init__(layers=[_RepeatedKVLayer(n_rep) for _ in types])


# ------------------------------------------------------------------------------------------------------ speed
class _DefragmentingLayer(_NoCrop, DynamicLayer):
    """Keeps one entry per token (so that eviction would be a list operation) and "defragments" them into a fresh
    contiguous buffer at every update; the buffer is handed to attention and dropped (memory stays exact)."""

    def __init__(self):
        super().__init__()
        self.key_tokens, self.value_tokens = [], []

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.key_tokens.extend(t.clone() for t in key_states.split(1, dim=-2))
        self.value_tokens.extend(t.clone() for t in value_states.split(1, dim=-2))
        total = len(self.key_tokens)
        keys = key_states.new_empty(*key_states.shape[:2], total, key_states.shape[-1])
        values = value_states.new_empty(*value_states.shape[:2], total, value_states.shape[-1])
        # BUG: a Python loop over every token ever stored, at every step: O(n) tensor ops per decoded token
        for i, (k_tok, v_tok) in enumerate(zip(self.key_tokens, self.value_tokens)):
            keys[:, :, i:i + 1] = k_tok
            values[:, :, i:i + 1] = v_tok
        return keys, values

    def get_seq_length(self) -> int:
        return len(self.key_tokens)

    def reset(self):
        super().reset()
        self.key_tokens, self.value_tokens = [], []


class DefragmentEveryStepCache(Cache):
    """Re-assembles the whole K/V from per-token entries with a Python loop at every update (O(n) ops/token)."""

    kvconform_capabilities = ("forward", "generate", "reset")

    def __init__(self, config, **kwargs):
        types, _ = layer_types_and_kwargs(_text_config(config))
        super().__init__(layers=[_DefragmentingLayer() for _ in types])


FAULTY = [
    FaultyCache(
        name="out_of_place_static", attr="OutOfPlaceStaticCache", module=__name__, family="compile",
        cause=r"update\(\) writes out of place",
        check="check_static_addresses", model="llama", case="static_addresses",
        message=("check_static_addresses failed: OutOfPlaceStaticCache on llama",
                 "is_compileable is True, but after decode 1", "buffer(s) are at another address than after prefill(8)",
                 "likely cause: update() writes out of place"),
        also_caught_by=("lifecycle",),  # reset_reuse sees the moved buffers too
    ),
    FaultyCache(
        name="bounds_checked_static", attr="BoundsCheckedStaticCache", module=__name__, family="compile",
        cause=r"the cache calls something dynamo cannot trace",
        check="check_compile_static_decode", model="llama", case="compile_decode",
        message=("check_compile_static_decode failed: BoundsCheckedStaticCache on llama",
                 "graph break under torch.compile(fullgraph=True): Data-dependent branching",
                 "faulty_perf.py", "in _check_capacity", "likely cause: the cache calls something dynamo cannot trace"),
    ),
    FaultyCache(
        name="update_counter_static", attr="UpdateCounterStaticCache", module=__name__, family="compile",
        cause=r"the cache keeps a Python int \([^)]*layers\[0\]\.updates\)",
        check="check_compile_static_decode", model="llama", case="compile_decode",
        message=("check_compile_static_decode failed: UpdateCounterStaticCache on llama",
                 "needed a recompile", "layers[0].updates", "likely cause: the cache keeps a Python int"),
    ),
    FaultyCache(
        name="repeated_kv", attr="RepeatedKVCache", module=__name__, family="memory",
        cause=r"stored repeated across the query heads",
        check="check_memory_bytes", model="llama", case="memory_decode",
        message=("check_memory_bytes failed: RepeatedKVCache on llama", "(2.00× the formula)",
                 "formula: 2·B2·H_kv2·D16·4B", "repeated across the query heads"),
    ),
    FaultyCache(
        name="defragment_every_step", attr="DefragmentEveryStepCache", module=__name__, family="speed",
        cause=r"every decode step does work proportional to the context in Python",
        check="check_speed_flat_decode", model="llama", case="speed_flat_decode",
        message=("check_speed_flat_decode failed: DefragmentEveryStepCache on llama", "per-token decode cost grew",
                 "but should grow ≤", "likely cause:"),
    ),
]
