"""Proof on real packages: published lossy caches run as kvconform lossy subjects, and the verdicts they get.

* turboquant 0.2.0's ``TurboQuantCache`` (skipped with a reason where turboquant is not installed), declared lossy
  with a budget measured here, on the long cases (240 tokens: it keeps its last 128 tokens exact, so 112 of them are
  quantized by the end):
  - its quality is within its budget (3-bit: KL 1.5e-2, top-1 0.70 on llama; 6.4e-4, 0.96 on gpt2; 4-bit: 4.9e-3,
    0.84 / 2.1e-4, 0.97);
  - its compression is NOT real: every layer keeps the dequantized float32 view of every token (``layers[i].keys`` /
    ``.values``, set in ``update``) besides its uint8 indices, 1.68× an exact cache's bytes; the same class without
    that view (``tests/_turboquant.py: TQLean``) holds 0.68×, and passes;
  - built the way a user passing the model config would (``TurboQuantCache(bits=3, config=config)``) it never
    quantizes (``DynamicCache.__init__`` pre-builds plain layers): quality passes (it is exact), compression fails.
* the built-in HQQ and quanto ``QuantizedCache`` subjects run *without* their fake-quant twins, as any published
  lossy cache would: quality and compression pass within their budgets.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest

from kvconform import check_cache

HERE = os.path.dirname(os.path.dirname(__file__))  # tests/, where _turboquant.py lives
CASES = ["quality_long", "compression_long"]


@pytest.fixture(scope="module")
def tq():
    pytest.importorskip("scipy", reason="turboquant 0.2.0 needs scipy (pip install turboquant==0.2.0)")
    pytest.importorskip("turboquant", reason="turboquant is not installed (pip install turboquant==0.2.0)")
    sys.path.insert(0, HERE)
    try:
        import _turboquant
    finally:
        sys.path.remove(HERE)
    return _turboquant


@pytest.fixture(scope="module")
def tq_results(tq):
    specs = [tq.spec("TurboQuant3", tq.tq3), tq.spec("TurboQuant4", tq.tq4, tq.TQ4_BUDGET),
             tq.spec("TurboQuant3Config", tq.tq3_cfg),
             tq.spec("TurboQuant3Lean", tq.tq3_lean, capabilities={"forward"})]
    results = check_cache(specs, models=["llama", "gpt2"], cases=CASES)
    for r in results:
        print(r.subject, r.model, r.check, r.outcome, {k: v for k, v in r.metrics.items()
                                                       if k in ("kl_mean", "top1", "bytes_ratio", "bytes_held")})
    return {(r.subject, r.check, r.model): r for r in results}


@pytest.mark.parametrize("model", ["llama", "gpt2"])
@pytest.mark.parametrize("subject", ["TurboQuant3", "TurboQuant4"])
def test_turboquant_quality_is_within_its_budget(tq_results, subject, model):
    r = tq_results[(subject, "check_quality_budget", model)]
    assert r.outcome == "passed", r.message
    assert r.metrics["tokens"] == 240 and r.metrics["positions"] == 128
    assert 1e-5 < r.metrics["kl_mean"] <= r.metrics["kl_max"]  # it does quantize: not exact


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_turboquant_keeps_a_float_copy_so_its_compression_is_not_real(tq_results, model):
    r = tq_results[("TurboQuant3", "check_compression_real", model)]
    assert r.outcome == "failed", r.message
    assert r.metrics["bytes_ratio"] == pytest.approx(1.68, abs=0.01)
    text = r.message
    assert f"check_compression_real failed: TurboQuant3 on {model} (fp32, batch 2), case compression_long" in text
    assert "an exact cache must hold, but should be < 1 (no bytes_ratio_max declared" in text
    assert "largest tensors held: layers[0].keys float32 [2, " in text
    # turboquant 0.2.0 holds its codes as float32 too: no tensor over the tokens is narrower than the model's dtype
    assert ("likely cause: nothing is stored compressed: every tensor the cache holds over the tokens is in the "
            "model's dtype (layers[0].keys, layers[0].values, ...: float32 over all 240 tokens)") in text
    lean = tq_results[("TurboQuant3Lean", "check_compression_real", model)]
    assert lean.outcome == "passed", lean.message
    # 128 exact float32 tokens + 144 tokens at one uint8 index an element and a float32 norm a (row, head, token)
    assert lean.metrics["bytes_ratio"] == pytest.approx(0.68, abs=0.01)


def test_turboquant_built_with_the_config_never_quantizes(tq_results):
    quality = tq_results[("TurboQuant3Config", "check_quality_budget", "llama")]
    assert quality.outcome == "passed" and quality.metrics["kl_mean"] < 1e-9  # exact: nothing was quantized
    r = tq_results[("TurboQuant3Config", "check_compression_real", "llama")]
    assert r.outcome == "failed", r.message
    assert "1.000× the 245,760 B an exact cache must hold" in r.message
    assert "likely cause: nothing is compressed: the cache holds what an exact cache holds" in r.message


def test_turboquant_generate_items_skip_with_what_judges_them(tq):
    (r,) = check_cache(tq.spec("TurboQuant3", tq.tq3), models=["llama"], checks=["check_generate_greedy"])
    assert r.outcome == "skipped"
    assert r.message.startswith("TurboQuant3 is lossy: its greedy generate() is not compared token for token")


@pytest.mark.parametrize("name", ["QuantizedCache_hqq4", "QuantizedCache_quanto4"])
def test_builtin_quantized_caches_pass_as_lossy_subjects_without_twin(name):
    from kvconform.subjects import quantized_subjects

    spec = next(s for s in quantized_subjects() if s.name == name)
    for module in spec.requires:
        pytest.importorskip(module.split(":")[0])
    bare = dataclasses.replace(spec, name=name + "_bare", twin=None)  # judged as any published lossy cache
    results = check_cache(bare, models=["llama", "gpt2"], cases=CASES)
    assert len(results) == 4, [(r.id, r.outcome, r.message) for r in results]
    for r in results:
        assert r.outcome == "passed", r.message
        if r.check == "check_quality_budget":
            assert "twin_kl_mean" not in r.metrics and 0 < r.metrics["kl_mean"] <= spec.budget.kl_max
        else:
            assert r.metrics["bytes_ratio"] <= spec.budget.bytes_ratio_max


# ------------------------------------------------------------------------------------------ turboquant's cache ops
# What self-consistency (a fresh instance of the same class fed the equivalent history, in lock-step) sees in
# turboquant 0.2.0: TurboQuantLayer inherits crop / reorder_cache from DynamicLayer, which act on ``keys`` /
# ``values`` only — the view that the next ``update`` rebuilds from the quantized indices and the exact residual,
# which they did not touch. So crop and reorder are undone at the next step, and reset() leaves ``_total_len`` counting
# (a new sequence then fails: its mask is sized for the old length).
# Measured here with the raw model (the self-consistency checks judge the same through kvconform's cases).
def _tq_forward(zm, cache, ids, start):
    import torch

    from kvconform.compat import cache_kwarg

    positions = torch.arange(start, start + ids.shape[1]).expand(ids.shape[0], -1)
    with torch.no_grad():
        out = zm.model(input_ids=ids, position_ids=positions, use_cache=True, **{cache_kwarg(zm.model): cache})
    return out.logits.double()


@pytest.fixture(scope="module")
def tq_llama(tq):
    import torch

    from kvconform.zoo import build_zoo_model

    zm = build_zoo_model("llama")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (2, 177), generator=gen)  # 176 in the cache (48 quantized) + one next token
    return zm, ids


def test_turboquant_reorder_is_undone_by_the_next_update(tq, tq_llama):
    import torch

    zm, ids = tq_llama
    cache = tq.tq3()
    _tq_forward(zm, cache, ids[:, :176], 0)
    cache.reorder_cache(torch.tensor([1, 0]))
    after = _tq_forward(zm, cache, ids[[1, 0], 176:], 176)[:, -1]
    fresh = tq.tq3()  # the equivalent history: the rows swapped from the start
    _tq_forward(zm, fresh, ids[[1, 0], :176], 0)
    expected = _tq_forward(zm, fresh, ids[[1, 0], 176:], 176)[:, -1]
    delta = float((after - expected).abs().max())
    assert delta > 0.1, delta  # the rows' histories were not swapped: a full-size fault, not quantization noise
    control = tq.tq3()  # the same class without the reorder agrees with itself to float noise
    _tq_forward(zm, control, ids[[1, 0], :176], 0)
    assert float((_tq_forward(zm, control, ids[[1, 0], 176:], 176)[:, -1] - expected).abs().max()) < 1e-5


def test_turboquant_crop_is_undone_by_the_next_update(tq, tq_llama):
    zm, ids = tq_llama
    cache = tq.tq3()
    _tq_forward(zm, cache, ids[:, :176], 0)
    cache.crop(-16)  # back to 160 tokens: the next token is fed at position 160
    assert cache.get_seq_length() == 176  # _total_len is not cropped either
    after = _tq_forward(zm, cache, ids[:, 176:], 160)[:, -1]
    assert cache.layers[0].keys.shape[-2] == 177  # attention read all 176 tokens + the new one
    fresh = tq.tq3()
    _tq_forward(zm, fresh, ids[:, :160], 0)
    expected = _tq_forward(zm, fresh, ids[:, 176:], 160)[:, -1]
    assert float((after - expected).abs().max()) > 0.05


def test_turboquant_reset_keeps_counting(tq, tq_llama):
    zm, ids = tq_llama
    cache = tq.tq3()
    _tq_forward(zm, cache, ids[:, :176], 0)
    cache.reset()
    assert cache.get_seq_length() == 176 and tq.tq3().get_seq_length() == 0  # _total_len survives reset()
    # a new sequence into the reset cache: the mask is sized for 176 + 8 keys, attention gets 8
    with pytest.raises(RuntimeError, match=r"size of tensor a \(8\) must match the size of tensor b \(184\)"):
        _tq_forward(zm, cache, ids[:, :8], 0)
