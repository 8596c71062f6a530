"""Models written from scratch through a model adapter (``kvconform.scratch``, issue 32): the worked example passes
every family that applies, each faulty variant a from-scratch author writes is caught by the check that targets it
with a likely cause in the adapter's terms, and bad adapters get clear errors.

The plugin runs share one ``pytest --kvconform`` subprocess (the correct examples' whole default tier and the faulty
variants' target items); the hand checks run the example's own forwards in float64, in process.
"""

import json
import os
import textwrap

import pytest

import forkserver
import torch

from kvconform.examples.tiny_decoder import TinyDecoder, TinyMasklessDecoder, TinySlidingDecoder
from kvconform.testing import faulty_scratch

EXAMPLE = "kvconform.examples.tiny_decoder"
FAULTY = "kvconform.testing.faulty_scratch"
# faulty adapter → (model name, -k selection of its target item, check that catches it, words of its likely cause)
TARGETS = {
    "NoCausalMaskInChunk": ("no_causal_chunk", "chunked_continuation and chunk2", "check_chunked_continuation",
                            "causal mask applied only when the queries are as long as the keys"),
    "RingBufferChunks": ("ring_chunks", "chunked_continuation and chunk4_straddle_window",
                         "check_chunked_continuation", "ring buffer written before it is read"),
    "PositionsRestartAfterCrop": ("restart_positions", "crop_then_continue and crop_short", "check_crop_then_continue",
                                  "position counter kept in the cache that crop resets"),
    "AliasedFork": ("aliased_fork", "prefix_fork and prefix_fork_steps", "check_prefix_fork",
                    "copied shallowly"),
    "StaticSetupOnce": ("static_setup_once", "reset_then_reuse and reset_smaller_batch", "check_reset_then_reuse",
                        "a setup that returns early when buffers exist"),
    "SelectIgnoresRows": ("select_ignores_rows", "select_then_decode and select_unpadded", "check_select_then_decode",
                          "your select(cache, rows) does not move every tensor of every block to the rows asked"),
}
_RUN: dict = {}


def _kvconform(folder, *args, timeout=900):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env.update(PYTHONDONTWRITEBYTECODE="1")
    return forkserver.run_pytest(["--kvconform", "-p", "no:cacheprovider", "-p", "no:randomly", "-q", *args],
                                 cwd=folder, env=env, timeout=timeout)


def _shared_run(tmp_path_factory) -> dict:
    """One run: both correct examples (every item of their default tier) and each faulty variant's target item."""
    if not _RUN:
        folder = tmp_path_factory.mktemp("scratch")
        selection = " or ".join(["tiny_decoder", "tiny_sliding_decoder", "tiny_decoder_two_caches",
                                 "(tiny_maskless_decoder and (kvconform_batch or bf16 or fp16))",
                                 "(select_ignores_rows and kvconform_batch)"]
                                + [f"({model} and {sel})" for model, sel, _, _ in TARGETS.values()])
        args = ["--kvconform-json", "r.json", "-k", selection,
                "--kvconform-model", f"{EXAMPLE}:TinyDecoder", "--kvconform-model", f"{EXAMPLE}:TinySlidingDecoder",
                "--kvconform-model", f"{EXAMPLE}:TinyDecoderTwoCaches",
                "--kvconform-model", f"{EXAMPLE}:TinyMasklessDecoder"]
        for attr in TARGETS:
            args += ["--kvconform-model", f"{FAULTY}:{attr}"]
        proc = _kvconform(folder, *args)
        report = folder / "r.json"
        assert report.is_file(), f"no JSON report (exit {proc.returncode})\n{proc.stdout[-4000:]}{proc.stderr}"
        _RUN["records"] = json.loads(report.read_text())["results"]
        _RUN["stdout"] = proc.stdout
    return _RUN


@pytest.mark.parametrize("model", ["tiny_decoder", "tiny_sliding_decoder", "tiny_decoder_two_caches"])
def test_the_worked_example_passes_every_family_that_applies(model, tmp_path_factory):
    run = _shared_run(tmp_path_factory)
    records = [r for r in run["records"] if r["model"] == model]
    ran = [r for r in records if r["outcome"] not in ("skipped",)]
    bad = [(r["check"], r["case"], r["message"][:400]) for r in ran if r["outcome"] != "passed"]
    assert not bad, bad
    families = {r["family"] for r in ran}
    # every family that applies to an exact from-scratch cache ran and passed (coverage and quality do not apply)
    assert {"logits", "generate", "crop", "prefix", "batch", "lifecycle", "fuzz", "memory"} <= families
    if model != "tiny_sliding_decoder":  # the speed cases are scoped to full-attention models
        assert "speed" in families
    if model == "tiny_decoder_two_caches":  # two caches of one model, each checked
        assert {r["subject"] for r in ran} == {"TinyGrowingCache", "TinyStaticCache"}
    assert len(ran) >= 30, len(ran)
    skipped = [r for r in records if r["outcome"] == "skipped"]
    reasons = " ".join(r.get("message") or r.get("skip_reason") or "" for r in skipped)
    assert "not for a model outside transformers" in reasons, reasons[:2000]


@pytest.mark.parametrize("attr", sorted(TARGETS))
def test_each_faulty_from_scratch_cache_is_caught_by_name(attr, tmp_path_factory):
    model, _, check, cause = TARGETS[attr]
    run = _shared_run(tmp_path_factory)
    records = [r for r in run["records"] if r["model"] == model]
    failed = [r for r in records if r["outcome"] == "failed"]
    assert failed, f"{attr} was not caught: {[(r['check'], r['case'], r['outcome']) for r in records]}"
    target = [r for r in failed if r["check"] == check]
    assert target, [(r["check"], r["case"]) for r in failed]
    message = target[0]["message"]
    assert "likely cause: " in message and cause in message, message
    assert f"--kvconform-model {FAULTY}:{attr}" in message and "--kvconform-cache" not in message, message


def test_a_maskless_model_runs_the_unpadded_twins_and_they_catch_a_select_that_ignores_its_rows(tmp_path_factory):
    """``takes_mask = False``: the left-padded batch and low-precision items skip, their unpadded twins run — and
    pass on the correct maskless example, while a ``select`` that keeps the first rows in their old order fails every
    batch op of them (the padded cases, all skipped, could not see it)."""
    run = _shared_run(tmp_path_factory)
    good = {r["case"]: r for r in run["records"] if r["model"] == "tiny_maskless_decoder"}
    unpadded = {c for c in good if c.endswith("_unpadded")}
    assert {"reorder_unpadded", "swap_rows_unpadded", "beam_fork_unpadded", "repeat_unpadded", "select_unpadded",
            "bf16_reorder_unpadded", "fp16_reorder_unpadded", "bf16_decode_unpadded", "fp16_decode_unpadded",
            "bf16_chunk_unpadded", "fp16_chunk_unpadded"} <= unpadded, sorted(good)
    bad = [(c, good[c]["outcome"], good[c]["message"][:300]) for c in unpadded if good[c]["outcome"] != "passed"]
    assert not bad, bad
    padded = [r for c, r in good.items() if r["family"] == "batch" and c.endswith("_padded")]
    assert padded and all(r["outcome"] == "skipped" and "takes_mask = False" in (r.get("message") or
                                                                                  r.get("skip_reason") or "")
                          for r in padded), [(r["case"], r["outcome"]) for r in padded]
    faulty = {r["case"]: r for r in run["records"] if r["model"] == "select_ignores_rows" and r["family"] == "batch"}
    caught = {c for c, r in faulty.items() if r["outcome"] == "failed"}
    assert {"reorder_unpadded", "swap_rows_unpadded", "beam_fork_unpadded", "repeat_unpadded",
            "select_unpadded"} <= caught, {c: r["outcome"] for c, r in faulty.items()}


def test_the_unpadded_twins_reach_only_models_without_a_padding_mask():
    from kvconform.session import build_session

    session = build_session(models=["llama", f"{EXAMPLE}:TinyMasklessDecoder", f"{EXAMPLE}:TinyDecoder"],
                            checks=["check_select_then_decode", "check_prefill_then_decode"], runs_items=False)
    cases = {}
    for item in session.items():
        cases.setdefault(item.model.name, {})[item.case.id] = item.skip
    assert "select_unpadded" in cases["tiny_maskless_decoder"] and cases["tiny_maskless_decoder"]["select_unpadded"] \
        is None
    assert cases["tiny_maskless_decoder"]["bf16_decode_unpadded"] is None
    assert not any(c.endswith("_unpadded") for c in cases["llama"]), sorted(cases["llama"])
    assert not any(c.endswith("_unpadded") for c in cases["tiny_decoder"]), sorted(cases["tiny_decoder"])
    # a maskless adapter still stands in for the zoo models of its kind (the cases limited to them reach it)
    assert "select_padded" in cases["tiny_maskless_decoder"]


class RefusesMask(TinyMasklessDecoder):
    """A maskless adapter whose uncached forward refuses a mask."""

    name = "refuses_mask"

    def forward_uncached(self, model, ids, mask=None):
        if mask is not None:
            raise TypeError("this model takes no attention mask")
        return super().forward_uncached(model, ids)


class RefusesMaskButTakesOne(RefusesMask):
    """The same forward, declared as taking masks."""

    name = "refuses_mask_declared"
    takes_mask = True


def test_a_maskless_adapter_is_not_given_a_mask_by_the_float64_precheck():
    """``takes_mask = False`` exempts the adapter from the pre-check's left-padded forward: no item passes it a mask,
    so a forward that refuses one is no reason to refuse the model; the same forward declaring it takes masks is."""
    from kvconform import scratch

    assert scratch.float64_problem(scratch.register_adapter(RefusesMask())) is None
    problem = scratch.float64_problem(scratch.register_adapter(RefusesMaskButTakesOne()))
    assert problem and "with an attention mask" in problem and "takes no attention mask" in problem, problem


def test_a_float64_mask_overflow_is_refused_naming_the_mask(tmp_path):
    proc = _kvconform(tmp_path, "--kvconform-model", f"{FAULTY}:Float64MaskOverflow")
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-2000:]
    text = proc.stdout + proc.stderr
    assert "uncached forward at float64 with an attention mask" in text and "NaN" in text, text[-2000:]


# ------------------------------------------------------------------------------------------------ bad adapters
BAD = '''
import torch
from kvconform.examples.tiny_decoder import TinyDecoder


class NoUncached:
    def build(self, dtype, device):
        return torch.nn.Linear(2, 2).to(dtype)

    def new_cache(self, model, batch_size, max_len):
        return {}

    def forward(self, model, ids, cache, start, mask=None):
        return None, cache


class Float32Only(TinyDecoder):
    def build(self, dtype, device, seed=0):
        if dtype == torch.float64:
            raise TypeError("float64 is not supported")
        return super().build(dtype, device, seed)


class WrongShape(TinyDecoder):
    name = "wrong_shape"

    def forward(self, model, ids, cache, start, mask=None):
        logits, cache = super().forward(model, ids, cache, start, mask)
        return logits[:, -1:], cache  # only the last position


class WrongDtype(TinyDecoder):
    name = "wrong_dtype"

    def forward(self, model, ids, cache, start, mask=None):
        logits, cache = super().forward(model, ids, cache, start, mask)
        return logits.double(), cache


class IgnoresDtype(TinyDecoder):
    name = "ignores_dtype"

    def build(self, dtype, device):
        return super().build(dtype=torch.float32, device=device)  # "my model is float32"


class LogitsOnly(TinyDecoder):
    name = "logits_only"

    def forward(self, model, ids, cache, start, mask=None):
        return super().forward(model, ids, cache, start, mask)[0]


class MutatesIds(TinyDecoder):
    name = "mutates_ids"

    def forward(self, model, ids, cache, start, mask=None):
        logits, cache = super().forward(model, ids, cache, start, mask)
        ids.zero_()
        return logits, cache
'''


@pytest.fixture
def bad_file(tmp_path):
    (tmp_path / "bad_adapters.py").write_text(textwrap.dedent(BAD))
    return tmp_path


def test_a_missing_method_is_a_usage_error_naming_it_and_the_fix(bad_file):
    proc = _kvconform(bad_file, "--kvconform-model", "bad_adapters.py:NoUncached")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 4, text[-2000:]
    assert "NoUncached has no forward_uncached method" in text and "forward_uncached(self, model, ids" in text, text


def test_an_uncached_forward_failing_at_float64_says_so(bad_file):
    proc = _kvconform(bad_file, "--kvconform-model", "bad_adapters.py:Float32Only")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 4, text[-2000:]
    assert "build(dtype=torch.float64) raised TypeError: float64 is not supported" in text, text[-2000:]


def test_a_build_that_ignores_the_dtype_is_refused_before_it_becomes_the_oracle(bad_file):
    proc = _kvconform(bad_file, "--kvconform-model", "bad_adapters.py:IgnoresDtype")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 4, text[-2000:]
    assert "IgnoresDtype.build(dtype=torch.float64) returned a model whose weights are float32" in text, text[-2000:]


@pytest.mark.parametrize("attr, words", [
    ("WrongShape", ["forward returned logits of shape [2, 1, 128], but should return [2, 12, 128]"]),
    ("WrongDtype", ["forward returned torch.float64 logits of shape [2, 12, 128] from a torch.float32 model"]),
    ("MutatesIds", ["MutatesIds.forward changed the input ids in place"]),
    ("LogitsOnly", ["LogitsOnly.forward returned Tensor, but should return (logits [B, T, V], cache)"]),
])
def test_a_bad_forward_fails_its_item_naming_what_is_wrong(bad_file, attr, words):
    proc = _kvconform(bad_file, "--kvconform-model", f"bad_adapters.py:{attr}", "-k",
                      "prefill_then_decode and decode_implicit_positions")
    text = proc.stdout
    assert proc.returncode == 1, text[-3000:] + proc.stderr[-2000:]
    for w in words:
        assert w in text, text[-3000:]


# ------------------------------------------------------------------------------------- by hand, in float64
def _cached(adapter, model, ids, splits, **options):
    cache, out, start = adapter.new_cache(model, ids.shape[0], ids.shape[1], **options), [], 0
    for n in splits:
        logits, cache = adapter.forward(model, ids[:, start:start + n], cache, start)
        out.append(logits)
        start += n
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("cls, options", [(TinyDecoder, {}), (TinyDecoder, {"static": True}),
                                          (TinySlidingDecoder, {})])
def test_the_examples_cached_logits_equal_its_uncached_forward_in_float64(cls, options):
    adapter = cls()
    model = adapter.build(torch.float64, "cpu")
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    full = adapter.forward_uncached(model, ids)
    for splits in ([12, 1, 1, 1, 1, 8], [5, 3, 4, 6, 6], [1] * 24):
        assert (_cached(adapter, model, ids, splits, **options) - full).abs().max().item() < 1e-12
    # a crop, then the same tokens again: the same logits
    cache = adapter.new_cache(model, 2, 24, **options)
    _, cache = adapter.forward(model, ids[:, :16], cache, 0)
    cache = adapter.crop(cache, 4)
    logits, _ = adapter.forward(model, ids[:, 12:16], cache, 12)
    assert (logits - full[:, 12:16]).abs().max().item() < 1e-12


def test_the_faulty_chunk_is_off_where_decode_is_exact():
    adapter = faulty_scratch.NoCausalMaskInChunk()
    model = adapter.build(torch.float64, "cpu")
    ids = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(1))
    full = adapter.forward_uncached(model, ids)
    assert (_cached(adapter, model, ids, [12] + [1] * 8) - full).abs().max().item() < 1e-12
    assert (_cached(adapter, model, ids, [12, 4, 4]) - full).abs().max().item() > 1e-2


def test_check_cache_takes_an_adapter_object_as_its_model():
    from kvconform import check_cache

    results = check_cache([], models=[TinyDecoder()], checks=["check_chunked_continuation", "check_prefix_fork"])
    ran = [r for r in results if r.outcome != "skipped"]
    assert ran and all(r.outcome == "passed" for r in ran), [(r.id, r.outcome, r.message[:300]) for r in ran]
    assert {r.subject for r in ran} == {"TinyDictCache"} and {r.model for r in ran} == {"tiny_decoder"}
    bad = check_cache([], models=[faulty_scratch.NoCausalMaskInChunk()], checks=["check_chunked_continuation"])
    assert any(r.outcome == "failed" and "causal mask" in r.message for r in bad), [(r.id, r.outcome) for r in bad]


def test_the_full_tier_runs_the_worked_examples_and_the_default_tier_does_not():
    from kvconform.session import build_session

    full = build_session(full=True, checks=["check_chunked_continuation"], runs_items=False)
    names = {m.name for m in full.models}
    assert {"tiny_decoder", "tiny_sliding_decoder"} <= names
    pairs = {(i.subject.name, i.model.name) for i in full.items()}
    assert ("TinyDictCache", "tiny_decoder") in pairs
    assert not any(s == "TinyDictCache" and m != "tiny_decoder" for s, m in pairs)  # its cache on its model only
    assert not any(m == "tiny_decoder" and s != "TinyDictCache" for s, m in pairs)  # and no other cache on it
    default = build_session(checks=["check_chunked_continuation"], runs_items=False)
    assert not {"tiny_decoder", "tiny_sliding_decoder"} & {m.name for m in default.models}


def test_the_conftest_hook_adds_an_adapter_as_a_model(tmp_path):
    (tmp_path / "conftest.py").write_text(textwrap.dedent('''
        from kvconform.examples.tiny_decoder import TinyDecoder


        def pytest_kvconform_caches(config):
            return [TinyDecoder()]
    '''))
    proc = _kvconform(tmp_path, "--kvconform-model", "llama", "-n", "0", "--kvconform-json", "r.json", "-k",
                      "chunked_continuation and chunk2 and (TinyDictCache or ReferenceCache)")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    records = json.loads((tmp_path / "r.json").read_text())["results"]
    ran = {(r["subject"], r["model"], r["outcome"]) for r in records}
    assert ran == {("TinyDictCache", "tiny_decoder", "passed"), ("ReferenceCache", "llama", "passed")}, ran


def test_litgpt_through_the_same_adapter(tmp_path):
    """litgpt's GPT and KVCache (scratch_litgpt.py beside this file), when installed (measured with litgpt 0.5.13
    installed outside the project's environment, each verdict checked by hand in litgpt/model.py): exact on every
    family that runs; feeding past set_kv_cache's max_seq_length raises before writing anything, judged by that state
    (passes); its memory items measure the KVCache modules' registered k and v buffers (2 blocks × 2 × B 2 × 2 heads
    × 64 slots × 8 × 4 B = 32,768 B, preallocated at set_kv_cache's max_seq_length) and pass; and with litgpt's llama
    RMSNorm (x.float() whatever the input) the float64 oracle is refused before any item runs, naming the module."""
    pytest.importorskip("litgpt.model", reason="litgpt is an optional extra (pip install litgpt)")
    spec = f"{os.path.dirname(os.path.abspath(__file__))}/scratch_litgpt.py:LitGPT"
    proc = _kvconform(tmp_path, "--kvconform-model", spec, "--kvconform-json", "r.json")
    records = json.loads((tmp_path / "r.json").read_text())["results"]
    failed = {r["case"]: r.get("message") or "" for r in records if r["outcome"] == "failed"}
    assert not failed, (failed, proc.stdout[-3000:])
    memory = {r["case"]: r for r in records if r["family"] == "memory" and r["outcome"] == "passed"}
    assert {"memory_beam", "memory_decode", "memory_released"} <= set(memory), memory
    assert memory["memory_decode"]["metrics"]["bytes_held"] == 2 * 2 * 2 * 2 * 64 * 8 * 4
    passed = {r["family"] for r in records if r["outcome"] == "passed"}
    assert {"logits", "generate", "crop", "prefix", "fuzz", "lifecycle", "speed", "memory"} <= passed, passed
    refused = _kvconform(tmp_path, "--kvconform-model", spec.replace(":LitGPT", ":LitGPTRMSNorm"), "--co")
    assert refused.returncode == 4 and "transformer.h.0.norm_1" in refused.stdout + refused.stderr, refused.stdout


def test_a_dot_where_the_colon_goes_gets_the_colon_form(tmp_path, monkeypatch):
    from kvconform.plan import spec_problem

    monkeypatch.chdir(tmp_path)  # no folder of that name here
    problem = spec_problem("kvconform.examples.tiny_decoder.TinyDecoder")
    assert problem and problem.endswith("a model written from scratch is named MODULE:ATTR, e.g. "
                                        "kvconform.examples.tiny_decoder:TinyDecoder"), problem
    assert "MODULE:ATTR" not in (spec_problem("lama") or "")  # a zoo typo keeps its own hint only


SHORT_MODEL = '''
import torch
from kvconform.examples.tiny_decoder import TinyDecoder


class ShortPositions(TinyDecoder):
    """A learned position table of 300 positions, declared: the model itself cannot take longer sequences."""

    name = "short_positions"
    max_positions = 300

    def _limit(self, total):
        if total > 300:
            raise IndexError("index out of range in self")

    def forward(self, model, ids, cache, start, mask=None):
        self._limit(start + ids.shape[1])
        return super().forward(model, ids, cache, start, mask)

    def forward_uncached(self, model, ids, mask=None):
        self._limit(ids.shape[1])
        return super().forward_uncached(model, ids, mask)
'''


def test_a_model_shorter_than_the_speed_contexts_skips_them_instead_of_failing_its_cache(tmp_path):
    (tmp_path / "short_model.py").write_text(SHORT_MODEL)
    proc = _kvconform(tmp_path, "--kvconform-model", "short_model.py:ShortPositions", "-k", "speed_vs_uncached",
                      "-rs")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-3000:]
    assert "1 skipped" in text and "failed" not in text.split("short test summary")[-1], text[-3000:]
    # decided by the plan from the declared limit, before anything runs (no forward is tried to find it)
    assert "short_positions takes at most 300 positions (its adapter's max_positions) and case " \
           "speed_vs_uncached makes it see 516 tokens" in text, text[-3000:]
