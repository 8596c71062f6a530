"""Small breaks a new user hit (issue: never flaky, survives a crash, fast loop), each pinned by the test that would
have caught it."""

from __future__ import annotations

import json
import textwrap


from kvconform.report import json_path_problem


def test_a_json_path_in_a_folder_that_takes_no_files_is_refused_up_front(tmp_path):
    """/proc passes os.access for root but takes no new file: the run used to end in a traceback and lose the
    matrix after running every item."""
    assert json_path_problem("/proc/report.json") is not None
    assert "does not take new files" in json_path_problem("/proc/report.json")
    assert json_path_problem(str(tmp_path / "r.json")) is None
    assert list(tmp_path.iterdir()) == []  # the probe file is removed


def test_a_user_parametrize_with_checks_file_is_not_counted_twice_and_own_failures_get_a_hint(run_kvconform,
                                                                                            pytester):
    """A project's test file decorated with parametrize_with_checks beside a `pytest --kvconform` run runs as the
    project's test, but the matrix and the JSON count each conformance item once; a failing test of the project
    under an all-green matrix gets a line saying that the exit code 1 is not kvconform's."""
    pytester.makepyfile(test_mine=textwrap.dedent('''
        from transformers import DynamicCache
        from kvconform import parametrize_with_checks

        @parametrize_with_checks([DynamicCache], models=["llama"], checks=["check_prefill_then_decode"],
                                 cases=["decode_explicit_positions"])
        def test_dynamic_conforms(kv_item, kv_runner):
            kv_runner(kv_item)

        def test_own_failing():
            assert False
    '''))
    result = run_kvconform("--kvconform-model", "llama", "--kvconform-subject", "DynamicCache", "--kvconform-json",
                           "r.json", "-k", "decode_explicit_positions or test_own_failing")
    out = result.stdout.str()
    assert result.ret == 1, out
    records = json.loads((pytester.path / "r.json").read_text())["results"]
    assert [(r["subject"], r["case"], r["outcome"]) for r in records] == [
        ("DynamicCache", "decode_explicit_positions", "passed")], records
    assert "3 passed" not in out and "2 passed" in out  # the suite's item and the project's own item both ran
    matrix = out.split("subjects × check families")[1]
    assert "1/1" in matrix and "2/2" not in matrix
    assert "the failures (1) are the project's own tests, not kvconform's: test_mine.py::test_own_failing" in out


def test_a_cache_returning_another_dtype_fails_each_item_with_the_same_precise_cause():
    """update() returning bfloat16 for float32 states made every item fail on the attention's dtype error with the
    generic cause; each item now names the measured cause (recognisably the same one in every item)."""
    import torch
    from transformers import DynamicCache

    import kvconform

    class BfloatReturningCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
            return keys.to(torch.bfloat16), values.to(torch.bfloat16)

    results = kvconform.check_cache(BfloatReturningCache, models=["llama"], checks=["check_prefill_then_decode"],
                                    cases=["decode_explicit_positions", "decode_recording"])
    assert len(results) == 2 and all(r.outcome == "failed" for r in results), results
    causes = {line for r in results for line in r.message.splitlines() if "likely cause" in line}
    assert causes == {"  likely cause: update(layer_idx=0) returned keys of dtype bfloat16 for key/value states of "
                      "dtype float32: the attention then runs in another dtype or raises; return the states' dtype "
                      "(cast back after dequantizing)"}, causes
