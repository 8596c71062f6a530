"""An encoder-decoder written from scratch goes through the model-adapter protocol (``kvconform.scratch``):
``is_encoder_decoder = True``, ``encode(model, encoder_ids)`` and ``encoder=`` on both forwards. A half-declared
adapter is a usage error (exit 4) naming what is missing. The worked example (``TinyEncoderDecoder``, whose
``select`` moves both halves of its cache) passes the batch ops; ``StaleCrossSelect`` (its ``select`` leaves the
cross-attention K/V behind: openai/whisper #1483, mlx-examples #1429) fails them and passes at batch 1 — both
verdicts shown by hand on the raw model too."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvconform import check_cache, scratch
from kvconform.examples.tiny_decoder import TinyDecoder
from kvconform.examples.tiny_encoder_decoder import TinyEncoderDecoder

sys.path.insert(0, os.path.dirname(__file__))
from scratch_encdec import StaleCrossSelect  # noqa: E402

HALF = '''
from kvconform.examples.tiny_decoder import TinyDecoder


class TinySeq2Seq(TinyDecoder):
    name = "tiny_seq2seq"
    is_encoder_decoder = True
'''


class _NoEncode(TinyDecoder):
    is_encoder_decoder = True


class _NoKeyword(TinyEncoderDecoder):
    def forward_uncached(self, model, ids, mask=None):
        return model(ids, None, None, 0)


class _Undeclared(TinyDecoder):
    def encode(self, model, encoder_ids):
        return encoder_ids


def test_a_half_declared_encoder_decoder_is_named_with_what_it_lacks():
    problem = scratch.adapter_problem(_NoEncode())
    assert problem is not None
    for words in ("_NoEncode declares is_encoder_decoder = True", "has no encode method",
                  "encode(self, model, encoder_ids)", "forward takes no encoder keyword",
                  "forward_uncached takes no encoder keyword"):
        assert words in problem, problem
    problem = scratch.adapter_problem(_NoKeyword())
    assert problem is not None and "forward_uncached takes no encoder keyword" in problem \
        and "has no encode" not in problem and "; forward takes" not in problem, problem
    problem = scratch.adapter_problem(_Undeclared())
    assert problem is not None and "defines encode() but does not declare is_encoder_decoder" in problem, problem
    assert scratch.adapter_problem(TinyDecoder()) is None
    assert scratch.adapter_problem(TinyEncoderDecoder()) is None
    assert scratch.adapter_problem(StaleCrossSelect()) is None


def test_a_half_declared_encoder_decoder_adapter_is_a_usage_error(tmp_path):
    (tmp_path / "seq2seq_adapter.py").write_text(HALF)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env.update(PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "--kvconform", "-p", "no:cacheprovider", "-p", "no:randomly",
                           "-q", "--kvconform-model", "seq2seq_adapter.py:TinySeq2Seq"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 4, text[-2000:]
    assert "TinySeq2Seq declares is_encoder_decoder = True, but has no encode method" in text, text[-2000:]


def _after_select(adapter, rows_at_prefill: int):
    """max|Δlogit| between the cached decode after ``select`` (rows reversed) and the uncached forward of the
    selected rows (float64, the raw model: no kvconform in between)."""
    model = adapter.build(torch.float64, "cpu")
    gen = torch.Generator().manual_seed(0)
    enc = torch.randint(1, 128, (rows_at_prefill, 5), generator=gen)
    dec = torch.randint(1, 128, (rows_at_prefill, 6), generator=gen)
    cache = adapter.new_cache(model, rows_at_prefill, 6)
    _, cache = adapter.forward(model, dec[:, :4], cache, 0, encoder=adapter.encode(model, enc))
    rows = torch.arange(rows_at_prefill - 1, -1, -1)
    cache = adapter.select(cache, rows)
    logits, _ = adapter.forward(model, dec[rows, 4:], cache, 4, encoder=adapter.encode(model, enc[rows]))
    ref = adapter.forward_uncached(model, dec[rows], encoder=adapter.encode(model, enc[rows]))[:, 4:]
    return float((logits - ref).detach().abs().max())


def test_by_hand_a_select_that_leaves_the_cross_attention_behind_is_wrong_at_batch_2_only():
    assert _after_select(TinyEncoderDecoder(), 2) < 1e-12
    assert _after_select(StaleCrossSelect(), 2) > 0.1
    assert _after_select(StaleCrossSelect(), 1) < 1e-12  # batch 1: nothing to reorder


BATCH = ["check_reorder_then_decode", "check_select_then_decode", "check_repeat_then_decode"]


@pytest.mark.parametrize("adapter", [TinyEncoderDecoder(), StaleCrossSelect()], ids=["correct", "stale_cross"])
def test_the_batch_ops_catch_a_stale_cross_attention_half(adapter):
    results = check_cache([], models=[adapter], cases=["reorder_padded", "select_padded", "repeat_padded",
                                                          "decode_implicit_positions"],
                          checks=BATCH + ["check_prefill_then_decode"])
    by = {(r.check, r.case): r for r in results}
    assert by, results
    ran = [r for r in results if r.outcome != "skipped"]
    assert ran, [(r.check, r.case, r.outcome, r.message) for r in results]
    if isinstance(adapter, StaleCrossSelect):
        batch = [r for r in ran if r.check in BATCH]
        assert len(batch) == 3 and all(r.outcome == "failed" for r in batch), [(r.case, r.outcome) for r in batch]
        for r in batch:
            assert "likely cause: your select(cache, rows) does not move every tensor of every block" in r.message, \
                r.message
        assert "cross_key" in by[("check_repeat_then_decode", "repeat_padded")].message
        assert "max|Δlogit|" in by[("check_reorder_then_decode", "reorder_padded")].message
        assert all(r.outcome == "passed" for r in ran if r.check not in BATCH), [(r.case, r.outcome) for r in ran]
    else:
        assert len(ran) == 4 and all(r.outcome == "passed" for r in ran), \
            [(r.check, r.case, r.outcome, r.message) for r in ran]
