"""Model sources (``kvconform.sources``): what a ``--kvconform-model`` value names is a registered class, asked by
the plan, the session, the workers and the options instead of the spec string. Real specs, real folders, the real
check registry: which class recognises which spec, the usage errors each one owns, the facts the callers read, and
the checks that say themselves that they do not apply to a model outside transformers (``transformers_only``)."""

import os
import re
from pathlib import Path

import pytest

from kvconform import zoo
from kvconform.plan import ModelInfo, external, spec_problem
from kvconform.sources import SOURCES, ModelSource, register_source, source_of

ADAPTER = "kvconform.examples.tiny_decoder:TinyDecoder"


@pytest.mark.parametrize("spec, name", [
    ("llama", "zoo"), ("llava", "zoo"), ("./llama", "checkpoint"), ("~/ckpt", "checkpoint"), ("nosuch", "checkpoint"),
    ("transformers:llama", "architecture"), ("transformers:*", "architecture"), (ADAPTER, "adapter"),
    ("tests/subjects/scratch_litgpt.py:LitGPT", "adapter"),
])
def test_each_spec_is_recognised_by_one_source_class(spec, name):
    assert source_of(spec).name == name
    assert sum(cls.recognises(spec) for cls in SOURCES if cls.name != "checkpoint") <= 1  # the folder: the rest


def test_the_facts_the_callers_read_come_from_the_source():
    adapter, zoo_source, folder = source_of(ADAPTER), source_of("llama"), source_of("./ckpt")
    assert (adapter.has_reference, adapter.transformers_faults, adapter.runs_in_process, adapter.brings_subjects,
            adapter.adapter_spec, adapter.folder()) == (False, False, True, True, ADAPTER, None)
    assert (zoo_source.has_reference, zoo_source.transformers_faults, zoo_source.brings_subjects,
            zoo_source.adapter_spec, zoo_source.folder()) == (True, True, False, None, None)
    assert folder.folder() == os.path.expanduser("./ckpt") and not folder.runs_in_process
    # external: every model outside the zoo (its case scope and known faults by kind)
    assert [external(s) for s in ("llama", "llava", "./ckpt", "transformers:llama", ADAPTER)] == [
        False, False, True, True, True]
    info = ModelInfo("llama", "llama", ("full_attention",), False, True)
    assert info.source.name == "zoo" and info.model_config().model_type == "llama"


def test_each_source_owns_its_usage_error_naming_the_spec_and_the_fix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert spec_problem("llama") is None and spec_problem(ADAPTER) is None and spec_problem("transformers:x*") is None
    assert "'lama': not a zoo name (did you mean 'llama'?)" in spec_problem("lama")
    assert "a model written from scratch is named MODULE:ATTR, e.g. my.pkg:Model" in spec_problem("my.pkg.Model")
    assert spec_problem("missing.py:Model") == "--kvconform-model 'missing.py:Model': file 'missing.py' does not exist"
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text("{}")
    assert "both a zoo family and a checkpoint folder here; write ./llama" in spec_problem("llama")


def test_a_source_registered_from_one_class_is_asked_in_its_order():
    @register_source
    class Ring(ModelSource):
        name, order = "test-ring", 5

        @classmethod
        def recognises(cls, spec):
            return spec.startswith("ring:")

        def problem(self, trust_remote_code=False):
            return f"--kvconform-model {self.spec!r}: no ring here"

    try:
        assert source_of("ring:x").name == "test-ring" and SOURCES[0] is Ring
        assert spec_problem("ring:x") == "--kvconform-model 'ring:x': no ring here"
        assert source_of("llama").name == "zoo"
    finally:
        SOURCES.remove(Ring)
    with pytest.raises(TypeError, match="ModelSource subclass with a name"):
        register_source(type("NoKind", (ModelSource,), {}))


def test_checks_that_need_transformers_or_the_full_tier_say_so_themselves_and_the_adapter_source_reads_it():
    from kvconform.cases import load_cases
    from kvconform.checks import load_checks

    registry = load_checks()
    only = {name: c.transformers_only for name, c in registry.items() if c.transformers_only}
    assert {c.family for c in registry.values() if c.family in ("coverage", "speculative")} == {
        "coverage", "speculative"}
    assert all(name in only for name, c in registry.items() if c.family in ("coverage", "speculative"))
    assert {"check_beam_search", "check_mamba_kernel_paths", "check_offloaded_matches",
            "check_encoder_decoder_subcaches", "check_speed_compiled_static"} <= set(only)
    case = next(c for c in load_cases() if c.check == "check_beam_search")
    reason = source_of(ADAPTER).not_applicable(registry["check_beam_search"], case)
    assert reason == ("not for a model outside transformers: beam search is transformers' generate(num_beams > 1); "
                      "kvconform decodes a from-scratch model greedily")
    assert source_of("llama").not_applicable(registry["check_beam_search"], case) is None
    # the checks a from-scratch model gets in the full tier only say so themselves (its default tier's budget)
    full_only = sorted(name for name, c in registry.items() if c.adapter_full_tier)
    assert full_only == ["check_compile_claim", "check_compile_static_decode", "check_speed_flat_decode",
                         "check_speed_prefill"]
    assert not source_of(ADAPTER).in_default_tier(registry["check_compile_claim"])
    assert source_of(ADAPTER).in_default_tier(registry["check_speed_vs_uncached"])
    assert source_of("llama").in_default_tier(registry["check_compile_claim"])


def test_no_module_tests_a_spec_string_for_a_model_adapter_outside_the_source_classes():
    root = Path(__file__).resolve().parents[2] / "kvconform"
    found = [str(p.relative_to(root)) for p in root.rglob("*.py") if re.search(r"is_scratch_spec\(", p.read_text())
             and p.parent.name not in ("scratch", "sources")]
    assert not found, found
    assert zoo.is_checkpoint_spec("./x")  # the zoo's own test stays: the sources ask it
