"""The coverage family end to end: every cache_implementation string green on the installed transformers, the drift
detector failing on a string or layer type it does not know, the encoder-decoder sub-cache check, and the hardware
gates (offloading, mamba-ssm kernels) skipping with their reasons on CPU."""

from __future__ import annotations

import json

import pytest

from kvconform.checks.coverage import covered_implementations


def _results(pytester, name="report.json"):
    return json.loads((pytester.path / name).read_text())["results"]


def test_every_listed_string_has_a_case():
    from transformers.generation.configuration_utils import ALL_CACHE_IMPLEMENTATIONS

    assert set(ALL_CACHE_IMPLEMENTATIONS) <= set(covered_implementations())


def test_coverage_family_green_and_hardware_gates(run_kvconform, pytester, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # tiny models: one thread each, no oversubscription
    result = run_kvconform("--kvconform-model", "llama", "--kvconform-model", "gemma3", "--kvconform-model", "t5",
                           "--kvconform-model", "bart", "--kvconform-model", "mamba",
                           "-m", "kvconform_coverage or kvconform_contract or kvconform_memory or kvconform_logits",
                           "-k", "impl_ or covered or encdec or offload_decode or mamba_kernels",
                           "--kvconform-json", "report.json")
    assert result.ret == 0, result.stdout.str()[-3000:]
    results = _results(pytester)
    ran = [r for r in results if r["outcome"] != "skipped"]
    assert ran and all(r["outcome"] == "passed" for r in ran), [(r["nodeid"], r["outcome"]) for r in ran]
    impl = {(r["case"], r["model"]): r for r in ran if r["check"] == "check_cache_implementation"}
    from transformers.generation.configuration_utils import ALL_CACHE_IMPLEMENTATIONS

    on_cpu = [s for s in ALL_CACHE_IMPLEMENTATIONS if "offloaded" not in s]
    assert {c.removeprefix("impl_") for c, _ in impl} == set(on_cpu)
    assert impl[("impl_static", "t5")]["metrics"]["built"] == "StaticCache"
    assert impl[("impl_quantized", "llama")]["metrics"]["compared_with"] == "generate(cache=fake-quant twin)"
    drift = {r["check"]: r for r in ran if r["check"].endswith("_covered")}
    assert set(drift) == {"check_cache_implementations_covered", "check_layer_types_covered"}
    assert drift["check_cache_implementations_covered"]["subject"] == "ReferenceCache"
    assert {"indexed_attention", "hybrid_sliding", "dummy"} >= set(drift["check_layer_types_covered"]["metrics"]
                                                                    ["known_gaps"])
    encdec = {(r["subject"], r["model"]) for r in ran if r["check"] == "check_encoder_decoder_subcaches"}
    assert {("ReferenceCache", "t5"), ("DynamicCache", "bart"), ("StaticCache", "t5")} <= encdec
    skipped = {r["message"] for r in results if r["outcome"] == "skipped"}
    gated = [r for r in results if (r["subject"], r["case"]) in {
        ("DynamicCache_offloaded", "impl_offloaded"), ("StaticCache_offloaded", "impl_offloaded_static"),
        ("DynamicCache_offloaded", "offload_decode"), ("StaticCache_offloaded", "offload_decode")}]
    assert gated and all(r["outcome"] == "skipped" and r["message"] == "offloading needs CUDA" for r in gated)
    assert all(r["outcome"] == "skipped" for r in results if r["check"] == "check_mamba_kernel_paths")
    assert "mamba-ssm kernels need CUDA and the [mamba] extra (pip install kvconform[mamba])" in skipped


def test_drift_detector_names_new_strings_and_layer_types(monkeypatch):
    """A transformers that lists a cache implementation and a layer type kvconform does not know fails the two
    drift items, naming them; a generate() that builds another cache for a covered string fails that item."""
    import transformers.cache_utils as cu
    import transformers.generation.configuration_utils as gc
    import transformers.generation.utils as gu

    from kvconform import check_cache
    from kvconform.subjects import builtin_subjects

    class FutureLayer(cu.DynamicLayer):
        pass

    def static_is_now_dynamic(self, cache_implementation, batch_size, max_cache_len, **kwargs):
        return cu.DynamicCache(config=self.config.get_text_config(decoder=True))

    monkeypatch.setattr(gc, "ALL_CACHE_IMPLEMENTATIONS", gc.ALL_CACHE_IMPLEMENTATIONS + ("paged_future",))
    monkeypatch.setitem(cu.DYNAMIC_LAYER_TYPE_MAPPING, "future_attention", FutureLayer)
    monkeypatch.setattr(gu.GenerationMixin, "_prepare_static_cache", static_is_now_dynamic)
    subjects = [s for s in builtin_subjects() if s.name in ("ReferenceCache", "StaticCache")]
    results = check_cache(subjects, models=["llama"], cases=["implementations_covered", "layer_types_covered",
                                                               "impl_static"])
    by = {r.check: r for r in results if r.outcome != "skipped"}
    strings = by["check_cache_implementations_covered"]
    assert strings.outcome == "failed" and "'paged_future'" in strings.message
    assert "not covered by kvconform" in strings.message and strings.metrics["missing"] == ["paged_future"]
    layers = by["check_layer_types_covered"]
    assert layers.outcome == "failed" and "'future_attention'" in layers.message
    built = by["check_cache_implementation"]
    assert built.outcome == "failed"
    assert "built DynamicCache" in built.message and "but should build what StaticCache builds" in built.message


def test_offload_check_never_passes_without_cuda():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present: the check runs for real")
    from kvconform.checks import CheckContext, run_check
    from kvconform.subjects import offloaded_subjects
    from kvconform.session import skip_reason
    from kvconform.checks import load_checks
    from kvconform.cases import load_cases
    from kvconform.session import model_info

    check = load_checks()["check_offloaded_matches"]
    case = next(c for c in load_cases() if c.id == "offload_decode")
    subject = offloaded_subjects()[0]
    assert skip_reason(subject, model_info("llama"), check, case, device="cpu") == "offloading needs CUDA"
    with pytest.raises(Exception, match="offloading needs CUDA"):  # the guard's error, never a pass
        run_check("check_offloaded_matches", CheckContext(subject, None, case, None))
