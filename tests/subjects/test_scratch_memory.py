"""The memory family on caches made of ``nn.Module``s (issue 43): litgpt's, gpt-fast's and torchtune's ``KVCache``
hold their k and v as registered buffers, so the byte count enters modules (``_measure.held_tensor_items``) and
counts what the cache object owns — never the weights of a model it refers to (``owned_by_model``). Each number
below was checked by hand against ``numel · element_size`` of the buffers ``new_cache`` allocates."""

import os
import sys

import torch

from kvconform import check_cache
from kvconform.checks._measure import cache_bytes, held_bytes, held_tensor_items, owned_by_model

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import scratch_gptfast  # noqa: E402

# 2 blocks × (k, v) × B 2 × kv_heads 2 × max_len 64 × head_dim 8 × 4 bytes (float32)
BUFFERS = 2 * 2 * 2 * 2 * 64 * 8 * 4
MEMORY = ["check_memory_bytes", "check_memory_released"]


def _model():
    return scratch_gptfast.GptFast().build(torch.float32, "cpu")


def test_a_list_of_kvcache_modules_is_counted_as_its_buffers():
    model = _model()
    cache = scratch_gptfast.GptFast().new_cache(model, 2, 64)
    by_hand = sum(b.numel() * b.element_size() for block in cache for b in block.buffers())
    assert by_hand == BUFFERS == 32768
    assert held_bytes(cache) == BUFFERS
    assert [path for path, _ in held_tensor_items(cache)] == ["[0].k_cache", "[0].v_cache", "[1].k_cache",
                                                              "[1].v_cache"]


def test_a_cache_that_refers_to_its_model_is_not_charged_its_weights():
    model = _model()
    cache = scratch_gptfast.GptFastBound().new_cache(model, 2, 64)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert held_bytes(cache) == BUFFERS + weights  # the walker reaches the weights through cache.model ...
    assert cache_bytes(cache, exclude=owned_by_model(model)) == ({"cache": BUFFERS}, 0)  # ... and leaves them out
    cache.blocks = list(model.attn)  # a cache holding modules of the model (its attention modules) instead
    assert cache_bytes(cache, exclude=owned_by_model(model)) == ({"cache": 0}, 0)


def test_a_transformers_model_a_cache_refers_to_is_never_entered():
    from transformers import DynamicCache

    from kvconform.zoo import build_zoo_model

    zm = build_zoo_model("llama")
    cache = DynamicCache(config=zm.config)
    cache.model = zm.model  # a model-aware cache keeping its model
    assert held_bytes(cache) == 0


def test_module_held_caches_pass_the_memory_family_and_one_preallocating_four_times_its_capacity_fails():
    results = check_cache([], models=[scratch_gptfast.GptFast(), scratch_gptfast.GptFastBound(),
                                      scratch_gptfast.GptFastRoomToGrow()], checks=MEMORY)
    by = {(r.subject, r.case): r for r in results}
    for subject in ("GptFastKVCache", "BoundKVCache"):
        for case in ("memory_decode", "memory_beam", "memory_released"):
            r = by[(subject, case)]
            assert r.outcome == "passed", r.message
            assert r.metrics["bytes_held"] == BUFFERS, r.metrics  # measured, not blind
        assert by[(subject, "memory_decode")].metrics["bytes_formula"] == BUFFERS
    for case in ("memory_decode", "memory_beam"):
        bad = by[("RoomToGrowKVCache", case)]
        assert bad.outcome == "failed", bad.message
        assert bad.metrics["bytes_held"] == 4 * BUFFERS, bad.metrics
        assert "buffers preallocated for 256 tokens per row, 4.00× the 64 tokens the cache says it takes" \
            in bad.message, bad.message
        # the step a memory item names is where bytes were read: no cause about a wrong forward comes first
        assert "your cached forward" not in bad.message, bad.message
