"""Model-aware subjects: factories that take the model, and factories returning ``(cache, context)`` whose context
kvconform enters around every call (presses that hook the model). The caches are in model_aware_caches.py, written
the way their authors would; all are exact, so the exact families judge them."""

import sys
from pathlib import Path

import pytest
import torch  # noqa: F401 - before the zoo
from transformers import DynamicCache

from kvconform import check_cache
from kvconform.subjects import (CacheSpec, SpecError, accepted_kwargs, call_context, names_model,
                                required_unknown_arguments)

sys.path.insert(0, str(Path(__file__).parents[1]))
import model_aware_caches as mac  # noqa: E402


def _hooks_left(model):
    """Every forward (pre-)hook and instance-level ``forward`` on ``model``'s modules."""
    return [(name, attr) for name, m in model.named_modules()
            for attr in ("_forward_hooks", "_forward_pre_hooks") if getattr(m, attr)] + \
        [(name, "forward") for name, m in model.named_modules() if "forward" in vars(m)]


def _by_subject(results):
    out = {}
    for r in results:
        out.setdefault(r.subject, []).append(r)
    return out


def test_model_is_passed_only_to_factories_that_name_it():
    available = dict(config="c", max_cache_len=8, batch_size=1, device="cpu", dtype=None, model="M")

    class TakesModel(DynamicCache):
        def __init__(self, model, **kwargs):
            super().__init__(**kwargs)

    class ForwardsKwargs(DynamicCache):
        def __init__(self, bits=4, **kwargs):
            super().__init__(**kwargs)

    assert accepted_kwargs(mac.for_model, available) == {"model": "M"}
    assert accepted_kwargs(mac.checked_pressed, available) == {"config": "c", "model": "M"}
    assert accepted_kwargs(TakesModel, available) == {"model": "M", "config": "c"}
    # a **kwargs forwarder gets everything else, never the model (DynamicCache would be handed it)
    assert "model" not in accepted_kwargs(mac.forwards_kwargs, available)
    assert "max_cache_len" in accepted_kwargs(mac.forwards_kwargs, available)
    assert "model" not in accepted_kwargs(ForwardsKwargs, available)
    assert not names_model(lambda **kw: None) and names_model(mac.ForModelCache.for_model)
    assert required_unknown_arguments(mac.for_model) == []  # 'model' is something kvconform passes


CHECKS = ["check_prefill_then_decode", "check_chunked_continuation", "check_generate_greedy", "check_prefix_fork",
          "check_prefix_generate"]
CASES = ["decode_explicit_positions", "decode_implicit_positions", "chunk2", "greedy", "prefix_fork_steps",
         "prefix_generate_full_prompt", "prefix_generate_suffix_only"]  # each runs on every supported transformers


def test_for_model_and_press_subjects_conform_with_the_press_entered_around_every_forward():
    results = check_cache([mac.for_model, mac.checked_pressed, mac.forwards_kwargs], models=["llama"],
                          checks=CHECKS, cases=CASES)
    by = _by_subject(results)
    assert set(by) == {"for_model", "checked_pressed", "forwards_kwargs"}
    for name, rows in by.items():
        assert {r.check for r in rows} == set(CHECKS), name
        assert all(r.outcome == "passed" for r in rows), [(r.id, r.message) for r in rows if r.outcome != "passed"]
    press = mac.CHECKED_PRESS
    # PressedCache raises on an update outside the press: every forward and generate ran inside it (forks too)
    assert press.entered == press.exited > len(by["checked_pressed"])
    assert press.compressed > 0 and press.calls > press.compressed
    assert mac.MODELS and all(not _hooks_left(m) for m in mac.MODELS)  # unhooked after every call


def test_contexts_that_leave_the_model_changed_fail_and_the_model_is_restored():
    def plain(config):
        return DynamicCache(config=config)

    results = check_cache([mac.leaky_pressed, mac.patching_pressed, plain], models=["llama"],
                          checks=["check_prefill_then_decode"], cases=["decode_explicit_positions"])
    by = _by_subject(results)
    leaky, = by["leaky_pressed"]
    assert leaky.outcome == "failed"
    assert ("ModelLeftChanged: leaky_pressed's context (_GeneratorContextManager) left the model changed after "
            "__exit__: 1 forward hook on model.layers.0.self_attn") in leaky.message
    assert "likely cause: the context manager the factory returned does not undo on __exit__" in leaky.message
    patching, = by["patching_pressed"]
    assert patching.outcome == "failed"
    assert "model.layers.0.self_attn.forward set on the instance" in patching.message
    # the next subject runs the same model object: had LeakyPress's hooks stayed, they would raise in its forwards
    # ("called outside its context"); had PatchingPress's forward stayed, nothing would show — so both are checked
    assert [r.outcome for r in by["plain"]] == ["passed"]
    assert mac.LEAKY.entered == mac.LEAKY.exited == 1  # the first forward failed the item


def test_the_context_is_exited_when_the_subject_raises():
    results = check_cache([mac.raising_pressed], models=["llama"], checks=["check_prefill_then_decode"],
                          cases=["decode_explicit_positions"])
    (result,) = results
    assert result.outcome == "failed" and "RuntimeError: boom in update" in result.message
    assert "[raised at decode 1]" in result.message
    assert mac.RAISING_PRESS.entered == mac.RAISING_PRESS.exited == 2


def test_a_factory_returning_something_else_is_one_clear_error():
    expected = (r"returns_triple returned a tuple of 3 \(DynamicCache, NoneType, NoneType\); a factory returns a "
                r"transformers.Cache, or a pair \(cache, context manager\)")
    with pytest.raises(SpecError, match=expected):
        check_cache([mac.returns_triple], models=["llama"], checks=["check_prefill_then_decode"])
    # a factory naming `model` is built on a weightless (meta) model before the run: same usage error
    with pytest.raises(SpecError, match=r"returns_press_not_context returned a tuple of 2 \(DynamicCache, "
                                        r"IdentityPress\); its second item, a IdentityPress, is not a context manager"):
        check_cache([mac.returns_press_not_context], models=["llama"], checks=["check_prefill_then_decode"])
    # one that computes with the weights is only built by its items: each fails, naming what it returned
    results = check_cache([mac.returns_cache_class], models=["llama"], checks=["check_prefill_then_decode"],
                          cases=["decode_explicit_positions"])
    (result,) = results
    assert result.outcome == "failed"
    assert ("building the subject failed: returns_cache_class returned the class "
            "transformers.cache_utils.DynamicCache (not an instance: call it); a factory returns") in result.message
    assert "called: returns_cache_class(config=..., model=...) for llama" in result.message


def test_encoder_decoder_uses_the_self_attention_context():
    from kvconform import zoo

    t5 = zoo.build_zoo_model("t5")
    mac.ENC_DEC_CONTEXTS.clear()
    cache = CacheSpec("counted", mac.counted).build(t5, max_cache_len=16, batch_size=1, encoder_len=5)
    self_context, cross_context = mac.ENC_DEC_CONTEXTS
    assert call_context(cache).context is self_context and call_context(cache.cross_attention_cache) is not None
    mac.ENC_DEC_CONTEXTS.clear()
    results = check_cache([mac.counted], models=["t5"], checks=["check_prefill_then_decode"],
                          cases=["decode_implicit_positions"])
    assert [r.outcome for r in results] == ["passed"], [r.message for r in results]
    selves, crosses = mac.ENC_DEC_CONTEXTS[0::2], mac.ENC_DEC_CONTEXTS[1::2]
    assert sum(c.entered for c in selves) > 0 and all(c.entered == c.exited for c in selves)
    assert all(c.entered == 0 for c in crosses)  # one context per call, never two on one model


def test_compile_and_speed_families_run_the_model_under_the_context(run_kvconform, pytester):
    """They call the model themselves (eager prefill, compiled decode, timed steps): the context is entered there
    too, or SwitchedStaticCache raises."""
    pytester.makepyfile(model_aware_caches=(Path(__file__).parents[1] / "model_aware_caches.py").read_text())
    result = run_kvconform("--kvconform-cache", "model_aware_caches.py:switched_static", "--kvconform-subject",
                           "switched_static", "--kvconform-model", "llama", "-k",
                           "compile_decode or static_addresses or speed_flat_decode")
    result.assert_outcomes(passed=3)


def test_class_patches_and_global_hooks_left_by_a_context_are_named_and_undone():
    """What patchers do besides module hooks: replace the attention class's forward, register a global module hook."""
    import contextlib

    from kvconform import zoo
    from kvconform.checks._drive import forward
    from kvconform.subjects import ModelLeftChanged

    llama = zoo.build_zoo_model("llama")
    attention = type(mac.attention_modules(llama.model)[0])
    original = attention.__dict__["forward"]
    calls = []

    @contextlib.contextmanager
    def patch_model(model):
        def patched(self, *args, **kwargs):
            calls.append(1)
            return original(self, *args, **kwargs)

        attention.forward = patched  # never put back
        torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: None)  # never removed
        yield

    def patcher(config, model):
        return DynamicCache(config=config), patch_model(model)

    cache = CacheSpec("patcher", patcher).build(llama, max_cache_len=16, batch_size=1)
    tokens = torch.full((1, 3), 5)
    with pytest.raises(ModelLeftChanged, match=r"patcher's context \(_GeneratorContextManager\) left the model "
                                               r"changed after __exit__: .*LlamaAttention.forward replaced on the "
                                               r"class.*global forward hook"):
        forward(llama, cache, tokens, 0, "explicit")
    assert calls, "the patch was active during the forward"
    assert attention.__dict__["forward"] is original
    assert not torch.nn.modules.module._global_forward_hooks
