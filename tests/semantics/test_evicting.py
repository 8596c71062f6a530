"""Evicting subjects: the bundled SinkWindowCache conforms, its faulty variants are caught with their cause lines,
the declaration works from a class attribute and from CacheSpec, and exact-family cases longer than tokens_max are
skipped with their reason (the evicting contract in kvconform.checks.contract, session.evicting_skip_reason)."""

import json
import textwrap

import pytest

from kvconform.testing.evicting import SinkWindowCache

SINK = "kvconform.testing.evicting:SinkWindowCache"


def _records(pytester, name="r.json"):
    return json.loads((pytester.path / name).read_text())["results"]


def test_sink_window_cache_conforms_on_three_models(run_kvconform, pytester):
    result = run_kvconform("--kvconform-cache", SINK, "--kvconform-subject", "SinkWindowCache",
                           "--kvconform-model", "llama", "--kvconform-model", "gemma3",
                           "--kvconform-model", "falcon_h1",
                           "-m", "kvconform and not kvconform_speed", "--kvconform-json", "r.json")
    assert result.ret == 0, result.stdout.str()[-3000:]
    records = _records(pytester)
    outcomes = {r["outcome"] for r in records}
    assert outcomes <= {"passed", "skipped", "xfailed"}, outcomes
    evicting = [r for r in records if r["check"].startswith("check_evicting_")]
    assert len(evicting) == 16 and all(r["outcome"] == "passed" for r in evicting), evicting
    held = [r for r in evicting if r["check"] == "check_evicting_held_exact"]  # llama only (case scope)
    assert [r["model"] for r in held] == ["llama"] and held[0]["metrics"]["max_abs"] < 1e-12, held
    bounds = [r for r in evicting if r["check"] == "check_evicting_bounds"]
    assert all(r["metrics"]["most_held"] == 64 and r["metrics"]["tokens_fed"] == 69 + 3 + 67 + 2 for r in bounds)
    # the exact families ran too (every default case holds fewer than 64 tokens): judged against the oracle
    assert sum(r["outcome"] == "passed" and r["family"] == "logits" for r in records) >= 15


FAULTY = {  # attr: (the checks that fail it, the cause line of the first)
    "HeldLengthSinkCache": (("check_evicting_bounds", "check_evicting_held_exact"),
                            "get_seq_length() reports the tokens held (64), not the tokens seen"),
    "NeverEvictsSinkCache": (("check_evicting_bounds",), "but tokens_max is 64"),
    "EvictsOwnChunkCache": (("check_evicting_bounds", "check_evicting_held_exact"),
                            "the cache evicts inside the forward that brings the tokens"),
    "CropsEvictedSinkCache": (("check_evicting_crop",), "accepts a crop back past tokens it has already evicted"),
    "ReorderWindowOnlySinkCache": (("check_evicting_ops",), "reorder_cache() does not move every held tensor"),
    "SinkShiftSinkCache": (("check_evicting_held_exact",), "keys re-rotated by a wrong shift"),
}


def test_faulty_evicting_caches_fail_with_their_cause(run_kvconform, pytester):
    args = []
    for attr in FAULTY:
        args += ["--kvconform-cache", f"kvconform.testing.faulty_evicting:{attr}", "--kvconform-subject", attr]
    result = run_kvconform(*args, "--kvconform-model", "llama", "-k", "evicting", "--kvconform-json", "r.json")
    assert result.ret == 1
    records = _records(pytester)
    for attr, (checks, cause) in FAULTY.items():
        failed = {r["check"]: r for r in records if r["subject"] == attr and r["outcome"] == "failed"}
        assert sorted(failed) == sorted(checks), (attr, [(r["check"], r["outcome"]) for r in records
                                                         if r["subject"] == attr])
        message = failed[checks[0]]["message"]
        assert "likely cause: " in message and cause in message, message


def test_cache_spec_declaration_and_a_different_design(run_kvconform, pytester):
    """transformers' own DynamicCache on mistral (every layer a sliding window of 8: it keeps 7 tokens) declared
    evicting through CacheSpec passes the evicting contract; exact cases longer than its tokens_max are skipped."""
    pytester.makeconftest(textwrap.dedent("""
        import kvconform

        def window_cache(config):
            from transformers import DynamicCache
            return DynamicCache(config=config)

        def pytest_kvconform_caches(config):
            return [kvconform.CacheSpec(name="SlidingDynamic", factory=window_cache, kind="evicting",
                                        budget={"kl_max": 1.0, "top1_min": 0.0, "tokens_max": 8})]
    """))
    result = run_kvconform("--kvconform-model", "mistral", "--kvconform-subject", "SlidingDynamic", "--kvconform-full",
                           "-k", "evicting or prefill_then_decode", "-rs", "--kvconform-json", "r.json")
    assert result.ret == 0, result.stdout.str()[-3000:]
    records = _records(pytester)
    evicting = [r for r in records if r["check"].startswith("check_evicting_")]
    assert len(evicting) == 7 and all(r["outcome"] == "passed" for r in evicting), evicting
    crop = next(r for r in evicting if r["check"] == "check_evicting_crop")
    assert crop["metrics"]["crop_refused"] is True  # DynamicSlidingWindowLayer refuses clearly; nothing changed
    skipped = [r for r in records if r["check"] == "check_prefill_then_decode"]
    assert skipped and all(r["outcome"] == "skipped" for r in skipped)
    result.stdout.fnmatch_lines(["*SlidingDynamic evicts past 8 tokens and case decode_* makes it hold up to 2*: "
                                 "judged by quality and the memory bound, not against the exact oracle*"])


def test_declaration_from_the_class_attribute():
    from kvconform.subjects import resolve_cache_spec

    spec = resolve_cache_spec(SINK)
    assert spec.kind == "evicting" and spec.budget.tokens_max == 64
    assert spec.budget.kl_max > 0 and 0 <= spec.budget.top1_min <= 1


@pytest.mark.parametrize("how", ["cache_spec", "class_attribute"])
def test_missing_tokens_max_is_a_usage_error(how, run_kvconform, pytester):
    if how == "cache_spec":
        pytester.makeconftest(textwrap.dedent("""
            import kvconform
            from kvconform.testing.evicting import SinkWindowCache

            def pytest_kvconform_caches(config):
                return [kvconform.CacheSpec(name="NoBound", factory=SinkWindowCache, kind="evicting",
                                            budget={"kl_max": 0.3, "top1_min": 0.2})]
        """))
        args = ()
    else:
        pytester.makepyfile(nobound=textwrap.dedent("""
            from kvconform.testing.evicting import SinkWindowCache

            class NoBound(SinkWindowCache):
                kvconform_evicting = {"kl_max": 0.3, "top1_min": 0.2}
        """))
        args = ("--kvconform-cache", "nobound.py:NoBound")
    result = run_kvconform(*args, "--kvconform-model", "llama")
    assert result.ret == 4
    result.stderr.fnmatch_lines(["*NoBound*an evicting subject's budget needs tokens_max*"])


def test_exact_cases_longer_than_tokens_max_are_skipped(tmp_path):
    from kvconform.session import build_session

    (tmp_path / "long.toml").write_text(textwrap.dedent("""
        [[case]]
        id = "long_decode"
        check = "check_prefill_then_decode"
        ops = ["prefill 60", "decode 5"]

        [[case]]
        id = "cropped_back"
        check = "check_prefill_then_decode"
        ops = ["prefill 60", "crop 10", "decode 14"]

        [[case]]
        id = "after_reset"
        check = "check_prefill_then_decode"
        ops = ["prefill 40", "reset", "prefill 30", "decode 2"]
    """))
    session = build_session(caches=[SINK], models=["llama"], builtin=False, case_paths=[str(tmp_path)],
                            case_ids=["long_decode", "cropped_back", "after_reset"])
    skips = {i.case.id: i.skip for i in session.items()}
    assert skips["long_decode"] == ("SinkWindowCache evicts past 64 tokens and case long_decode makes it hold up to "
                                    "65: judged by quality and the memory bound, not against the exact oracle")
    assert skips["cropped_back"] is None  # 60 → 50 → 64: never more than 64
    assert skips["after_reset"] is None  # 40, then a new sequence of 32


def test_sink_window_layer_contract_in_process():
    import torch

    from kvconform import compat
    from kvconform.testing.evicting import SinkWindowCache
    from kvconform.zoo import build_zoo_model

    zm = build_zoo_model("llama", dtype=torch.float32)
    cache = SinkWindowCache(config=zm.config, sinks=2, window=6)
    ids = torch.randint(3, zm.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        zm.model(input_ids=ids, **{compat.cache_kwarg(zm.model): cache}, use_cache=True)
    layer = cache.layers[0]
    assert cache.get_seq_length() == 12 and layer.held == 8
    assert layer.get_mask_sizes(1) == (9, 4)  # 8 held + 1 new, the first at position 12 - 8
    assert not cache.is_croppable
    with pytest.raises(ValueError, match="it can remove at most 0 tokens"):
        cache.crop(-2)
    assert cache.get_seq_length() == 12 and layer.held == 8  # refused: nothing changed
    cache.reset()
    cache.activate_past_recording()
    with torch.no_grad():
        zm.model(input_ids=ids, **{compat.cache_kwarg(zm.model): cache}, use_cache=True)
        zm.model(input_ids=ids[:, :3], **{compat.cache_kwarg(zm.model): cache}, use_cache=True)
    assert layer.held == 15 and layer.get_mask_sizes(1) == (9, 7)  # recording holds all, attends sinks + window
    cache.crop(-3)
    assert cache.get_seq_length() == 12 and layer.held == 12 and cache.is_croppable


# ------------------------------------------------------------------------- exact past the bound (kvconform_held)
class SilentSinkCache(SinkWindowCache):
    """A correct sink cache that does not say what it holds."""

    kvconform_held = None


class UnevenSinkCache(SinkWindowCache):
    """Layer 1 keeps a shorter window than layer 0: its layers hold different tokens."""

    def __init__(self, config=None, **kwargs):
        super().__init__(config, **kwargs)
        self.layers[1].window = 30


def _held_exact(cache, model="llama"):
    from kvconform import check_cache

    return check_cache([cache], models=[model], checks=["check_evicting_held_exact"])


@pytest.mark.parametrize("attr", ["evicting:SinkWindowCache", "evicting:RerotatingSinkCache",
                                  "share_evicting:ShareEvictingCache"])
def test_correct_evicting_caches_equal_the_held_token_oracle_past_their_bound(attr):
    """Three designs — sinks at their own positions, sinks re-rotated before the window (StreamingLLM), a share kept
    at every step — each equal, at every step past the bound, the uncached float64 forward attending exactly what
    they declare; the re-rotating one within transformers' float32 rotary angles."""
    results = _held_exact(f"kvconform.testing.{attr}")
    ran = [r for r in results if r.outcome != "skipped"]
    assert [r.outcome for r in ran] == ["passed"], [(r.id, r.outcome, r.message[:500]) for r in results]
    metrics = ran[0].metrics
    assert metrics["steps_compared"] == 10 and metrics["max_abs"] < 1e-5, metrics
    assert metrics["most_held"] == (30 if "Share" in attr else 64), metrics


def test_sinks_re_rotated_without_subtracting_the_sink_count_are_caught_past_the_bound():
    results = _held_exact("kvconform.testing.faulty_evicting:SinkShiftSinkCache")
    failed = [r for r in results if r.outcome == "failed"]
    assert len(failed) == 1, [(r.id, r.outcome) for r in results]
    assert failed[0].metrics["failed_at"] == "decode 1 of 6" and failed[0].metrics["max_abs"] > 1e-2, failed[0].metrics
    assert "held: tokens [0..3, 9..68] at positions [5..68]" in failed[0].message, failed[0].message


@pytest.mark.parametrize("cache, reason", [
    (SilentSinkCache, "does not say which tokens it holds"),
    (UnevenSinkCache, "layers 0 and 1 hold different tokens"),
])
def test_a_cache_that_cannot_be_held_to_one_forward_is_skipped_saying_why(cache, reason):
    results = _held_exact(cache)
    assert [r.outcome for r in results] == ["skipped"] and reason in results[0].message, \
        [(r.id, r.outcome, r.message) for r in results]


def test_models_the_held_token_oracle_cannot_express_are_skipped_at_plan_time():
    from kvconform.checks import CHECKS, load_checks
    from kvconform.plan import model_info

    load_checks()
    rule = CHECKS["check_evicting_held_exact"].applies
    reasons = {name: rule(None, model_info(name, zoo_only=True), None)
               for name in ("llama", "gpt2", "mistral", "gemma2", "falcon_h1", "bart")}
    assert reasons["llama"] is None and reasons["gpt2"] is None, reasons
    assert "sliding_attention" in reasons["mistral"] and "sliding_attention" in reasons["gemma2"], reasons
    assert "encoder-decoder" in reasons["bart"] and reasons["falcon_h1"], reasons


def test_the_held_token_oracle_moves_a_block_of_sinks_with_its_own_history():
    """The inputs of the oracle: the sequence at its own positions, then each sink block declared elsewhere copied
    at that position, its rows restricted to the copies of its own history."""
    from kvconform.checks.contract.evicting import held_oracle_inputs

    forwards = [(0, 4, [], []), (4, 1, [0, 1, 2, 3], [0, 1, 2, 3]), (5, 1, [0, 1, 3, 4], [1, 2, 3, 4])]
    order, allowed = held_oracle_inputs(6, forwards)
    assert order[:6] == [(j, j) for j in range(6)]
    copies = {node: j for j, node in enumerate(order) if j >= 6}
    assert set(copies) == {(0, 1), (1, 2)}, order  # tokens 0 and 1 moved up by one, as a block
    row = {order[k] for k in allowed[5].nonzero().flatten().tolist()}
    assert row == {(0, 1), (1, 2), (3, 3), (4, 4), (5, 5)}, row
    assert {order[k] for k in allowed[copies[(1, 2)]].nonzero().flatten().tolist()} == {(0, 1), (1, 2)}
