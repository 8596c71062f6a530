"""The cache-semantics families (crop, prefix, batch, lifecycle, contract, fuzz) through the public interface.

* every faulty cache of ``kvconform/testing/faulty_semantics.py`` and the five shared ones aimed at these families
  is caught by the check it targets, with its message pinned (one plugin run per model, read back from the JSON
  report; ``tests/caches/test_faulty_caches.py`` also runs each one alone over every family);
* the transformers 5.24 faults these families find are xfailed with their reasons by default (exit 0) and fail
  under ``--kvconform-strict`` with a message naming them;
* the engine's op semantics, the crop-error rule and the fuzz reproducer syntax, directly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvconform.testing import faulty_semantics

SHARED = Path(__file__).resolve().parents[3] / "shared" / "faulty_caches" / "faulty_caches.py"

# (attr, check, case, model, pinned message fragments) for the shared faulty caches these families must catch
SHARED_TARGETS = [
    ("CropOneTooManyCache", "check_crop_then_continue", "crop_short", "llama",
     ("check_crop_then_continue failed: CropOneTooManyCache on llama",
      "after crop(-2) on a 5-token cache get_seq_length() = 2, but should be 3",
      "crop() removed a different number of tokens than asked")),
    ("StaticAliasingDeepcopyCache", "check_prefix_fork", "prefix_fork_steps", "llama",
     ("check_prefix_fork failed: StaticAliasingDeepcopyCache on llama",
      "the original cache changed while its deep copies were extended", "layers[0].cumulative_length",
      "__deepcopy__ shares tensors")),
    ("ReorderKeysOnlyCache", "check_reorder_then_decode", "reorder_padded", "llama",
     ("check_reorder_then_decode failed: ReorderKeysOnlyCache on llama", "[failed at decode 1]",
      "→ the fault is in the subject", "reorder_cache() did not move every tensor of every layer")),
    ("ResetKeepsTokensCache", "check_reset_then_reuse", "reset_reuse", "llama",
     ("check_reset_then_reuse failed: ResetKeepsTokensCache on llama", "[failed at prefill(5)]",
      "→ the fault is in the subject", "reset() did not clear everything")),
    ("SeqLengthOffByOneCache", "check_length_bookkeeping", "length_bookkeeping", "llama",
     ("check_length_bookkeeping failed: SeqLengthOffByOneCache on llama",
      "after prefill(6): get_seq_length() = 7, but the cache should hold 6 tokens",
      "get_seq_length() does not count what update() stored")),
]

# the transformers 5.24 faults of issue 3: (subject, model, check, case, words of the known-fault reason)
KNOWN = [
    ("StaticCache", "llama", "check_crop_then_continue", "crop_more_than_cached", "without clamping"),
    ("StaticCache", "mistral", "check_crop_contract", "crop_past_window", "StaticSlidingWindowLayer"),
    # 5.24: the SSM-state crop fault; 5.25: recording with no count raises first (linear-recording-none-count)
    ("DynamicCache", "mamba2", "check_crop_contract", "crop_linear_recording",
     "recurrent (SSM) state|recurrent_states_to_keep"),
    ("StaticCache", "llama", "check_capacity", "capacity", "raw IndexError"),
    ("StaticCache", "mistral", "check_repeat_then_decode", "repeat_padded", "no batch_repeat_interleave"),
    ("DynamicCache", "mamba2", "check_select_then_decode", "select_padded", "LinearAttentionLayer has no"),
]


def _items_expr(items):
    """A ``-k`` expression selecting exactly these (subject, check, case) items."""
    return " or ".join(f"({subject} and {check.removeprefix('check_')} and {case})"
                       for subject, check, case in items)


def _records(path):
    return {(r["subject"], r["model"], r["check"], r["case"]): r for r in json.loads(path.read_text())["results"]}


def _targets_by_model():
    targets = {}
    for f in faulty_semantics.FAULTY:
        targets.setdefault(f.model, []).append((f.spec, f.attr, f.check, f.case, f.message))
    if SHARED.is_file():
        for attr, check, case, model, message in SHARED_TARGETS:
            targets.setdefault(model, []).append((f"{SHARED}:{attr}", attr, check, case, message))
    return targets


TARGETS = _targets_by_model()


@pytest.mark.parametrize("model", sorted(TARGETS))
def test_faulty_caches_caught_by_their_checks(model, run_kvconform, pytester):
    targets = TARGETS[model]
    args = [a for spec, *_ in targets for a in ("--kvconform-cache", spec)]
    expr = _items_expr([(attr, check, case) for _, attr, check, case, _ in targets])
    result = run_kvconform(*args, "--kvconform-model", model, "-k", expr, "--kvconform-json", "r.json")
    records = _records(pytester.path / "r.json")
    assert result.ret == 1, result.stdout.str()[-3000:]
    for _, attr, check, case, message in targets:
        record = records.get((attr, model, check, case))
        assert record is not None, f"{attr}: no item {check}/{case} on {model}"
        assert record["outcome"] == "failed", f"{attr} not caught by {check}/{case}: {record['outcome']}"
        for fragment in message:
            assert fragment in record["message"], (attr, fragment, record["message"])
        assert len(record["message"].splitlines()) <= 10, record["message"]


def test_shared_faulty_caches_present_or_skipped():
    if not SHARED.is_file():
        pytest.skip(f"{SHARED} not present (the shared faulty caches live outside the repository)")
    assert {t[0] for t in SHARED_TARGETS} <= {t[1] for ts in TARGETS.values() for t in ts}


def test_known_transformers_faults_xfail_by_default_and_fail_under_strict(run_kvconform, pytester):
    expr = _items_expr([(s, check, case) for s, _, check, case, _ in KNOWN])
    models = [a for m in sorted({k[1] for k in KNOWN}) for a in ("--kvconform-model", m)]
    default = run_kvconform(*models, "-k", expr, "--kvconform-json", "d.json")
    assert default.ret == 0, default.stdout.str()[-3000:]
    records = _records(pytester.path / "d.json")
    for subject, model, check, case, _ in KNOWN:
        assert records[(subject, model, check, case)]["outcome"] == "xfailed", (subject, model, check, case)
    strict = run_kvconform(*models, "-k", expr, "--kvconform-strict", "--kvconform-json", "s.json")
    assert strict.ret == 1
    records = _records(pytester.path / "s.json")
    for subject, model, check, case, words in KNOWN:
        record = records[(subject, model, check, case)]
        assert record["outcome"] == "failed", (subject, model, check, case, record["outcome"])
        assert "known upstream fault: transformers 5.2" in record["message"], record["message"]
        assert any(w in record["message"] for w in words.split("|")), (words, record["message"])


def test_builtin_subjects_conform_on_llama(run_kvconform, pytester):
    """The semantics families pass for ReferenceCache and DynamicCache on a plain full-attention model."""
    families = " or ".join(f"kvconform_{f}" for f in ("crop", "prefix", "batch", "lifecycle", "contract", "fuzz"))
    result = run_kvconform("--kvconform-model", "llama", "-m", families, "-k", "ReferenceCache or DynamicCache",
                           "--kvconform-json", "r.json")
    records = [r for r in _records(pytester.path / "r.json").values()
               if r["subject"] in ("ReferenceCache", "DynamicCache") and r["outcome"] != "skipped"]
    assert records and all(r["outcome"] == "passed" for r in records), \
        [(r["subject"], r["check"], r["case"], r["outcome"]) for r in records if r["outcome"] != "passed"]
    assert {r["family"] for r in records} == {"crop", "prefix", "batch", "lifecycle", "contract", "fuzz"}
    assert result.ret == 0


# ------------------------------------------------------------------------------------------------ direct units
@pytest.fixture(scope="module")
def llama_ctx():
    import torch

    from kvconform.cases import Case
    from kvconform.checks import CheckContext
    from kvconform.oracle import Oracle
    from kvconform.subjects import builtin_subjects
    from kvconform.zoo import build_zoo_model

    torch.set_num_threads(1)
    zm = build_zoo_model("llama")
    subjects = {s.name: s for s in builtin_subjects()}
    case = Case(id="unit", check="check_reorder_then_decode", source="test", batch=3,
                params={"padding": [0, 2, 3]})
    return CheckContext(subjects["DynamicCache"], zm, case, Oracle(zm), reference=subjects["ReferenceCache"])


def test_runner_tracks_rows_and_lengths_through_every_op(llama_ctx):
    import torch

    from kvconform.checks._interpreter import Runner
    from kvconform.checks._judge import judge

    runner = Runner(llama_ctx, llama_ctx.new_cache())
    runner.feed(6)
    assert runner.mask[:, :3].tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 0]]  # left padding per row
    first_rows = runner.seq.clone()
    runner.reorder()
    assert torch.equal(runner.seq, first_rows[[2, 0, 1]])
    runner.repeat(2)
    assert runner.batch == 6 and torch.equal(runner.seq[0], runner.seq[1])
    runner.select()
    assert runner.batch == 5
    runner.feed(1)
    runner.crop(9)  # more than held: the sequence is emptied, never negative
    assert runner.length == 0
    runner.feed(3)
    runner.fork()
    runner.feed(2)
    runner.reset()
    runner.feed(4)
    runner.check_parked()  # the fork's original gets one more decode step
    assert runner.steps[-1].label.startswith("original of fork")
    assert judge(llama_ctx, runner.steps).passed


def test_clear_error_rule():
    from kvconform.checks.crop import CROP_WORDS, clear_error

    assert clear_error(RuntimeError("`crop` was called, but ... activate_past_recording"), CROP_WORDS)
    assert not clear_error(IndexError("index_copy_(): index -2 is out of bounds"), CROP_WORDS)
    assert not clear_error(RuntimeError("The size of tensor a (7) must match the size of tensor b (8)"),
                           CROP_WORDS)


def test_fuzz_reproducer_is_case_syntax(tmp_path):
    from kvconform.cases import load_case_file
    from kvconform.checks.fuzz import program_case_syntax, program_text

    program = [("prefill", 2), ("repeat", 2), ("reorder", 0), ("crop", 1), ("decode", 1)]
    assert program_text(program) == "prefill(2) → repeat(2) → reorder → crop(-1) → decode×1"
    ops = program_case_syntax(program)
    assert ops == '["prefill 2", "repeat 2", "reorder", "crop 1", "decode 1"]'
    path = tmp_path / "replay.toml"
    path.write_text(f'[[case]]\nid = "replay"\ncheck = "check_reorder_then_decode"\nops = {ops}\n')
    (case,) = load_case_file(path)
    assert [op.label for op in case.ops] == ["prefill(2)", "repeat(2)", "reorder", "crop(-1)", "decode×1"]
