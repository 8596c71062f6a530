"""Misuse is named (exit 4), runs leave nothing behind, reports are machine-readable and the same under xdist."""

import json
import shlex
import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET

import pytest
import torch  # noqa: F401 - before pytester snapshots sys.modules (see test_plugin.py)

from kvconform.report import markdown


@pytest.mark.parametrize("flag", [["--kvconform-cache", "x.py:C"], ["--kvconform-model", "llama"],
                                  ["--kvconform-selftest"], ["--kvconform-full"], ["--kvconform-strict"]])
def test_kvconform_flags_without_kvconform_are_usage_errors(pytester, flag):
    pytester.makepyfile(test_ok="def test_ok(): pass")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *flag)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert f"{flag[0]} given without --kvconform, so nothing would be checked; add --kvconform" in \
        result.stderr.str()


def test_ini_settings_without_kvconform_stay_allowed(pytester):
    pytester.makeini("[pytest]\nkvconform_model = llama\n")
    pytester.makepyfile(test_ok="def test_ok(): pass")
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)


def test_run_leaves_nothing_in_the_folder_and_junit_properties_are_json(run_kvconform, pytester):
    """Fuzz (hypothesis) and speed (pytest-benchmark) items ran; the folder holds only what the run was asked to
    write."""
    pytest.importorskip("pytest_benchmark")
    before = set(os.listdir(pytester.path))
    result = run_kvconform("--kvconform-model", "llama", "-k", "ReferenceCache and (fuzz_quick or speed_vs_uncached)",
                           "--junitxml", "j.xml")
    assert result.ret == 0, result.stdout.str()
    pytester_files = {"stdout", "stderr", "runpytest-current"}
    new = {n for n in set(os.listdir(pytester.path)) - before
           if n not in pytester_files and not n.startswith("runpytest-")}
    assert new == {"j.xml"}  # no .benchmarks/, no .hypothesis/
    cases = ET.parse(pytester.path / "j.xml").getroot().iter("testcase")
    props = [{p.get("name"): p.get("value") for p in case.iter("property")} for case in cases]
    assert len(props) == 2
    for p in props:
        info, metrics = json.loads(p["kvconform"]), json.loads(p["kvconform_metrics"])
        assert info["subject"] == "ReferenceCache" and info["model"] == "llama"
        assert isinstance(metrics, dict) and metrics


def test_hook_returning_one_spec_or_bad_specs_are_usage_errors(run_kvconform, pytester):
    bad = {
        "kvconform.CacheSpec(name='Mine', factory=ReferenceCache)":
            "returned a CacheSpec; it must return a list of subjects",
        "[kvconform.CacheSpec(name='my cache-1', factory=ReferenceCache)]":
            "the name 'my cache-1' may use only letters, digits, '_' and '.'",
        "[kvconform.CacheSpec(name='Mine', factory=ReferenceCache, capabilities=frozenset({'forward', 'generat'}))]":
            "unknown capabilities 'generat' (did you mean 'generate'?)",
        "[kvconform.CacheSpec(name='Mine', factory=ReferenceCache, expected_failures={'check_beam_serch': 'x'})]":
            "expected_failures: unknown checks 'check_beam_serch' (did you mean 'check_beam_search'?)",
        "[kvconform.CacheSpec(name='DynamicCache', factory=ReferenceCache)]":
            "CacheSpec 'DynamicCache' (pytest_kvconform_caches hook or Python): a built-in subject is already named",
    }
    for returned, message in bad.items():
        pytester.makeconftest(f"import kvconform\nfrom kvconform import ReferenceCache\n\n"
                              f"def pytest_kvconform_caches(config):\n    return {returned}\n")
        result = run_kvconform("--kvconform-model", "gpt2", "--collect-only", "-q")
        assert result.ret == pytest.ExitCode.USAGE_ERROR, (returned, result.stdout.str(), result.stderr.str())
        assert message in result.stderr.str(), (returned, result.stderr.str())


def test_cache_file_imports_its_siblings_and_module_specs_resolve_from_the_folder(run_kvconform, pytester):
    pytester.makepyfile(my_layer="from kvconform import ReferenceCache as Base\n",
                        my_cache="from my_layer import Base\n\nclass MyCache(Base):\n    pass\n")
    for spec in ("my_cache.py:MyCache", "my_cache:MyCache"):
        result = run_kvconform("--kvconform-cache", spec, "--kvconform-model", "gpt2",
                               "-k", "MyCache and decode_explicit")
        result.assert_outcomes(passed=1)
    result = run_kvconform("--kvconform-cache", "no_such_module:MyCache", "--collect-only")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "give the file instead ('path/to/file.py:Attr'" in result.stderr.str()


def test_capabilities_of_a_factory_function_are_honoured_from_the_command_line(run_kvconform, pytester):
    pytester.makepyfile(caches="""
        from kvconform import ReferenceCache

        def ForwardOnly(config):
            return ReferenceCache(config=config)

        ForwardOnly.kvconform_capabilities = {"forward"}
    """)
    result = run_kvconform("--kvconform-cache", "caches.py:ForwardOnly", "--kvconform-model", "gpt2",
                           "-k", "ForwardOnly and (generate_greedy or decode_explicit)", "-rs")
    result.assert_outcomes(passed=1, skipped=1)
    assert "generate" in result.stdout.str()


def test_xdist_writes_one_step_summary_with_the_serial_row_order(run_kvconform, pytester, monkeypatch):
    pytest.importorskip("xdist")
    summaries = {}
    for name, extra in (("serial", ()), ("xdist", ("-n", "2"))):
        path = pytester.path / f"{name}.md"
        monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(path))
        result = run_kvconform("--kvconform-model", "gpt2", "--kvconform-model", "llama",
                               "-k", "decode_explicit_positions", *extra)
        assert result.ret == 0, result.stdout.str()
        summaries[name] = path.read_text()
    assert summaries["xdist"].count("### kvconform conformance matrix") == 1
    assert summaries["xdist"] == summaries["serial"]


def test_markdown_marks_an_all_skipped_subject_as_not_checked():
    def rec(subject, outcome):
        return {"subject": subject, "model": "llama", "check": "c", "family": "logits", "case": "k",
                "outcome": outcome}

    results = {i: r for i, r in enumerate([rec("Ran", "passed"), rec("Ran", "skipped"), rec("Skipped", "skipped"),
                                           rec("Bad", "failed")])}
    rows = {line.split()[2]: line.split()[1] for line in markdown(results).splitlines()
            if line.startswith("| ") and line.split()[1] in ("✅", "❌", "⏭️")}
    assert rows == {"Ran": "✅", "Skipped": "⏭️", "Bad": "❌"}


def test_marker_keeps_only_the_conformance_items_in_a_project_with_its_own_tests(run_kvconform, pytester):
    pytester.makepyfile(test_own="def test_own_failing(): assert False")
    result = run_kvconform("--kvconform-model", "gpt2", "-m", "kvconform", "-k", "ReferenceCache and decode_explicit")
    result.assert_outcomes(passed=1)


def test_non_causal_checkpoints_are_refused_up_front(run_kvconform, pytester):
    """A vision model (no language-model class) and a bidirectional encoder (BERT: a causal-LM class exists, but
    every position attends to later tokens) are one usage error each, not a run of failing items."""
    # saved in a subprocess: save_pretrained imports torch modules lazily, and pytester drops modules imported
    # during a test, which breaks later in-process tests
    subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import torch
        from transformers import AutoConfig, AutoModel
        torch.manual_seed(0)
        bert = AutoConfig.for_model("bert", vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, intermediate_size=128)
        AutoModel.from_config(bert).save_pretrained("bert_enc")
        vit = AutoConfig.for_model("vit", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=128, image_size=32, patch_size=8)
        AutoModel.from_config(vit).save_pretrained("vit_img")
    """)], cwd=pytester.path, check=True, capture_output=True)
    expected = {"./vit_img": "a 'vit' checkpoint has no causal language-model class in transformers",
                "./bert_enc": "not a causal language model: changing later input tokens changed the logits of "
                              "earlier positions"}
    for spec, message in expected.items():
        result = run_kvconform("--kvconform-model", spec, "--collect-only", "-q")
        assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()
        assert message in result.stderr.str()


def test_a_failed_node_id_can_be_pasted_back(run_kvconform):
    spec = ("--kvconform-cache", "kvconform.testing.faulty_logits:HiddenWindowCache", "--kvconform-model", "llama")
    result = run_kvconform(*spec, "-k", "HiddenWindowCache and prefill_then_decode", "-rf")
    assert result.ret == 1
    failed = [line.split()[1] for line in result.stdout.lines if line.startswith("FAILED ")]
    assert failed and failed[0].startswith("test_conformance.py::")
    again = run_kvconform(*spec, failed[0])
    again.assert_outcomes(failed=1)
    assert failed[0].split("::")[1] in again.stdout.str()


def test_optional_backends_import_without_deprecation_noise(run_kvconform):
    pytest.importorskip("hqq")
    result = run_kvconform("--kvconform-model", "llama", "-k", "QuantizedCache_hqq4 and decode_explicit")
    result.assert_outcomes(passed=1)
    assert "DeprecationWarning" not in result.stdout.str() + result.stderr.str()


SLOW = """
import time
from kvconform import ReferenceCache


class SlowCache(ReferenceCache):
    def update(self, *args, **kwargs):
        time.sleep(30)
        return super().update(*args, **kwargs)
"""

CASE = """
[[case]]
id = "mine_decode"
check = "check_prefill_then_decode"
ops = ["prefill 20", "decode 3"]
models = ["llama"]
"""


def _reproduce(result) -> list[str]:
    lines = [line.strip() for line in result.stdout.lines if line.strip().startswith("reproduce: ")]
    assert lines, result.stdout.str()
    return shlex.split(lines[0].removeprefix("reproduce: "))


def test_reproduce_lines_carry_the_run_options_and_reproduce(run_kvconform, pytester):
    """Case files, strict, timeout: a reproduce line repeats what changes an item, and re-running it gives the same
    item with the same outcome (a timed-out item times out again instead of passing under the default timeout)."""
    pytester.makepyfile(slow=SLOW)
    (pytester.path / "mine.toml").write_text(CASE)
    result = run_kvconform("--kvconform-cache", "kvconform.testing.faulty_logits:HiddenWindowCache",
                           "--kvconform-model", "llama", "--kvconform-cases", "mine.toml", "--kvconform-strict",
                           "-k", "HiddenWindowCache and mine_decode")
    result.assert_outcomes(failed=1)
    args = _reproduce(result)
    assert "--kvconform-cases" in args and "--kvconform-strict" in args
    assert args[args.index("--kvconform-cases") + 1] == str(pytester.path / "mine.toml")
    again = run_kvconform(*args[2:])  # drop "pytest --kvconform": run_kvconform adds them
    again.assert_outcomes(failed=1)
    assert "mine_decode" in again.stdout.str()
    result = run_kvconform("--kvconform-cache", "slow.py:SlowCache", "--kvconform-model", "llama",
                           "--kvconform-timeout", "2", "-k", "SlowCache and decode_explicit_positions")
    result.assert_outcomes(failed=1)
    args = _reproduce(result)
    assert args[args.index("--kvconform-timeout") + 1] == "2"
    run_kvconform(*args[2:]).assert_outcomes(failed=1)


def test_consecutive_runs_give_identical_outcomes_and_fuzz_programs(run_kvconform, pytester):
    """Two runs of the same selection: the same item → outcome map (timing-based speed items aside); the fuzz
    family, long profile included, draws the same programs unless --kvconform-fuzz-seed asks for others."""
    maps = []
    for i in range(2):
        result = run_kvconform("--kvconform-model", "llama", "--kvconform-model", "mamba2", "--kvconform-full",
                               "-m", "not kvconform_speed and not kvconform_compile",
                               "-k", "(DynamicCache and not offloaded and not fuzz_long) or (ReferenceCache and fuzz)",
                               "--kvconform-json", f"r{i}.json")
        assert result.ret in (0, 1), result.stdout.str()
        records = json.loads((pytester.path / f"r{i}.json").read_text())["results"]
        maps.append({r["nodeid"]: (r["outcome"], r["metrics"].get("program"), r["metrics"].get("programs"))
                     for r in records})
    assert maps[0] and maps[0] == maps[1]
    assert any(k.endswith("fuzz_long]") or "fuzz_long" in k for k in maps[0])


def test_a_failed_memory_item_reports_numbers_of_one_step(run_kvconform, pytester):
    result = run_kvconform("--kvconform-cache", "kvconform.testing.faulty_perf:RepeatedKVCache",
                           "--kvconform-model", "llama", "-k", "RepeatedKVCache and memory_decode",
                           "--kvconform-json", "r.json")
    assert result.ret == 1
    (record,) = [r for r in json.loads((pytester.path / "r.json").read_text())["results"]
                 if r["outcome"] == "failed"]
    m = record["metrics"]
    assert m["measured_at"] == m["failed_at"]
    step = [row for row in m["per_op"] if row[0] == m["failed_at"]][-1]
    assert [m["tokens"], m["bytes_held"], m["bytes_formula"]] == step[1:]
    assert m["ratio"] == round(m["bytes_held"] / m["bytes_formula"], 4)


def test_a_subject_raising_in_a_speed_item_gets_the_short_message(run_kvconform, pytester):
    pytest.importorskip("pytest_benchmark")
    pytester.makepyfile(longfail="""
        from kvconform import ReferenceCache

        class LongFail(ReferenceCache):
            def update(self, key_states, value_states, layer_idx, *args, **kwargs):
                if self.get_seq_length() > 200:
                    raise RuntimeError("LongFail: more than 200 tokens")
                return super().update(key_states, value_states, layer_idx, *args, **kwargs)
    """)
    result = run_kvconform("--kvconform-cache", "longfail.py:LongFail", "--kvconform-model", "llama",
                           "-k", "LongFail and speed_vs_uncached")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    block = out[out.index("check_speed_vs_uncached failed: LongFail"):out.index("reproduce:")]
    assert "the subject raised RuntimeError: LongFail: more than 200 tokens" in block
    assert len(block.splitlines()) <= 5 and "Traceback" not in out
