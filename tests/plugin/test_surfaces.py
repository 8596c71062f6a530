"""Plug-in surfaces for cache authors and model repositories, the pytest ecosystem, and bad subjects."""

import json
import textwrap

import pytest

from kvconform.outcomes import UsageError

BAD_CACHES = textwrap.dedent("""
    import time
    import torch
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    class RaisingCache(DynamicCache):
        def __init__(self, config):
            super().__init__(config=config)
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            raise RuntimeError("boom from update")

    class NaNCache(DynamicCache):
        def __init__(self, config):
            super().__init__(config=config)
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            k, v = super().update(key_states, value_states, layer_idx, *args, **kwargs)
            return k * float("nan"), v

    class WrongShapeCache(DynamicCache):
        def __init__(self, config):
            super().__init__(config=config)
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            k, v = super().update(key_states, value_states, layer_idx, *args, **kwargs)
            return k[..., :-1], v  # head_dim one short

    class HangingCache(DynamicCache):
        def __init__(self, config):
            super().__init__(config=config)
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            if self.get_seq_length() > 0:
                while True:
                    time.sleep(0.05)
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
""")


def outcomes(path):
    """``{(subject, model, check, case): outcome}`` from a kvconform JSON report."""
    records = json.loads(path.read_text())["results"]
    return {(r["subject"], r["model"], r["check"], r["case"]): r["outcome"] for r in records}


BUILTIN = ("ReferenceCache", "DynamicCache", "StaticCache")


def test_bad_subjects_fail_their_own_items_and_the_session_goes_on(run_kvconform, pytester):
    pytester.makepyfile(badcaches=BAD_CACHES)
    args = []
    for name in ("RaisingCache", "NaNCache", "WrongShapeCache", "HangingCache"):
        args += ["--kvconform-cache", f"badcaches.py:{name}"]
    result = run_kvconform(*args, "--kvconform-model", "llama", "-k", "prefill_then_decode and decode_explicit",
                           "--kvconform-timeout", "5", "--kvconform-json", "r.json")
    assert result.ret == 1
    by_subject = {k[0]: v for k, v in outcomes(pytester.path / "r.json").items()}
    assert all(by_subject[name] == "passed" for name in BUILTIN)
    assert all(by_subject[name] == "failed" for name in ("RaisingCache", "NaNCache", "WrongShapeCache",
                                                          "HangingCache"))
    out = result.stdout.str()
    assert "the subject raised RuntimeError: boom from update" in out
    # measured on what update() returned, not on the logits: fused CPU attention kernels differ in what NaN keys
    # become (AVX-512 builds turn them into zeros, so the logits can stay finite)
    assert "update(layer_idx=0) returned NaN/inf keys[batch 0, head 0, position 0]" in out
    assert "WrongShapeCache on llama" in out and "the subject raised RuntimeError" in out
    assert "no result after 5 s (per-item timeout, --kvconform-timeout)" in out


def test_conftest_hook_adds_subjects(run_kvconform, pytester):
    pytester.makeconftest("""
        from kvconform import CacheSpec, ReferenceCache

        def pytest_kvconform_caches(config):
            return [CacheSpec("MyReference", ReferenceCache, expected_failures={}), """
                          '"kvconform.reference:ReferenceCache"]\n    ')
    result = run_kvconform("--kvconform-model", "gpt2", "-k", "decode_explicit", "--collect-only", "-q")
    assert result.ret == pytest.ExitCode.USAGE_ERROR  # the string names a subject that already exists
    assert "a built-in subject is already named 'ReferenceCache'" in result.stderr.str()
    pytester.makeconftest("""
        from kvconform import CacheSpec, ReferenceCache

        def pytest_kvconform_caches(config):
            return [CacheSpec("MyReference", ReferenceCache,
                              expected_failures={"check_generate_greedy": "not ready yet"})]
    """)
    result = run_kvconform("--kvconform-model", "gpt2", "-k",
                           "MyReference and (prefill_then_decode or generate_greedy)",
                           "-rxX")
    result.assert_outcomes(passed=3, xpassed=1)  # prefill_then_decode: explicit, implicit positions, recording
    assert "not ready yet" in result.stdout.str()


def test_parametrize_with_checks_in_users_own_tests(pytester):
    pytester.makepyfile(test_mine="""
        import kvconform
        from kvconform.testing.faulty_logits import HiddenWindowCache

        @kvconform.parametrize_with_checks([kvconform.ReferenceCache, HiddenWindowCache], models=["llama"],
                                           checks=["check_prefill_then_decode"],
                                           cases=["decode_explicit_positions", "decode_implicit_positions",
                                                  "decode_recording"])
        def test_conforms(kv_item, kv_runner):
            kv_runner(kv_item)
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q")
    # decode_recording (12 tokens) stays inside HiddenWindowCache's 16-token window: it passes there
    result.assert_outcomes(passed=4, failed=2)
    assert "check_prefill_then_decode failed: HiddenWindowCache on llama" in result.stdout.str()


def test_check_cache_for_scripts():
    import kvconform
    from kvconform.testing.faulty_logits import HiddenWindowCache

    results = kvconform.check_cache([kvconform.ReferenceCache, HiddenWindowCache], models=["llama"],
                                    checks=["check_prefill_then_decode"],  # the float32 cases, not bf16/fp16
                                    cases=["decode_explicit_positions", "decode_implicit_positions",
                                           "decode_recording"])
    by = {(r.subject, r.case): r.outcome for r in results}
    assert by == {("ReferenceCache", "decode_explicit_positions"): "passed",
                  ("ReferenceCache", "decode_implicit_positions"): "passed",
                  ("HiddenWindowCache", "decode_explicit_positions"): "failed",
                  ("HiddenWindowCache", "decode_implicit_positions"): "failed",
                  ("ReferenceCache", "decode_recording"): "passed",  # 12 tokens: inside the hidden window
                  ("HiddenWindowCache", "decode_recording"): "passed"}
    with pytest.raises(kvconform.ConformanceError, match="HiddenWindowCache on llama"):
        kvconform.check_cache(HiddenWindowCache, models=["llama"], cases=["decode_explicit_positions"],
                              raise_on_failure=True)
    with pytest.raises(UsageError, match="unknown check 'check_nothing'"):
        kvconform.check_cache(HiddenWindowCache, checks=["check_nothing"])


def test_local_checkpoint_folder(run_kvconform, pytester):
    from kvconform.zoo import build_zoo_model

    build_zoo_model("qwen2").model.save_pretrained(pytester.path / "my-qwen")
    result = run_kvconform("--kvconform-model", "my-qwen", "-k", "prefill_then_decode or generate_greedy",
                           "--kvconform-json", "r.json")
    assert result.ret == 0, result.stdout.str()
    records = json.loads((pytester.path / "r.json").read_text())["results"]
    assert {r["model"] for r in records} == {"my_qwen"} and any(r["outcome"] == "passed" for r in records)
    assert "'nowhere': not a zoo name" in run_kvconform("--kvconform-model", "nowhere").stderr.str()


def test_pytest_ecosystem_flags(run_kvconform, pytester):
    common = ("--kvconform-model", "gpt2", "-k", "prefill_then_decode or generate_greedy", "-m", "kvconform_logits")
    result = run_kvconform(*common, "--strict-markers", "--junitxml", "j.xml", "--kvconform-json", "serial.json")
    assert result.ret == 0
    serial = outcomes(pytester.path / "serial.json")
    assert {k[2] for k in serial} == {"check_prefill_then_decode"}  # -m kept the logits family only
    assert (pytester.path / "j.xml").read_text().count("<testcase") == len(serial)
    # the same selection in two xdist workers: the same items and outcomes
    result = run_kvconform(*common, "-n", "2", "--kvconform-json", "xdist.json")
    assert result.ret == 0
    assert outcomes(pytester.path / "xdist.json") == serial


def test_autoload_disabled_with_explicit_plugin(pytester, monkeypatch):
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    result = pytester.runpytest_subprocess("-p", "kvconform.plugin", "-p", "no:cacheprovider", "--kvconform",
                                           "--kvconform-model", "gpt2", "-k", "ReferenceCache and decode_explicit")
    result.assert_outcomes(passed=1)


def test_selftest_reports_share_caught(run_kvconform):
    result = run_kvconform("--kvconform-selftest", "-k", "hidden_window_16 or chunk_tail_only")
    result.assert_outcomes(passed=2)
    assert "kvconform selftest: faulty caches caught per family" in result.stdout.str()
    assert "logits       2/2 caught" in result.stdout.str()
