"""Lossy subjects: the fake-quant twin against the real backends, the quality metrics, and the plugin end to end
(quantized subjects within budget, offloaded subjects skipped on CPU, faulty quantized caches caught)."""

from __future__ import annotations

import json

import pytest
import torch

from kvconform import compat, known_faults
from kvconform.quant import (QUANTIZED, FakeQuantCache, QuantConfig, affine_roundtrip, group_size_for,
                             quality_metrics, quantized_factory, twin_factory)
from kvconform.testing import faulty_quant
from kvconform.zoo import build_zoo_model


def _has(module):
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a dotted name whose parent package is absent
        return False


HAS_QUANTO = _has("optimum.quanto")
NEEDS_QUANTO = pytest.mark.skipif(not HAS_QUANTO, reason="needs optimum-quanto (pip install kvconform[quanto])")
"""Tests of the quanto backend itself skip without the extra; the rest of this module runs without any extra (the
fake-quant twin, the metrics, the fp8 backend of transformers, and how the plugin skips what cannot run)."""


@NEEDS_QUANTO
@pytest.mark.parametrize("nbits", [2, 4])
@pytest.mark.parametrize("axis,group", [(0, 32), (-1, 16)])
def test_affine_roundtrip_is_bitwise_quanto(nbits, axis, group):
    from optimum import quanto

    x = torch.randn(2, 2, 12, 16, generator=torch.Generator().manual_seed(nbits))
    qtype = quanto.qint4 if nbits == 4 else quanto.qint2
    scale, shift = quanto.MaxOptimizer()(x, qtype, axis, group)
    expected = quanto.quantize_weight(x, qtype, axis, scale, shift, group).dequantize()
    got = affine_roundtrip(x, nbits, axis, group)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert torch.equal(got, expected)
    assert (got - x).abs().max() > 0  # it does quantize


def test_affine_roundtrip_refuses_groups_that_do_not_divide():
    with pytest.raises(ValueError, match="must be a divisor"):
        affine_roundtrip(torch.randn(1, 2, 3, 16), 4, 0, 64)  # 2 · 3 · 16 = 96 per row


def test_group_size_divides_every_length():
    assert group_size_for(build_zoo_model("llama").config) == 32  # 2 kv heads · head_dim 16
    assert group_size_for(build_zoo_model("gpt2").config) == 64  # 4 heads · 16


@pytest.mark.parametrize("name,qc", [q for q in QUANTIZED if q[1].backend != "hqq"],
                         ids=[name for name, qc in QUANTIZED if qc.backend != "hqq"])
def test_twin_equals_quantized_cache_bit_for_bit(name, qc):
    """Same ops (prefill, decodes across flushes, a chunk, a beam reorder) → identical logits, fp32, CPU."""
    if qc.backend == "quanto" and not HAS_QUANTO:
        pytest.skip("needs optimum-quanto (pip install kvconform[quanto])")
    zm = build_zoo_model("llama")
    subject, twin = quantized_factory(qc)(zm.config), twin_factory(qc)(zm.config)
    gen = torch.Generator().manual_seed(0)
    for i, n in enumerate([12, 1, 1, 1, 1, 1, 3, 1, 1]):
        ids = torch.randint(3, 128, (2, n), generator=gen)
        with torch.no_grad():
            a = zm.model(ids, cache=subject, use_cache=True).logits
            b = zm.model(ids, cache=twin, use_cache=True).logits
        assert torch.equal(a, b), f"{name}: step {i} differs by {(a - b).abs().max():.2e}"
        if i == 5:
            subject.reorder_cache(torch.tensor([1, 0]))
            twin.reorder_cache(torch.tensor([1, 0]))
    assert subject.get_seq_length() == twin.get_seq_length() == 22


def test_twin_runs_in_float64_and_refuses_crop_and_non_full_attention():
    zm = build_zoo_model("llama")
    twin = FakeQuantCache(zm.config, QuantConfig("quanto", nbits=4))
    with torch.no_grad():
        out = zm.oracle_model()(torch.randint(3, 128, (2, 6)), cache=twin, use_cache=True).logits
    assert out.dtype == torch.float64 and twin.layers[0].q_keys.dtype == torch.float64
    with pytest.raises(NotImplementedError, match="not croppable"):
        twin.crop(-1)
    with pytest.raises(ValueError, match="full-attention layers only"):
        FakeQuantCache(build_zoo_model("mistral").config, QuantConfig("quanto", nbits=4))


def test_quality_metrics():
    ref = torch.randn(2, 5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    same = quality_metrics(ref, ref)
    assert same["kl_mean"] == pytest.approx(0, abs=1e-12) and same["top1"] == 1.0 and same["positions"] == 10
    flipped = quality_metrics(-ref, ref)
    assert flipped["kl_mean"] > 1 and flipped["top1"] == 0.0 and flipped["kl_worst"] >= flipped["kl_mean"]
    assert quality_metrics(ref * float("nan"), ref)["kl_mean"] == float("inf")


def test_reorder_fault_versions():
    """The replayed 5.5–5.18 reorder fault: the known-fault entry matches 5.16.1, not 5.19 or 5.24."""
    from packaging.version import Version

    faults = known_faults.load_known_faults()
    args = ("QuantizedCache_quanto4", "llama", "check_reorder_after_flush", "flush_then_reorder")
    assert "5.5-5.18" in known_faults.match(faults, Version("5.16.1"), *args)
    assert known_faults.match(faults, Version("5.19.0"), *args) is None
    assert known_faults.match(faults, Version("5.24.0"), *args) is None
    assert compat.quantized_reorder_fixed() == (compat.transformers_version().release >= (5, 19))


def _results(pytester, name="report.json"):
    return json.loads((pytester.path / name).read_text())["results"]


def test_quantized_subjects_within_budget_offloaded_skipped(run_kvconform, pytester, monkeypatch):
    """Default subjects on llama and gpt2: quantized ones pass the twin comparison and their quality budgets, the
    crop fault of transformers is an xfail naming it, HQQ and offloading skip with their reasons on CPU; without
    optimum-quanto the quanto subjects skip naming the extra, and the fp8 one (transformers' own) still runs."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # tiny models: one thread each, no oversubscription
    keep = ("(QuantizedCache and (decode_explicit_positions or quality_long or compression_long or generate_twin"
            " or flush_then_reorder or crop_after_flush)) or (offloaded and decode_explicit_positions)")
    result = run_kvconform("--kvconform-model", "llama", "--kvconform-model", "gpt2", "-k", keep,
                           "--kvconform-json", "report.json")
    assert result.ret == 0, result.stdout.str()[-3000:]
    results = _results(pytester)
    by = {(r["subject"], r["model"], r["case"]): r for r in results}
    assert not any(r["subject"] == "QuantizedCache_quanto2" for r in results)  # 2-bit: full tier only
    for subject in ("QuantizedCache_quanto4", "QuantizedCache_fp8"):
        if subject == "QuantizedCache_quanto4" and not HAS_QUANTO:
            mine = [r for r in results if r["subject"] == subject]
            assert mine and all(r["outcome"] == "skipped" and r["message"] ==
                                "requires optimum.quanto (pip install kvconform[quanto])" for r in mine), mine
            continue
        for model in ("llama", "gpt2"):
            quality = by[(subject, model, "quality_long")]
            assert quality["outcome"] == "passed", quality["message"]
            m = quality["metrics"]
            assert m["kl_mean"] <= m["kl_max"] and m["top1"] >= m["top1_min"]
            assert 0 < m["kl_mean"] and "twin_kl_mean" not in m  # the twin runs only to explain a failure
            compression = by[(subject, model, "compression_long")]
            assert compression["outcome"] == "passed", compression["message"]
            c = compression["metrics"]
            assert c["bytes_ratio"] <= c["bytes_ratio_max"] < 1 and c["bytes_held"] < c["bytes_exact"]
            for case in ("decode_explicit_positions", "generate_twin", "flush_then_reorder"):
                assert by[(subject, model, case)]["outcome"] == "passed", (subject, model, case)
            crop = by[(subject, model, "crop_after_flush")]
            assert crop["outcome"] == "xfailed" and "IndexError" in crop["message"]
    if HAS_QUANTO:
        assert by[("QuantizedCache_quanto4", "llama", "decode_explicit_positions")]["metrics"]["max_abs"] < 1e-4
    for r in results:
        if r["subject"].endswith("_offloaded"):
            assert r["outcome"] == "skipped" and r["message"] == "offloading needs CUDA"
        if r["subject"].startswith("QuantizedCache_hqq") and not _has("hqq"):
            assert r["outcome"] == "skipped" and r["message"] == "requires hqq (pip install kvconform[hqq])"


@NEEDS_QUANTO
def test_two_bit_subject_within_budget_in_the_full_tier():
    from kvconform import check_cache
    from kvconform.subjects import quantized_subjects

    quanto2 = next(s for s in quantized_subjects() if s.name == "QuantizedCache_quanto2")
    assert check_cache(quanto2, models=["llama"], cases=["quality_long"]) == []  # not in the default tier
    results = check_cache(quanto2, models=["llama", "gpt2"],
                          cases=["quality_long", "compression_long", "decode_explicit_positions"], full=True)
    assert len(results) == 6 and all(r.outcome == "passed" for r in results), [(r.id, r.message) for r in results]
    for r in results:
        if r.case == "quality_long":
            assert r.metrics["kl_mean"] <= r.metrics["kl_max"] and r.metrics["top1"] >= r.metrics["top1_min"]
        elif r.case == "compression_long":  # 2 bits + a float32 scale and shift per group (32 on llama, 64 on gpt2)
            assert r.metrics["bytes_ratio"] == pytest.approx({"llama": 0.125, "gpt2": 0.094}[r.model], abs=2e-3)
        else:
            assert r.metrics["max_abs"] == 0.0  # bit for bit its fake-quant twin


@NEEDS_QUANTO
def test_faulty_quantized_caches_are_caught():
    """Each faulty cache of kvconform.testing.faulty_quant fails its target check with the pinned message; the
    2-bit-keys cache is also over its quanto 4-bit quality budget on the long case (KL 1.1e-2, ten times its twin's),
    while the one-late flush stays within it (only the twin sees it). Run in-process through
    ``kvconform.check_cache`` (the plugin runs the same items)."""
    from kvconform import check_cache

    faulty = faulty_quant.FAULTY
    results = check_cache([f.spec for f in faulty],
                          models=sorted({f.model for f in faulty}),
                          checks=sorted({f.check for f in faulty} | {"check_quality_budget"}),
                          cases=sorted({f.case for f in faulty} | {"quality_long"}))
    by = {(r.subject, r.check, r.case, r.model): r for r in results}
    for f in faulty:
        r = by[(f.attr, f.check, f.case, f.model)]
        assert r.outcome == "failed", (f.name, r.outcome, r.message)
        for line in f.message:
            assert line in r.message, (f.name, line, r.message)
    keys2 = by[("KeysAt2BitsCache", "check_quality_budget", "quality_long", "llama")]
    assert keys2.outcome == "failed", keys2.message
    assert ("likely cause: the subject loses more than its declared quantization does: the fault is in the subject "
            "(its twin meets the budget)") in keys2.message
    assert keys2.metrics["twin_kl_mean"] <= keys2.metrics["kl_max"] < keys2.metrics["kl_mean"]
    late = by[("FlushOneLateCache", "check_quality_budget", "quality_long", "llama")]
    assert late.outcome == "passed" and late.metrics["kl_mean"] <= late.metrics["kl_max"]


def test_crop_fault_is_known_and_fails_under_strict():
    """transformers' QuantizedCache crop fault: an xfail naming it by default, a failure naming it under strict."""
    from kvconform import check_cache
    from kvconform.subjects import quantized_subjects

    fp8 = next(s for s in quantized_subjects() if s.name == "QuantizedCache_fp8")
    for strict, outcome in ((False, "xfailed"), (True, "failed")):
        (r,) = check_cache(fp8, models=["llama"], checks=["check_crop_refused"], cases=["crop_after_flush"],
                           strict=strict)
        assert r.outcome == outcome
        text = r.message
        assert "QuantizedCache layers declare is_croppable = False" in text
        if strict:
            assert "crop(-3) raised IndexError" in text and "known upstream fault: transformers>=5.5" in text
