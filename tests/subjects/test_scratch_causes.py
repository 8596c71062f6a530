"""Issue 43, deliverables 2 and 3 for models written from scratch: a static adapter cache that defines ``poison``
runs the poisoned-capacity cases (the worked example's static cache passes them, ``LengthFromContents`` fails them);
a skipped padded case names its unpadded twin only where one exists; every likely-cause line is said in the
adapter's terms, built from what was measured (the op it failed at, whether the same ops without a fork fail too,
where an exception was raised), and never names transformers' cache API the adapter does not have.

One ``pytest --kvconform`` subprocess for the plugin runs; the rest in process on real caches and adapters.
"""

import json
import os

import pytest

import forkserver
import torch

from kvconform import scratch
from kvconform.failure import Cause, OpsTrail

EXAMPLE = "kvconform.examples.tiny_decoder"
FAULTY = "kvconform.testing.faulty_scratch"
_RUN: dict = {}


def _records(tmp_path_factory) -> dict:
    """``{(subject, case id): record}`` of one run: the worked example's static cache and ``LengthFromContents`` on
    the poisoned-capacity cases, ``NoCausalMaskInChunk`` on the fork / prefix / multi-turn cases."""
    if not _RUN:
        folder = tmp_path_factory.mktemp("causes")
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
        selection = ("((tiny_decoder_two_caches or length_from_contents) and poisoned_capacity) or "
                     "(no_causal_chunk and (prefix_fork_chunk or multi_turn or prefix_generate))")
        proc = forkserver.run_pytest(
            ["--kvconform", "-p", "no:cacheprovider", "-p", "no:randomly", "-q",
             "-n", "0", "--kvconform-json", "r.json", "-k", selection,
             "--kvconform-model", f"{EXAMPLE}:TinyDecoderTwoCaches",
             "--kvconform-model", f"{FAULTY}:LengthFromContents", "--kvconform-model", f"{FAULTY}:NoCausalMaskInChunk"],
            cwd=folder, env=env, timeout=900)
        report = folder / "r.json"
        assert report.is_file(), f"no JSON report (exit {proc.returncode})\n{proc.stdout[-4000:]}{proc.stderr}"
        _RUN.update({(r["subject"], r["case"]): r for r in json.loads(report.read_text())["results"]})
    return _RUN


def _message(record) -> str:
    return record.get("message") or ""


def test_a_static_adapter_cache_with_poison_runs_the_poisoned_capacity_cases(tmp_path_factory):
    run = _records(tmp_path_factory)
    for case in ("poison_large", "poison_nan"):
        assert run[("TinyStaticCache", case)]["outcome"] == "passed", _message(run[("TinyStaticCache", case)])
        faulty = run[("NonzeroStaticCache", case)]
        assert faulty["outcome"] == "failed", faulty
        text = _message(faulty)
        assert "your model reads slots your poison(cache, start, value) filled" in text, text
        assert "kvconform_poison" not in text and "after your crop" not in text, text  # it raised before the crop
    # the growing dict cache holds no unused slot: skipped, never a vacuous pass
    assert run[("TinyGrowingCache", "poison_large")]["outcome"] == "skipped"


def test_fork_generate_and_multi_turn_causes_are_said_in_the_adapters_terms(tmp_path_factory):
    run = _records(tmp_path_factory)
    fork = _message(run[("NoCausalChunkCache", "prefix_fork_chunk")])
    assert "causal mask applied only when the queries are as long as the keys" in fork, fork
    assert "not the fork" in fork and "deep copy does not hold" not in fork, fork
    for case in ("multi_turn", "prefix_generate_full_prompt", "prefix_generate_suffix_only"):
        record = run[("NoCausalChunkCache", case)]
        assert record["outcome"] == "failed", record
        text = _message(record)
        assert "get_seq_length" not in text and "generate() slices" not in text, text
        assert "one chunk at start" in text, text


def test_a_padded_case_names_its_unpadded_twin_only_where_one_exists():
    assert scratch.unpadded_twin("reorder_padded") == "reorder_unpadded"
    assert scratch.unpadded_twin("bf16_long_decode") == "bf16_long_decode_unpadded"
    assert scratch.unpadded_twin("poison_nan") is None
    from kvconform.session import build_session

    session = build_session(models=[f"{EXAMPLE}:TinyMasklessDecoder"],
                            checks=["check_poisoned_capacity", "check_reorder_then_decode"], runs_items=False)
    skips = {item.case.id: item.skip for item in session.items()}
    assert "has no unpadded twin" in skips["poison_nan"], skips["poison_nan"]
    assert "its unpadded twin reorder_unpadded runs instead" in skips["reorder_padded"], skips["reorder_padded"]


def test_an_adapter_without_poison_is_told_what_to_add():
    from kvconform.checks.poison import can_poison
    from kvconform.examples.tiny_decoder import TinyMasklessDecoder

    class NoPoison(TinyMasklessDecoder):
        poison = None  # an adapter written without the optional method

    adapter = NoPoison()
    net = adapter.build(torch.float32, "cpu")
    cache = scratch.scratch_cache_class()(adapter, net, 2, 16)
    reason = can_poison(cache, 1e4)
    assert "defines no poison(cache, start, value) method" in reason and "kvconform_poison" not in reason, reason


def test_a_crop_cause_needs_a_crop_before_the_failing_op():
    ops = (("prefill", "prefill(10)"), ("decode", "decode×3"), ("crop", "crop(-4)"), ("decode", "decode×2"))
    early = OpsTrail(ops, "decode 1", "raised", op_index=1)
    late = OpsTrail(ops, "decode 1", "raised", op_index=3)
    assert scratch.likely_cause("check_crop_then_continue", early) is None
    assert "after your crop(cache, n)" in scratch.likely_cause("check_crop_then_continue", late)


def test_kvconforms_reading_that_names_transformers_api_is_not_said_to_an_adapter():
    ops = OpsTrail((("prefill", "prefill(6)"), ("decode", "decode×2")), "decode 1", "raised", op_index=1)
    out = scratch.adapter_lines("check_x", ["the subject raised ...", ops,
                                            Cause("the cache lacks something generate() calls", "raised")],
                                raised=True)
    cause = next(x for x in out if isinstance(x, Cause))
    assert "generate()" not in cause.text and "your adapter's code raised at decode 1, after prefill(6)" in cause.text
    assert cause.id == "raised"  # the id and facts are kept
    plain = scratch.adapter_lines("check_x", ["likely cause: update() returned the wrong keys"], "decode 2")
    assert [str(x) for x in plain if isinstance(x, Cause)] == [
        "your cached forward at decode 2 differs from your uncached forward of the same tokens: the cache held "
        "something else than the tokens kvconform fed it, or your forward reads them at the wrong positions"]


class _UpdateRaises:
    """Mixed into a real DynamicCache: its own update() raises (a bug in the cache's code, not a missing method)."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        raise RuntimeError("shape mismatch in my update")


def test_an_exception_inside_update_is_the_caches_own_code():
    from transformers import DynamicCache

    from kvconform.checks.generate import raised_cause

    cache = type("UpdateRaisesCache", (_UpdateRaises, DynamicCache), {})()
    try:
        cache.update(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2), 0)
    except RuntimeError as exc:
        text = raised_cause(exc, cache)
    assert text.startswith("the cache's own update() at test_scratch_causes.py:"), text
    assert "lacks" not in text.split(":", 2)[0]
    try:
        cache.no_such_method()
    except AttributeError as exc:
        assert raised_cause(exc, cache) == "the cache lacks something generate() calls (see the exception)"


@pytest.mark.parametrize("case", ["poison_large"])
def test_the_worked_example_poison_fills_only_the_tail(case):
    from kvconform.examples.tiny_decoder import TinyDecoderTwoCaches

    adapter = TinyDecoderTwoCaches()
    net = adapter.build(torch.float64, "cpu")
    cache = adapter.new_cache(net, 2, 12, static=True)
    _, cache = adapter.forward(net, torch.randint(0, 128, (2, 5)), cache, 0)
    assert adapter.poison(cache, 5, 1e4) == 2 * 7 * 2  # rows × free slots × blocks
    assert bool((cache[0]["key"][:, :, 5:] == 1e4).all()) and not bool((cache[0]["key"][:, :, :5] == 1e4).any())


def test_a_model_that_fails_at_a_dtype_whatever_the_cache_is_reported_as_the_models():
    from kvconform.session import build_session

    spec = f"{FAULTY}:Float32RotaryAtBf16"
    session = build_session(models=[spec], checks=["check_prefill_then_decode", "check_prefix_fork"],
                            runs_items=False)
    items = list(session.items())
    low = [i for i in items if i.case.dtype in ("bfloat16", "float16")]
    assert low and all(i.skip and i.skip.startswith("the model fails at") for i in low), [i.skip for i in low]
    assert {i.subject.name for i in low} == {"Fp32RotaryDictCache", "Fp32RotaryStaticCache"}
    assert "forward_uncached" in low[0].skip and "RuntimeError" in low[0].skip, low[0].skip
    # float32 items are judged as usual, and the correct example runs its low-precision items
    assert any(i.skip is None for i in items if i.case.dtype == "float32")
    assert scratch.dtype_problem(f"{EXAMPLE}:TinyMasklessDecoder", "bfloat16") is None


def test_length_bookkeeping_runs_on_an_adapter_that_reports_its_length():
    from kvconform.api import check_cache

    good = check_cache([], models=[f"{EXAMPLE}:TinyMasklessDecoder"], checks=["check_length_bookkeeping"])
    assert [r.outcome for r in good] == ["passed"], [(r.outcome, r.message) for r in good]
    (bad,) = check_cache([], models=[f"{FAULTY}:LengthCounterNotRewound"], checks=["check_length_bookkeeping"])
    assert bad.outcome == "failed", bad
    assert "seq_length(cache) = 11, but the cache should hold 9 tokens" in bad.message, bad.message
    assert "get_mask_sizes" not in bad.message and "get_seq_length" not in bad.message, bad.message
    (none,) = check_cache([], models=[f"{EXAMPLE}:TinyDecoder"], checks=["check_length_bookkeeping"])
    assert none.outcome == "skipped" and "defines no seq_length(cache)" in none.message, none


def test_the_header_lists_only_the_subjects_that_run_on_the_models_of_the_run():
    from kvconform.session import build_session

    session = build_session(models=[f"{EXAMPLE}:TinyMasklessDecoder"], runs_items=False)
    (line,) = [x for x in session.header_lines() if x.startswith("kvconform subjects:")]
    assert line.startswith("kvconform subjects: TinyMasklessCache (") and "DynamicCache" not in line, line
    assert "other subjects run on none of these models" in line, line


def test_the_reproduce_line_selects_with_the_fewest_words():
    from kvconform.api import check_cache

    (bad,) = check_cache([], models=[f"{FAULTY}:LengthCounterNotRewound"], checks=["check_length_bookkeeping"])
    assert '-k "length_bookkeeping and CountedCache"' in bad.message, bad.message
