"""The plugin end to end, through pytest in a subprocess, from an empty folder."""

import json
import re
import shlex
import subprocess
import sys
import textwrap

import pytest
import torch  # before pytester snapshots sys.modules: a torch imported inside a test is dropped after it

from kvconform.plugin import FAMILY_MARKERS


def test_inert_without_flag_imports_no_torch(pytester):
    pytester.makepyfile(test_x="""
        import sys
        def test_nothing_heavy_loaded():
            assert "torch" not in sys.modules and "transformers" not in sys.modules
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_plugin_module_imports_only_pytest_and_stdlib():
    code = "import sys, kvconform.plugin; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_family_markers_match_check_families():
    from kvconform.checks import FAMILIES

    assert tuple(FAMILY_MARKERS) == tuple(FAMILIES)


def test_empty_folder_run_with_json_and_known_fault_xfail(run_kvconform, pytester):
    result = run_kvconform("--kvconform-model", "llama", "--kvconform-model", "jamba", "-rx",
                           "--kvconform-json", "report.json")
    assert result.ret == 0, result.stdout.str()
    out = result.stdout.str()
    assert "kvconform conformance matrix" in out
    assert re.search(r"ReferenceCache\s+\d+/\d+ x\d+", out)
    data = json.loads((pytester.path / "report.json").read_text())
    assert data["schema"] == 1
    assert {"kvconform", "torch", "transformers", "device"} <= set(data["environment"])
    keys = {"nodeid", "subject", "model", "check", "family", "case", "outcome", "message", "metrics"}
    assert data["results"] and all(set(r) == keys for r in data["results"])
    outcomes = {r["outcome"] for r in data["results"]}
    assert outcomes <= {"passed", "failed", "skipped", "xfailed", "xpassed", "error"}
    jamba_chunks = [r for r in data["results"] if r["model"] == "jamba" and r["check"] == "check_chunked_continuation"
                    and r["subject"] in ("ReferenceCache", "DynamicCache", "StaticCache")]
    assert len(jamba_chunks) == 9 and all(r["outcome"] == "xfailed" for r in jamba_chunks)
    offloaded = [r for r in data["results"] if r["subject"].endswith("_offloaded")]
    assert offloaded and all(r["outcome"] == "skipped" and r["message"] for r in offloaded)
    assert any(r["message"] == "offloading needs CUDA" for r in offloaded)
    assert all("recurrent state is lost" in r["message"] for r in jamba_chunks)
    passed = [r for r in data["results"] if r["outcome"] == "passed"]
    assert all(r["metrics"]["max_abs"] <= r["metrics"]["tolerance"] for r in passed if "max_abs" in r["metrics"])


def test_strict_turns_known_faults_into_failures(run_kvconform):
    result = run_kvconform("--kvconform-model", "mamba", "--kvconform-strict", "-k", "chunk8")
    assert result.ret == 1
    out = result.stdout.str()
    assert "check_chunked_continuation failed: ReferenceCache on mamba" in out
    assert "the fault is in the model, not the cache" in out
    assert "known upstream fault: transformers>=5.5: Mamba (v1) and Jamba" in out


def test_k_selection_and_nomatch(run_kvconform):
    result = run_kvconform("--kvconform-model", "llama", "-k", "DynamicCache and not offloaded and decode_explicit")
    result.assert_outcomes(passed=1)
    result = run_kvconform("--kvconform-model", "llama", "-k", "no_such_item_anywhere")
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED


@pytest.mark.parametrize("spec, cause", [
    ("no_such_module_xyz:Cache", "importing 'no_such_module_xyz' failed: ModuleNotFoundError"),
    ("kvconform.reference:NoSuchCache", "has no attribute 'NoSuchCache'"),
    ("kvconform.zoo:ZooModel", "is a class but not a transformers.Cache subclass"),
    ("kvconform.zoo:ZOO_NAMES", "not a Cache subclass or a factory"),
    ("missing_file.py:Cache", "does not exist"),
    ("no-colon-here", "expected 'module:attr'"),
])
def test_bad_cache_spec_is_usage_error(run_kvconform, spec, cause):
    result = run_kvconform("--kvconform-cache", spec)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    err = result.stderr.str()
    assert repr(spec) in err and cause in err, err


def test_factory_returning_non_cache_is_usage_error(run_kvconform, pytester):
    pytester.makepyfile(mycaches="def NotACache(config=None):\n    return [1, 2, 3]\n")
    result = run_kvconform("--kvconform-cache", "mycaches.py:NotACache")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert ("NotACache returned a list of 3 (int, int, int); a factory returns a transformers.Cache, or a pair "
            "(cache, context manager)") in result.stderr.str()


def test_bad_model_spec_is_usage_error(run_kvconform):
    result = run_kvconform("--kvconform-model", "llama3000")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "'llama3000': not a zoo name" in result.stderr.str()


def test_bad_case_file_is_usage_error_naming_file_case_key_and_allowed(run_kvconform, pytester):
    pytester.makefile(".toml", mycases=textwrap.dedent("""
        [[case]]
        id = "mine"
        check = "check_prefill_then_decode"
        ops = ["prefill 4", "decode 2"]
        position_ids = "sometimes"
    """))
    result = run_kvconform("--kvconform-cases", "mycases.toml")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    err = result.stderr.str()
    assert "mycases.toml: case 'mine': key 'position_ids': 'sometimes' is not allowed" in err
    assert "allowed values: auto, explicit, implicit" in err


def test_faulty_cache_fails_with_design_message(run_kvconform):
    result = run_kvconform("--kvconform-cache", "kvconform.testing.faulty_logits:HiddenWindowCache",
                           "--kvconform-model", "llama", "-k", "HiddenWindowCache and decode_explicit")
    assert result.ret == 1
    lines = result.stdout.str().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("check_prefill_then_decode failed"))
    message = lines[start:start + 7]
    assert message[0] == ("check_prefill_then_decode failed: HiddenWindowCache on llama (fp32, batch 2), "
                          "case decode_explicit_positions")
    assert re.fullmatch(r"  max\|Δlogit\| = \S+, but should be ≤ \S+ \(.*noise floor \S+\)", message[1])
    assert message[2] == "  worst at batch=0 step=6 position=17"
    assert message[3].startswith("  ops: prefill(12) → decode×10   [failed at decode 6]")
    assert "→ the fault is in the subject" in message[4]
    assert message[5].startswith("  likely cause: ") and "evicted" in message[5]
    assert message[6] == ('  reproduce: pytest --kvconform --kvconform-cache kvconform.testing.faulty_logits:'
                          'HiddenWindowCache --kvconform-model llama -k "prefill_then_decode and '
                          'decode_explicit_positions and HiddenWindowCache"')
    again = run_kvconform(*shlex.split(message[6].split("reproduce: pytest ", 1)[1]))
    again.assert_outcomes(failed=1)  # the reproduce line runs exactly this item again


def test_bad_option_values_are_usage_errors(run_kvconform, pytester):
    pytester.mkdir("a_folder")
    for args, text in [
        (("--kvconform-json", "no_such_folder/r.json"), "--kvconform-json 'no_such_folder/r.json': folder"),
        (("--kvconform-json", "a_folder"), "--kvconform-json 'a_folder': is a folder"),
        (("--kvconform-timeout", "-1"), "--kvconform-timeout -1: must be ≥ 0"),
        (("--kvconform-device", "banana"), "--kvconform-device 'banana': not a torch device"),
        (("--kvconform-device", "cuda"), "--kvconform-device 'cuda': CUDA is not available"),
    ]:
        if args[1] == "cuda" and torch.cuda.is_available():
            continue
        result = run_kvconform(*args)
        assert result.ret == pytest.ExitCode.USAGE_ERROR, (args, result.stdout.str())
        err = result.stderr.str()
        assert text in err and "Traceback" not in err, (args, err)
    assert not (pytester.path / "no_such_folder").exists()  # nothing created on the user's behalf


def test_checkpoint_specs_are_never_confused_with_zoo_names(run_kvconform, pytester):
    from kvconform.zoo import build_zoo_model

    build_zoo_model("llama").model.save_pretrained(pytester.path / "llama")
    (pytester.path / "config_only").mkdir()
    (pytester.path / "config_only" / "config.json").write_text((pytester.path / "llama" / "config.json").read_text())
    for spec, text in [("llama", "both a zoo family and a checkpoint folder here; write ./llama"),
                       ("config_only", "config.json but no weights"), ("./nowhere", "no such folder")]:
        result = run_kvconform("--kvconform-model", spec)
        assert result.ret == pytest.ExitCode.USAGE_ERROR and text in result.stderr.str(), result.stderr.str()
    result = run_kvconform("--kvconform-model", "./llama", "-k", "ReferenceCache and decode_explicit",
                           "--kvconform-json", "r.json")
    assert result.ret == 0, result.stdout.str()
    records = json.loads((pytester.path / "r.json").read_text())["results"]
    assert {r["model"] for r in records} == {"ckpt_llama"}  # the folder, not the zoo's llama


def test_subject_whose_constructor_raises_fails_its_items_with_a_short_message(run_kvconform, pytester):
    pytester.makepyfile(brokencaches="""
        from transformers import DynamicCache

        class BrokenInit(DynamicCache):
            def __init__(self, config, **kwargs):
                raise RuntimeError("cannot allocate the pool")
    """)
    result = run_kvconform("--kvconform-cache", "brokencaches.py:BrokenInit", "--kvconform-model", "llama",
                           "-k", "decode_explicit")
    assert result.ret == 1
    out = result.stdout.str()
    assert "building the subject raised RuntimeError: cannot allocate the pool (at brokencaches.py:" in out
    assert "ReferenceCache" in out and re.search(r"BrokenInit\s+0/1 F1", out)
    counts = result.parseoutcomes()
    assert counts["failed"] == 1 and counts["passed"] >= 3  # the other subjects are unaffected


def test_collected_ids_are_safe(run_kvconform):
    result = run_kvconform("--collect-only", "-q")
    assert result.ret == 0
    ids = [line for line in result.stdout.lines if "::" in line]
    assert len(ids) > 100
    for nodeid in ids:
        param = nodeid.split("[", 1)[1].rstrip("]")
        assert re.fullmatch(r"[A-Za-z0-9_.-]+", param), nodeid


def test_ini_twins_activate_and_select(pytester):
    pytester.makeini("[pytest]\nkvconform = true\nkvconform_model = gpt2\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-k", "ReferenceCache and decode_explicit")
    result.assert_outcomes(passed=1)


def test_ini_paths_are_relative_to_the_ini_file(pytester):
    pytester.makepyfile(mycaches="""
        from transformers import DynamicCache

        class GoodCache(DynamicCache):
            pass
    """)
    pytester.makeini("""
        [pytest]
        kvconform = true
        kvconform_cache = mycaches.py:GoodCache
        kvconform_model = llama
        kvconform_json = reports/r.json
    """)
    (pytester.path / "reports").mkdir()
    sub = pytester.mkdir("sub")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-k",
                           "GoodCache and decode_explicit"], cwd=sub, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    records = json.loads((pytester.path / "reports" / "r.json").read_text())["results"]
    assert [r["outcome"] for r in records if r["subject"] == "GoodCache"] == ["passed"]

