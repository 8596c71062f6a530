"""Low precision (bfloat16 / float16) in the default tier: the per-dtype tolerance, the faults only a half dtype shows
(``kvconform/testing/faulty_dtypes.py``) caught by the default ``bf16_*`` / ``fp16_*`` cases while they pass float32,
transformers' DynamicCache passing those cases, and every item's record naming its dtype and batch."""

import json
import os
import re

import pytest

import forkserver

import kvconform
from kvconform.oracle import DEFAULT_ABS_MIN, DEFAULT_FACTOR, dtype_tolerance
from kvconform.report import dtype_counts
from kvconform.testing import faulty_dtypes

FP32_CASE = "decode_explicit_positions"


def test_float32_keeps_its_rule_and_half_dtypes_get_their_own():
    assert dtype_tolerance("float32") == (DEFAULT_FACTOR, DEFAULT_ABS_MIN) == (10.0, 2e-5)
    assert dtype_tolerance("float64") == (10.0, 2e-5)
    k_bf16, abs_bf16 = dtype_tolerance("bfloat16")
    k_fp16, abs_fp16 = dtype_tolerance("float16")
    # calibrated (README "Low precision"): exact caches sit at ≤ 1.6× the floor, so k leaves room above them and
    # stays below the float32 rule's k; bf16 rounds 8× coarser than fp16, and both far above float32
    assert 2.0 < k_bf16 < DEFAULT_FACTOR and 2.0 < k_fp16 < DEFAULT_FACTOR
    assert abs_bf16 > abs_fp16 > 100 * DEFAULT_ABS_MIN


@pytest.mark.parametrize("faulty", faulty_dtypes.FAULTY, ids=lambda f: f.name)
def test_low_precision_fault_caught_by_its_half_case_and_passes_float32(faulty):
    results = {r.case: r for r in kvconform.check_cache(faulty.load(), models=[faulty.model], checks=[faulty.check],
                                                         cases=[faulty.case, FP32_CASE])}
    assert results[FP32_CASE].outcome == "passed", results[FP32_CASE].message  # invisible at float32
    caught = results[faulty.case]
    assert caught.outcome == "failed", (caught.outcome, caught.message)
    for fragment in faulty.message:
        assert fragment in caught.message, (fragment, caught.message)
    cause = [line.strip() for line in caught.message.splitlines() if line.strip().startswith("likely cause:")]
    assert len(cause) == 1 and re.search(faulty.cause, cause[0]), caught.message
    assert caught.dtype in ("bfloat16", "float16") and caught.batch == 2


def test_dynamic_cache_passes_the_cases_that_catch_them():
    from transformers import DynamicCache

    cases = sorted({f.case for f in faulty_dtypes.FAULTY})
    results = kvconform.check_cache(DynamicCache, models=["llama"], checks=["check_prefill_then_decode"], cases=cases)
    assert len(results) == len(cases) and all(r.outcome == "passed" for r in results), \
        [(r.case, r.outcome, r.message) for r in results]
    for r in results:  # within the dtype's bound, and the bound is k·floor of that dtype
        k, abs_min = dtype_tolerance(r.dtype)
        assert r.metrics["max_abs"] <= r.metrics["tolerance"] == max(k * r.metrics["noise_floor"], abs_min)


def test_dtype_counts_line():
    records = {str(i): {"dtype": d, "outcome": o} for i, (d, o) in enumerate(
        [("float32", "passed"), ("float32", "skipped"), ("bfloat16", "failed"), ("float16", "passed"),
         ("float64", "passed")])}
    assert dtype_counts(records) == ("items per dtype: float32 2 (1 ran), float64 1 (1 ran), bfloat16 1 (1 ran), "
                                     "float16 1 (1 ran)")
    assert dtype_counts({"a": {"outcome": "passed"}}) == ""  # an old report's records carry no dtype


def test_json_record_and_matrix_header_name_the_dtype(tmp_path):
    args = ["--kvconform", "-p", "no:cacheprovider", "-p", "no:randomly", "-q",
            "--kvconform-model", "llama", "--kvconform-subject", "DynamicCache", "--kvconform-json", "r.json",
            "-k", "prefill_then_decode and (bf16_decode_padded or decode_explicit_positions)"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env.update(KVCONFORM_WORKERS="0")
    proc = forkserver.run_pytest(args, cwd=tmp_path, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = {r["case"]: r for r in json.loads((tmp_path / "r.json").read_text())["results"]
               if r["subject"] == "DynamicCache"}
    assert (records["bf16_decode_padded"]["dtype"], records["bf16_decode_padded"]["batch"]) == ("bfloat16", 2)
    assert (records["decode_explicit_positions"]["dtype"], records["decode_explicit_positions"]["batch"]) \
        == ("float32", 2)
    assert re.search(r"items per dtype: float32 \d+ \(\d+ ran\), bfloat16 \d+ \(\d+ ran\)", proc.stdout), \
        proc.stdout[-3000:]
