"""Usage mistakes a new cache author made, each answered with the fix (exit 4 through ``SpecError``): a misspelled
class name or budget key gets the closest known name, a budget that is not a dict lists the keys of its kind only,
and a cache *layer* passed as the subject is told to pass the Cache that holds it."""

from __future__ import annotations

import pytest
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvconform.api import check_cache
from kvconform.subjects import SpecError
from kvconform.subjects.resolve import resolve_cache_spec

CACHE_FILE = """
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class MyInt8Cache(DynamicCache):
    pass


class MyInt8Layer(DynamicLayer):
    pass
"""


@pytest.fixture
def cache_file(tmp_path):
    path = tmp_path / "mycache.py"
    path.write_text(CACHE_FILE)
    return path


def test_a_misspelled_class_name_gets_the_closest_one(cache_file):
    with pytest.raises(SpecError, match=r"has no attribute 'MyInt8Cach' \(did you mean 'MyInt8Cache'\?\)"):
        resolve_cache_spec(f"{cache_file}:MyInt8Cach")


def test_a_cache_layer_passed_as_the_subject_is_told_to_pass_its_cache(cache_file):
    with pytest.raises(SpecError, match=r"MyInt8Layer is a cache layer \(CacheLayerMixin\); pass the Cache subclass"):
        resolve_cache_spec(f"{cache_file}:MyInt8Layer")


def _declaring(kind: str, budget):
    return type("Declared", (DynamicCache,), {f"kvconform_{kind}": budget})


def test_a_misspelled_budget_key_gets_the_closest_one_and_the_keys_of_its_kind():
    with pytest.raises(SpecError) as err:
        check_cache(_declaring("lossy", {"kl": 1e-3, "top1_min": 0.95}), models=["llama"],
                    checks=["check_prefill_then_decode"])
    assert "unknown budget keys 'kl' (did you mean 'kl_max'?)" in str(err.value)
    assert "known: bytes_ratio_max, kl_max, saves_memory, top1_min" in str(err.value)
    assert "tokens_max" not in str(err.value) and "keep_ratio" not in str(err.value)


@pytest.mark.parametrize(("kind", "listed"), [
    ("lossy", "kl_max, top1_min, bytes_ratio_max, saves_memory, e.g."),
    ("evicting", "kl_max, top1_min, bytes_ratio_max, tokens_max, keep_ratio, tokens_exact, e.g.")])
def test_a_budget_that_is_not_a_dict_lists_the_keys_of_its_kind(kind, listed):
    with pytest.raises(SpecError, match="the budget must be a dict with keys " + listed):
        check_cache(_declaring(kind, 1e-3), models=["llama"], checks=["check_prefill_then_decode"])


def test_the_not_a_cache_hint_does_not_fire_for_other_classes():
    """A cache layer is told to pass the Cache that holds it; any other class that is not a cache is told to subclass
    one or to name a factory."""
    from kvconform.subjects.resolve import _not_a_cache_hint

    assert _not_a_cache_hint(DynamicLayer).startswith(": DynamicLayer is a cache layer")
    other = _not_a_cache_hint(dict)
    assert "cache layer" not in other and other.startswith("; make dict subclass transformers.Cache"), other
    assert "def my_cache(config)" in other

    class KnormPress:  # kvpress's shape: compress() and a call on the model
        def compress(self, module, hidden_states, keys, values, attentions, kwargs):
            return keys, values

    press = _not_a_cache_hint(KnormPress)
    assert press.startswith(": KnormPress looks like a press") and "KnormPress(...)(model)" in press, press


def _raises_in_init():
    from transformers import DynamicCache

    class RaisesInInit(DynamicCache):
        """A cache whose constructor always raises (no pool configured): every family reports the constructor."""

        def __init__(self, config=None, **kwargs):
            raise RuntimeError("no GPU pool configured")

    return RaisesInInit


def test_a_constructor_that_always_raises_is_reported_as_such_by_the_compile_family_too():
    """The compile family builds its caches inside its ops and used to report the raise as the subject's at "eager
    decode", its traceback ending in kvconform's ``build_one`` (from the newcomer try-out); every item now names the
    constructor and the user's line."""
    from kvconform.api import check_cache

    results = check_cache(_raises_in_init(), models=["llama"], checks=["check_compile_static_decode"])
    ran = [r for r in results if r.outcome != "skipped"]
    assert ran, results
    for r in ran:
        assert r.outcome == "failed", r
        assert "building the subject raised RuntimeError: no GPU pool configured (at test_usage_hints.py:" in r.message
        assert "spec.py" not in r.message and r.metrics["failed_at"] == "construction", r.message
