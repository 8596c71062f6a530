"""Issue 44 (deliverable 4): a user's own ``EncoderDecoderCache`` subclass as the subject.

A factory returning an ``EncoderDecoderCache`` is used as it is on encoder-decoder models, not wrapped again
(``CacheSpec.build``). The correct wrapper of ``kvconform/testing/faulty_encdec.py`` passes the batch cases on t5 and
bart with halves of two designs (kvconform's ``ReferenceCache``, the bundled ``PagedCache``); the wrapper that leaves
the cross-attention half alone on repeat/select (openai/whisper #1483, mlx-examples #1429) fails both cases.
Real zoo models, real transformers wrapper, nothing mocked.
"""

from __future__ import annotations

import pytest

import kvconform
from kvconform.testing import faulty_encdec


def _outcomes(factory, models, cases):
    results = kvconform.check_cache(factory, models=models,
                                    checks=["check_repeat_then_decode", "check_select_then_decode"], cases=cases)
    return {(r.model, r.case): r for r in results}


def test_a_factory_returning_an_encoder_decoder_cache_is_used_as_it_is():
    from kvconform import zoo
    from kvconform.subjects import CacheSpec

    model = zoo.build_zoo_model("t5")
    spec = CacheSpec(name="PagedEncoderDecoder", factory=faulty_encdec.PagedEncoderDecoder)
    cache = spec.build(model, max_cache_len=16, batch_size=2, encoder_len=8)
    assert type(cache) is faulty_encdec.BatchOpsEncoderDecoderCache, "not wrapped in the stock EncoderDecoderCache"
    assert type(cache.self_attention_cache).__name__ == "PagedCache"


@pytest.mark.parametrize("factory", [faulty_encdec.ReferenceEncoderDecoder, faulty_encdec.PagedEncoderDecoder])
def test_correct_wrappers_of_two_designs_pass_repeat_and_select_on_t5_and_bart(factory):
    found = _outcomes(factory, ["t5", "bart"], ["repeat_padded", "select_padded"])
    assert len(found) == 4, sorted(found)
    assert all(r.outcome == "passed" for r in found.values()), {k: r.message for k, r in found.items()}


def test_cross_attention_not_repeated_per_beam_is_caught_at_batch_2():
    found = _outcomes(faulty_encdec.SharedEncoderStates, ["t5", "bart"], ["repeat_padded", "select_padded"])
    assert len(found) == 4, sorted(found)
    for key, r in found.items():
        assert r.outcome == "failed", (key, r.outcome, r.message)
        assert "did not resize every tensor of every layer alike" in r.message, r.message
        assert "cross.layers[0]" in r.message, r.message
