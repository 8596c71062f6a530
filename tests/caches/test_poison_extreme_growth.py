"""The poisoned-capacity, zero-data and growth-step cases (``kvconform/checks/poison.py``, ``extreme.py``,
``growth.py``) on correct caches of other designs than transformers' own — a paged cache, a page pool, buffers grown
by 1,024 tokens, an evicting cache, lossy (quantized) ones — and the faults only the full-tier cases reach caught with
their cause (the growth fault, ``faulty_extreme.FULL_TIER_FAULTY``); the poison faults pinned to the default
``poison_nan`` case are run by ``test_faulty_caches.py``.

One ``pytest --kvconform --kvconform-full`` subprocess for every test here, its JSON report read per test.
"""

import json
import os
import re

import pytest

import forkserver

from kvconform.testing.faulty_extreme import FULL_TIER_FAULTY

CACHES = ["kvconform.testing.paged:PagedCache", "kvconform.testing.page_pool:PagePoolCache",
          "kvconform.testing.growth:GrowingCache", "kvconform.testing.growth:ResizeGrowCache",
          "kvconform.testing.evicting:SinkWindowCache", "kvconform.testing.lossy:Int8ResidualCache",
          *(f.spec for f in FULL_TIER_FAULTY)]
CHECKS = ("check_poisoned_capacity", "check_zero_key_rows", "check_growth_steps", "check_fp16_extreme")


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    folder = tmp_path_factory.mktemp("poison")
    args = ["--kvconform", "--kvconform-full", "-p", "no:cacheprovider",
            "-p", "no:randomly", "-q", "--kvconform-json", "r.json", "--kvconform-power", "off",
            "-k", "poisoned_capacity or zero_key_rows or growth_steps or fp16_extreme",
            "--kvconform-model", "llama", "--kvconform-model", "mistral"]
    for spec in CACHES:
        args += ["--kvconform-cache", spec]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env.update(KVCONFORM_WORKERS="0", PYTHONDONTWRITEBYTECODE="1")
    proc = forkserver.run_pytest(args, cwd=folder, env=env, timeout=1200)
    report = folder / "r.json"
    assert report.is_file(), f"no JSON report (exit {proc.returncode})\n{proc.stdout[-4000:]}{proc.stderr}"
    return [r for r in json.loads(report.read_text())["results"] if r["check"] in CHECKS]


def _outcomes(records, subject, check):
    return {(r["model"], r["case"]): r["outcome"] for r in records if r["subject"] == subject and r["check"] == check}


@pytest.mark.parametrize("subject", ["PagedCache", "PagePoolCache"])
def test_paged_designs_pass_every_poisoned_case(records, subject):
    """Their ``kvconform_poison`` hooks fill a last page's tail and (the pool) freed pages: NaN and 1e4 pass."""
    got = _outcomes(records, subject, "check_poisoned_capacity")
    assert got[("llama", "poison_nan")] == "passed", got
    assert got[("llama", "poison_large")] == "passed", got
    assert "failed" not in got.values(), got


@pytest.mark.parametrize("subject", ["DynamicCache", "StaticCache", "PagedCache", "PagePoolCache",
                                     "SinkWindowCache", "QuantizedCache_quanto4"])
def test_zero_key_rows_pass_on_correct_designs(records, subject):
    """Exact, paged, pooled, evicting (within its 64 tokens) and lossy (against its twin) caches pass."""
    assert _outcomes(records, subject, "check_zero_key_rows") == {("llama", "zero_key_rows"): "passed"}


def test_static_cache_gets_finite_poison_only(records):
    """kvconform fills StaticCache's tail with 1e4 (passed) and never NaN (skipped with the reason)."""
    got = _outcomes(records, "StaticCache", "check_poisoned_capacity")
    assert got[("llama", "poison_large")] == got[("mistral", "poison_ring_large")] == "passed", got
    assert got[("llama", "poison_nan")] == "skipped", got
    nan = next(r for r in records if r["subject"] == "StaticCache" and r["case"] == "poison_nan")
    assert "NaN × 0 is NaN" in nan["message"]


def test_growth_steps(records):
    """Buffers grown into new ones (GrowingCache), pages and a pool pass across 1,024 and 2,048 held tokens; buffers
    grown in place with resize_ (nanochat #187) fail right after their first growth."""
    for subject in ("GrowingCache", "PagedCache", "PagePoolCache", "DynamicCache", "StaticCache"):
        assert _outcomes(records, subject, "check_growth_steps") == {("llama", "growth_steps"): "passed"}, subject
    bad = next(r for r in records if r["subject"] == "ResizeGrowCache" and r["check"] == "check_growth_steps")
    assert bad["outcome"] == "failed" and "[failed at chunk(500)]" in bad["message"], bad["message"]


@pytest.mark.parametrize("subject", ["DynamicCache", "StaticCache", "PagedCache", "Int8ResidualCache",
                                     "QuantizedCache_quanto4", "SinkWindowCache"])
def test_fp16_extreme_passes_on_correct_designs(records, subject):
    """Keys/values near 2e4 in float16: exact, paged, lossy (vs a fresh instance / its twin) and evicting pass."""
    assert _outcomes(records, subject, "check_fp16_extreme") == {("llama", "fp16_extreme"): "passed"}


@pytest.mark.parametrize("faulty", FULL_TIER_FAULTY, ids=lambda f: f.name)
def test_full_tier_faulty_caught_with_cause(records, faulty):
    """A length counted from non-zero keys and a scale computed in float16 fail their case, naming the cause."""
    target = [r for r in records if r["subject"] == faulty.attr and r["case"] == faulty.case]
    assert target and target[0]["outcome"] == "failed", target
    for fragment in faulty.message:
        assert fragment in target[0]["message"], (fragment, target[0]["message"])
    cause = [line.strip() for line in target[0]["message"].splitlines() if line.strip().startswith("likely cause:")]
    assert len(cause) == 1 and re.search(faulty.cause, cause[0]), cause
