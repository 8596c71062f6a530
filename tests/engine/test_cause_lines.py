"""The diagnosis reads where the exception was raised and what was measured, not which family ran.

(Every bundled faulty cache's own "likely cause:" line is pinned by ``tests/caches/test_faulty_caches.py``, from the
run it
shares with the other faulty caches of its group.) Here, the diagnosis kinds on their own: a raise before a batch op
is not blamed on the op; a layer count below the decoder depth is named with both numbers, and the same cache passes
where the depths agree; NaN compares equal to NaN when checking that an original did not change; correct caches of
other designs pass the checks that catch the faulty ones.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvconform.api import check_cache

def _cause_line(message: str) -> str:
    lines = [line.strip() for line in message.splitlines() if line.strip().startswith("likely cause:")]
    assert len(lines) == 1, message
    return lines[0]


def _run(spec, model, check, case):
    return check_cache(spec, models=[model], checks=[check], cases=[case])


def test_raise_at_prefill_is_not_blamed_on_the_batch_op():
    """A key length one short raises inside attention at prefill(8) of a reorder case: the cause names the length
    update() returned and the tokens held, not reorder_cache() (which never ran)."""
    [result] = _run("kvconform.testing.faulty_causes:UpdateOneShortCache", "llama", "check_reorder_then_decode",
                    "reorder_padded")
    assert result.outcome == "failed", result.message
    assert "[raised at prefill(8)]" in result.message
    line = _cause_line(result.message)
    assert "update(layer_idx=0) returned keys of length 7 for a cache that should hold 8 tokens" in line, line
    assert "reorder_cache" not in line, line


def test_batch_cause_follows_the_raising_op():
    """``batch._raised_cause`` reads the op index of the raise against the batch op's, without measurements."""
    from kvconform.cases import Op
    from kvconform.checks._drive import SubjectRaised
    from kvconform.checks.batch import _raised_cause

    ctx = SimpleNamespace(case=SimpleNamespace(ops=[Op("prefill", 8), Op("decode", 2), Op("reorder"),
                                                   Op("decode", 3)]))
    before = _raised_cause(ctx, SubjectRaised("prefill(8)", ValueError("x"), op_index=0), 2, "reorder_cache")
    at = _raised_cause(ctx, SubjectRaised("reorder", AttributeError("x"), op_index=2), 2, "reorder_cache")
    after = _raised_cause(ctx, SubjectRaised("decode 1", ValueError("x"), op_index=3), 2, "reorder_cache")
    assert before.startswith("the cache fails before reorder_cache() is called, at prefill(8)"), before
    assert at == "the cache (or one of its layers) has no working reorder_cache()", at
    assert after.startswith("after reorder_cache() the next forward fails"), after


def test_encoder_depth_cache_passes_where_the_depths_agree():
    """The cache that sizes itself from the encoder's depth is right on t5 (encoder 3 ≥ decoder 2) and on a
    decoder-only model: the bart failure is its layer count, not its design."""
    for model in ("t5", "llama"):
        [result] = _run("kvconform.testing.faulty_causes:EncoderDepthCache", model, "check_prefill_then_decode",
                        "decode_implicit_positions")
        assert result.outcome == "passed", (model, result.message)


def test_measured_cause_kinds():
    """``measured_cause`` from raw facts: a missing layer, a key length, a mask size, batch sizes; nothing from
    nothing."""
    from kvconform.checks._diagnosis import measured_cause
    from kvconform.checks._drive import SubjectRaised

    base = {"held": 9, "batch": 4, "trail": [], "update_calls": [], "mask_sizes": {}, "cache_layers": 2,
            "grows_layers": False, "decoder_depth": 2, "layer_max": [-1, -1], "kv_mismatch": None,
            "batch_sizes": {}}

    def cause(exc, **facts):
        return measured_cause(SubjectRaised("decode 1", exc, facts={**base, **facts}))

    assert cause(IndexError("list index out of range")) is None
    layers = cause(IndexError("list index out of range"), cache_layers=2, decoder_depth=3,
                   update_calls=[(0, 1, 9), (1, 1, 9), (2, 1, None)])
    assert layers.startswith("the cache has 2 layers, but the model's decoder has 3 (update(layer_idx=2) found no "
                             "layer 2)"), layers
    short = cause(RuntimeError("The size of tensor a (8) must match the size of tensor b (9)"),
                  kv_mismatch="update(layer_idx=0) returned keys of length 8 for a cache that should hold 9 tokens")
    assert short.startswith("update(layer_idx=0) returned keys of length 8 for a cache that should hold 9"), short
    mask = cause(IndexError("index 10 is out of bounds"), mask_sizes={0: (10, 0)})
    assert mask.startswith("get_mask_sizes(layer 0) sized the attention mask for 10 keys (offset 0) for a cache "
                           "that should hold 9 tokens"), mask
    rows = cause(RuntimeError("shape mismatch"), trail=["prefill(6)", "repeat(2)"],
                 batch_sizes={"layers[0].keys": 4, "layers[1].keys": 2})
    assert rows.startswith("the cache holds tensors of batch sizes 2, 4 (layers[1].keys: 2, layers[0].keys: 4) "
                           "for a batch of 4 rows: repeat(2) did not resize"), rows
    # a paged pool's first dimension counts pages: with keys/values of the batch's rows it is no batch mismatch
    assert cause(RuntimeError("shape mismatch"), batch_sizes={"layers[0].k_pool": 8, "layers[1].k_pool": 6},
                 public_batch={"layer 0.keys": 4, "layer 1.keys": 4}) is None
    keys = cause(AttributeError("'NoneType' object has no attribute 'shape'"), keys_missing=["cross 0", "cross 1"],
                 batch_sizes={"layers[0].k_pool": 8})
    assert keys.startswith("cross 0 (and 1 more) holds tokens (get_seq_length() > 0) but answers None for "
                           "layer.keys: transformers reads layer.keys"), keys
    # the same mismatch of sizes without a size error is not explained by the lengths
    assert cause(ValueError("unrelated"), kv_mismatch="update(...) returned keys of length 8") is None


def test_nan_equals_nan_when_checking_an_original():
    """A slot that held NaN before a fork and still does is unchanged; a slot that became NaN is named so."""
    from kvconform.checks.crop import changed, same_tensor

    a = torch.tensor([[1.0, float("nan")]])
    assert same_tensor(a, a.clone())
    assert not torch.equal(a, a.clone())  # what the comparison used to be
    assert changed({"k": a}, {"k": a.clone()}) == []
    assert changed({"k": torch.tensor([1.0, 2.0])}, {"k": torch.tensor([1.0, float("nan")])}) == ["k (now non-finite)"]
    assert changed({"k": torch.tensor([1, 2])}, {"k": torch.tensor([1, 3])}) == ["k"]


def test_a_fixed_size_cache_of_another_design_passes_the_static_buffer_checks():
    """The two faults check_static_addresses now measures (update() returning copies, buffers beyond
    max_cache_len) are not flagged on a correct fixed-size cache that writes by slice assignment at a Python offset."""
    results = _run("kvconform.testing.faulty_static:SliceWriteStaticCache", "llama", "check_static_addresses",
                   "static_addresses")
    assert [r.outcome for r in results] == ["passed"], [r.message for r in results]


def test_a_cache_that_drops_its_pages_with_it_passes_the_released_memory_check():
    """check_memory_released (live tensors after the cache is dropped) passes kvconform's PagedCache, a cache of
    another design than the pooled faulty one, which allocates pages and lets them go with the cache."""
    results = _run("kvconform.testing.paged:PagedCache", "llama", "check_memory_released", "memory_released")
    assert [r.outcome for r in results] == ["passed"], [r.message for r in results]
    assert results[0].metrics["kept_bytes"] == 0


def test_a_paged_cache_forks_past_the_window_with_its_count():
    """prefix_fork_past_window (implicit positions after the window filled) passes a correct cache of another design
    than the faulty RecountOnCopyCache: kvconform's PagedCache, whose copy keeps the tokens it has seen."""
    results = _run("kvconform.testing.paged:PagedCache", "mistral", "check_prefix_fork", "prefix_fork_past_window")
    assert [r.outcome for r in results] == ["passed"], [r.message for r in results]


def test_fuzz_program_failing_at_its_first_op_is_not_called_an_interaction():
    """A cache that rounds what it stores fails every program at its prefill: the fuzz line says so (the first op on
    its own), not "an interaction between these ops"."""
    [result] = _run("kvconform.testing.faulty_causes:HalfStoreCache", "llama", "check_op_sequences", "fuzz_quick")
    assert result.outcome == "failed", result.message
    line = _cause_line(result.message)
    assert "fails at its first op, prefill(" in line and "no interaction" in line, line
    assert "an interaction between these ops" not in line, line


def old_signature_cache(config=None):
    """A cache written against an older transformers: ``update(..., cache_kwargs=None)`` only, so 5.24's
    ``update(k, v, layer_idx, kwargs=...)`` raises TypeError before the cache made any layer (turboquant 0.2.0)."""
    from transformers import DynamicCache

    class OldSignatureCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
            return super().update(key_states, value_states, layer_idx, cache_kwargs)

    return OldSignatureCache()


def test_a_signature_typeerror_is_not_blamed_on_the_layer_count():
    import inspect

    import transformers

    if "kwargs=kwargs" not in inspect.getsource(transformers.models.llama.modeling_llama.LlamaAttention.forward):
        import pytest

        pytest.skip("this transformers passes the cache kwargs positionally: the old signature fits")
    [r] = _run(old_signature_cache, "llama", "check_prefill_then_decode", "decode_explicit_positions")
    assert r.outcome == "failed" and "unexpected keyword argument 'kwargs'" in r.message, r.message
    cause = next(line for line in r.message.splitlines() if "likely cause:" in line)
    assert "layers, but the model's decoder has" not in cause, cause
