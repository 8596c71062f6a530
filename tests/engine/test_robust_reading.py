"""kvconform's own code never raises on a subject's shape (issue 35, deliverable 1).

Caches whose ``layers`` is a dict, tuple, generator, None, an int or a property that raises, whose layers are no
``CacheLayerMixin`` s (``__slots__`` objects, proxies whose properties raise) and carry tensors on the meta device,
12-deep nests, non-tensor values, cycles and raising properties (``tests/odd_caches.py``), drawn by hypothesis:

* every reader of kvconform's evidence and byte counting answers them without raising (cheap, no model);
* every item of a few checks on llama ends in kvconform's short message (a verdict: never a traceback, never a
  "kvconform internal error"), the exact ones pass where their layers can be read, a planted fault is caught, and
  every item of the run gets its result (the session goes on).
"""

import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parents[1]))

from odd_caches import EXTRAS, FORMS, LAYER_KINDS, odd_cache  # noqa: E402

from kvconform.checks import _evidence, _measure  # noqa: E402
from kvconform.zoo import load_model  # noqa: E402

shapes = st.tuples(st.sampled_from(FORMS), st.sampled_from(LAYER_KINDS),
                   st.lists(st.sampled_from(EXTRAS), unique=True, max_size=len(EXTRAS)).map(tuple))


@pytest.fixture(scope="module")
def llama_config():
    return load_model("llama").config


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=shapes)
def test_readers_never_raise_on_a_cache_shape(llama_config, shape):
    form, kind, extras = shape
    cache = odd_cache(form, kind, extras)(llama_config)
    for layer_idx in range(2):  # two layers fed as the model would: [B, H, T, D]
        cache.update(torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16), layer_idx)
    readable = form in ("list", "tuple", "dict", "generator")
    items = _measure.layer_items(cache)
    assert len(items) == (2 if readable else 0), (form, items)
    assert [i for i, _ in items] == ([0, 1] if readable else [])
    tensors = _measure.tensors_of(cache)
    if readable and kind != "raising":  # a proxy's keys are properties over a private layer: not held attributes
        assert {"layers[0].keys", "layers[1].values"} <= set(tensors), sorted(tensors)
    assert _evidence.nonfinite_in(cache) is None
    labels = [label for label, _ in _measure.cache_layers(cache)]
    assert labels == (["layer 0", "layer 1"] if readable else ["cache"])
    assert _measure.held_bytes(cache) >= 2 * 2 * (2 * 2 * 5 * 16 * 4)  # at least the keys and values fed
    sizes, missing = _evidence.public_kv_facts(cache)  # what layer.keys answers, read as transformers reads it
    # an unreadable cache has no layer.keys to ask: no "answers None for layer.keys" claim either way
    assert (sizes.get("layer 0.keys") == 2) == readable and missing == []
    _evidence.layer_max_lengths(cache)
    _evidence.shared_layers(cache)
    _evidence.unmasked_slots(cache, 5, 1)
    _measure.largest_holdings(cache)
    _measure.narrow_stored(cache, torch.float32)
    [_measure.quant_params(layer) for _, layer in items]
    assert (_measure.layers_problem(cache) is None) == readable


def test_layers_problem_names_the_shape(llama_config):
    def problem(form):
        cache = odd_cache(form, "transformers")(llama_config)
        cache.update(torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16), 0)
        return _measure.layers_problem(cache)

    assert problem("raises") == "cache.layers raised RuntimeError: OddCache.layers is not readable from outside"
    assert problem("none") == "cache.layers is None"
    assert problem("int") == "cache.layers is an int, not a list of layer objects"
    assert problem("dict") is None and problem("generator") is None


def test_a_stored_iterator_is_not_consumed():
    """An iterator the cache holds as its ``layers`` would be used up by reading it: kvconform leaves it alone."""
    from transformers import DynamicCache

    cache = DynamicCache()
    cache.update(torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16), 0)
    real = cache.layers
    cache.layers = iter(real)
    assert _measure.layer_items(cache) == []
    assert _measure.layers_problem(cache) == ("cache.layers is a list_iterator the cache holds (reading it would "
                                            "consume it)")
    assert len(list(cache.layers)) == 1  # still whole


CHECKS = ["check_prefill_then_decode", "check_api_contract", "check_memory_bytes"]
CASES = ["decode_explicit_positions", "api_surface", "memory_decode"]


@settings(max_examples=4, deadline=None, derandomize=True)
@given(shape=shapes, fault=st.sampled_from([None, "stale_value"]))
@example(shape=("dict", "slots", EXTRAS), fault=None)  # adaptivekv's shape, and every odd attribute
@example(shape=("raises", "raising", ("meta_tensor",)), fault="stale_value")
@example(shape=("generator", "transformers", ("deep_nesting", "cycle")), fault=None)
def test_every_item_ends_in_kvconforms_message(shape, fault):
    from kvconform import check_cache

    form, kind, extras = shape
    factory = odd_cache(form, kind, extras, fault)
    results = {r.check: r for r in check_cache(factory, models=["llama"], checks=CHECKS, cases=CASES)}
    assert sorted(results) == sorted(CHECKS), "every item gets its result: the session goes on"
    for check, r in results.items():
        assert r.outcome in ("passed", "failed", "skipped", "xfailed"), (check, r.outcome, r.message)
        assert "Traceback" not in r.message and "kvconform internal error" not in r.message, r.message
        if r.outcome == "failed":
            assert r.message.startswith(f"{check} failed: {factory.__name__} on llama"), r.message
            assert "\n  reproduce: pytest --kvconform" in r.message, r.message
    logits = results["check_prefill_then_decode"]
    if fault:
        assert logits.outcome == "failed" and "max|Δlogit|" in logits.message, logits.message
    else:  # the cache runs the model exactly, whatever kvconform can read of it
        assert logits.outcome == "passed", logits.message
    memory = results["check_memory_bytes"]
    if form in ("list", "tuple", "dict", "generator") and not fault:
        assert memory.outcome == "passed", memory.message  # its layers read and counted like DynamicCache's
    elif form in ("none", "raises", "int"):
        assert memory.outcome == "failed" and "no layer to compare: cache.layers" in memory.message, memory.message
