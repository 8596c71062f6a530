"""An encoder-decoder written from scratch cannot go through the model-adapter protocol (``kvconform.scratch``): its
``forward(model, ids, cache, start, mask)`` feeds decoder tokens only, with no encoder input and no cross-attention
half of the cache. An adapter that declares ``is_encoder_decoder`` is refused as a usage error (exit 4) naming what
is missing, instead of being checked as a decoder-only model whose cross-attention no case would reach."""

from __future__ import annotations

import os
import subprocess
import sys

from kvconform import scratch
from kvconform.examples.tiny_decoder import TinyDecoder

ADAPTER = '''
from kvconform.examples.tiny_decoder import TinyDecoder


class TinySeq2Seq(TinyDecoder):
    name = "tiny_seq2seq"
    is_encoder_decoder = True
'''


class _Seq2Seq(TinyDecoder):
    is_encoder_decoder = True


def test_the_adapter_check_names_what_an_encoder_decoder_lacks():
    problem = scratch.adapter_problem(_Seq2Seq())
    assert problem is not None
    for words in ("_Seq2Seq declares is_encoder_decoder", "no encoder input", "no cross-attention half",
                  "EncoderDecoderCache"):
        assert words in problem, problem
    assert scratch.adapter_problem(TinyDecoder()) is None  # a decoder-only adapter is unaffected


def test_an_encoder_decoder_adapter_is_a_usage_error(tmp_path):
    (tmp_path / "seq2seq_adapter.py").write_text(ADAPTER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env.update(PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "--kvconform", "-p", "no:cacheprovider", "-p", "no:randomly",
                           "-q", "--kvconform-model", "seq2seq_adapter.py:TinySeq2Seq"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 4, text[-2000:]
    assert "TinySeq2Seq declares is_encoder_decoder" in text and "no encoder input" in text, text[-2000:]
