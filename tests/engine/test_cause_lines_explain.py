"""Cause lines that used to point the wrong way, each pinned on a faulty cache of kvconform's own with the same design
fault (``kvconform.testing.faulty_explain``), next to a correct cache of the same design that passes the same item:

- a step that failed before the case's crop / deep copy ran is not blamed on them;
- the oracle line compares the reference at the subject's failing step (a reference that fails only later does
  not make the model the culprit);
- a reset that keeps its length is named as such, not as pages reset() did not free;
- a batch op that skipped a layer is shown with that layer's tensors;
- a codec that stores what it decodes is not said to keep "a dequantized view besides its compressed data";
- a batch size pinned at construction is not a layer count sized from encoder_layers;
- get_max_length() raising from its first call does not "change over the cache's life";
- a read-only batch_size property is not a keyword-argument problem;
- activate_past_recording() not forwarded by a wrapper is not blamed on is_croppable;
- a paged prefill's Python loop is named a loop over pages, not per token;
- the end-of-run hint and the narrow-dtype cause invite a lossy declaration only where the bytes say compression;
- a KL within its budget never reads like a second violation.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvconform.api import check_cache

FAULTY = "kvconform.testing.faulty_explain"


def _cause_line(message: str) -> str:
    [line] = [line.strip() for line in message.splitlines() if line.strip().startswith("likely cause:")]
    return line


def _one(spec, model, check, case):
    [result] = check_cache(spec, models=[model], checks=[check], cases=[case])
    return result


def _failed(name, model, check, case):
    result = _one(f"{FAULTY}:{name}", model, check, case)
    assert result.outcome == "failed", result.message
    return result


def test_a_failure_at_the_prefill_is_not_blamed_on_a_later_crop_or_deep_copy():
    crop = _failed("TailSlipCache", "llama", "check_crop_then_continue", "crop_short")
    assert "[failed at prefill(4)]" in crop.message, crop.message
    line = _cause_line(crop.message)
    assert "before crop(-2) ran" in line and "removed the wrong tokens" not in line, line
    fork = _failed("TailSlipCache", "llama", "check_prefix_fork", "prefix_fork_steps")
    assert "[failed at prefill(8)]" in fork.message, fork.message
    line = _cause_line(fork.message)
    assert "before fork ran" in line and "deep copy does not hold" not in line, line
    # the same design without the slip (transformers' DynamicCache) passes both items
    for check, case in (("check_crop_then_continue", "crop_short"), ("check_prefix_fork", "prefix_fork_steps")):
        assert _one("transformers:DynamicCache", "llama", check, case).outcome == "passed"


def test_the_oracle_line_compares_the_reference_at_the_subjects_failing_step():
    """bamba without position_ids: the reference fails from decode 1 (the model's known fault); the subject fails at
    its prefill, where the reference is exact: the fault there is the subject's, and the message says so once."""
    r = _failed("TailSlipCache", "bamba", "check_prefill_then_decode", "decode_implicit_positions")
    oracle = next(line for line in r.message.splitlines() if line.strip().startswith("oracle:"))
    if "fails only later" not in oracle:
        pytest.skip(f"the reference does not fail later on this transformers: {oracle.strip()}")
    assert "the fault is in the model" not in r.message, r.message
    assert "→ the fault at prefill(12) is in the subject" in oracle, oracle
    assert r.metrics.get("model_at_fault") is False


def test_a_reset_that_keeps_the_length_is_not_pages_left_unfreed():
    r = _failed("ResetKeepsLengthPagedCache", "llama", "check_memory_bytes", "memory_decode")
    line = _cause_line(r.message)
    assert "reset() does not reset the length" in line and "get_seq_length() = 30" in line, line
    assert "pages are not freed" not in line, line
    assert _one("kvconform.testing.paged:PagedCache", "llama", "check_memory_bytes",
                "memory_decode").outcome == "passed"


def test_a_repeat_that_skips_the_last_layer_shows_that_layers_tensors():
    r = _failed("RepeatSkipsLastLayerCache", "llama", "check_repeat_then_decode", "repeat_padded")
    line = _cause_line(r.message)
    assert "(layers[1].keys: 2, layers[1].values: 2" in line and "repeat(2) did not resize" in line, line


def test_a_codec_that_stores_decoded_floats_is_not_said_to_keep_a_view_besides_compressed_data():
    r = _failed("DecodedStoreCache", "llama", "check_compression_real", "compression_long")
    line = _cause_line(r.message)
    assert "nothing is stored compressed" in line, line
    assert "besides its compressed data" not in line and "dequantized view" not in line, line


def test_a_batch_size_pinned_at_construction_is_no_layer_count():
    r = _failed("PinnedBatchCache", "llama", "check_prefill_then_decode", "decode_explicit_positions")
    line = _cause_line(r.message)
    assert "sized for another batch before any batch op" in line, line
    assert "encoder_layers" not in line and "layers, but the model's decoder" not in line, line


def test_get_max_length_raising_from_its_first_call_does_not_change_over_its_life():
    r = _failed("MaxLengthMissingCache", "llama", "check_length_bookkeeping", "length_bookkeeping")
    line = _cause_line(r.message)
    assert "raises from its first call" in line and "changes over the cache's life" not in line, line


def test_a_read_only_batch_size_property_is_not_a_keyword_argument_problem():
    from transformers import Cache

    if not isinstance(getattr(Cache, "batch_size", None), property):
        pytest.skip("this transformers' Cache has no batch_size property: the assignment is allowed")
    r = _failed("BatchSizeFieldCache", "llama", "check_prefill_then_decode", "decode_explicit_positions")
    line = _cause_line(r.message)
    assert "assigns self.batch_size, a read-only property" in line, line
    assert "keyword arguments kvconform passes" not in line, line


def test_past_recording_not_forwarded_is_not_blamed_on_is_croppable():
    r = _failed("RecordingNotForwardedCache", "mistral", "check_crop_contract", "crop_past_window_recording")
    line = _cause_line(r.message)
    assert "did not reach its layers" in line and "is_croppable does not account" not in line, line
    assert _one("transformers:DynamicCache", "mistral", "check_crop_contract",
                "crop_past_window_recording").outcome == "passed"


def test_a_paged_prefill_loop_is_named_a_loop_over_pages_not_per_token():
    """The speed family's prefill cause reads the storage one untimed prefill leaves: a paged layer holds one tensor
    per page (a loop over pages), a per-token list one per token; a layer of one tensor keeps the general reading."""
    import torch
    from transformers import DynamicCache
    from transformers.cache_utils import Cache, DynamicLayer

    from kvconform.checks._drive import random_tokens
    from kvconform.checks.speed import _prefill_loop_cause
    from kvconform.subjects import as_cache_spec
    from kvconform.testing.paged import PagedCache
    from kvconform.zoo import build_zoo_model


    class _ListLayer(DynamicLayer):
        """Keeps one tensor per token in lists (what a per-token loop leaves)."""

        def update(self, key_states, value_states, *args, **kwargs):
            keys, values = super().update(key_states, value_states, *args, **kwargs)
            self.key_list = list(keys.split(1, dim=-2))
            self.value_list = list(values.split(1, dim=-2))
            return keys, values

    class PerTokenListCache(Cache):
        def __init__(self, config=None, **kwargs):
            super().__init__(layers=[_ListLayer() for _ in range(config.num_hidden_layers)])

    zm = build_zoo_model("llama")
    context = 64
    tokens = random_tokens(torch.Generator().manual_seed(0), 1, context, zm.vocab_size)

    def cause(cls):
        ctx = SimpleNamespace(model=zm, subject=as_cache_spec(cls), case=SimpleNamespace(batch=1))
        return _prefill_loop_cause(ctx, tokens, context)

    paged = cause(PagedCache)
    assert paged.startswith("the prefill loops in Python over the pages of its paged storage") and \
        "about 4 tokens each" in paged, paged
    per_token = cause(PerTokenListCache)
    assert per_token.startswith("the prefill does work per token in Python: after prefill(64) its first layer "
                                "holds"), per_token
    assert cause(DynamicCache).startswith("the prefill does work per token in Python — update() loops"), \
        cause(DynamicCache)


def _digest(name):
    return SimpleNamespace(subjects=[SimpleNamespace(name=name, kind="exact", builtin=False)])


def _records(name, memory_metrics):
    fams = ("logits", "crop", "batch")
    out = {f"{name}-{f}": {"subject": name, "family": f, "outcome": "failed", "metrics": {"max_abs": 1.2}}
           for f in fams}
    if memory_metrics is not None:
        out[f"{name}-memory"] = {"subject": name, "family": "memory", "outcome": "passed", "metrics": memory_metrics}
    return out


def test_the_hint_invites_a_lossy_declaration_only_where_the_bytes_say_compression():
    from kvconform.report import undeclared_kind_hints

    [exact] = undeclared_kind_hints(_records("Buggy", {"bytes_held": 6144, "bytes_formula": 6144}), _digest("Buggy"))
    assert "exact cache with a bug, not a lossy one" in exact and "would hide the bug" in exact, exact
    assert "kvconform_lossy = {" not in exact, exact
    [small] = undeclared_kind_hints(_records("Int8", {"bytes_held": 1600, "bytes_full_precision": 6144}),
                                    _digest("Int8"))
    assert "0.26× the bytes of full-precision keys/values" in small and "kvconform_lossy = {" in small, small
    [unknown] = undeclared_kind_hints(_records("Unmeasured", None), _digest("Unmeasured"))
    assert "-m kvconform_memory" in unknown and "fewer bytes" in unknown, unknown


def test_a_kl_within_its_budget_reads_as_within_it():
    from kvconform.checks.quality import _budget_lines

    lines = _budget_lines({"kl_mean": 1.95e-3, "top1": 0.81, "positions": 64}, 4e-3, 0.9, "declared")
    assert lines[0] == "top-1 agreement = 0.810, but should be ≥ 0.900", lines
    assert lines[1].startswith("KL(oracle ‖ subject) = 1.95e-03 nats (mean of 64 positions) is within the budget"), \
        lines
    assert "but should be" not in lines[1], lines
    both = _budget_lines({"kl_mean": 5e-3, "top1": 0.5, "positions": 64}, 4e-3, 0.9, "declared")
    assert all("but should be" in line for line in both), both


def test_the_padded_row_of_a_press_is_checked_where_the_press_compresses():
    """A KnormPress-style press keeping a share of the padded width (``NormPress``): at a 12-token prefill with pads
    [0, 3] it drops the same tokens from the padded row and from the row alone (the old single length passed it at
    1e-15); the default lengths (12-15) reach 13, where it drops 4 and 3, and the cause says so. A correct press of
    another design (kvconform's ``TailPress``, which refuses a padded prefill clearly) passes."""
    import dataclasses

    from kvconform.session import build_session

    session = build_session(caches=[f"{FAULTY}:NormPress"], models=["llama"], checks=["check_padded_row_alone"])
    [item] = [i for i in session.items() if not i.skip and i.subject.name == "NormPress"]
    assert item.case.params["prefill"] == [12, 13, 14, 15], item.case.params
    at_12 = dataclasses.replace(item, case=dataclasses.replace(item.case, params={**item.case.params, "prefill": 12}))
    assert session.run(at_12)["max_abs"] < 1e-12  # what the single 12-token run measured: no difference
    r = _failed("NormPress", "llama", "check_padded_row_alone", "padded_row_alone")
    assert r.metrics["prefill"] == 13, r.metrics
    assert "the cache keeps a share of the padded length, its 3 pads counted as prompt" in _cause_line(r.message)
    assert _one("kvconform.testing.press:TailPress", "llama", "check_padded_row_alone",
                "padded_row_alone").outcome == "passed"
