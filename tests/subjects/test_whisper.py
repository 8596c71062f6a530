"""Issue 44 (deliverable 4): a whisper-style encoder-decoder in the zoo.

``whisper`` is transformers' ``WhisperForConditionalGeneration`` built from a tiny seeded config: its encoder takes
float log-mel features ``[B, 8, 20]``, not token ids. The checks give it its own encoder input
(``_drive.encoder_input``: seeded float64 features, cast to the case dtype for the cached run by
``compat.encoder_kwargs``; the oracle reads them in float64). A user's own ``EncoderDecoderCache`` subclass is judged
on it: correct wrappers of two designs pass repeat, select and beam search at batch 2; the wrapper that leaves the
cross-attention half alone (openai/whisper #1483, mlx-examples #1429) fails repeat and select. Real zoo model, real
transformers wrapper, nothing mocked.
"""

from __future__ import annotations

import pytest

import kvconform
from kvconform.testing import faulty_encdec


@pytest.fixture(scope="module")
def whisper():
    from kvconform import zoo

    return zoo.build_zoo_model("whisper")


def test_whisper_takes_seeded_float_features_in_the_weights_dtype(whisper):
    import torch

    from kvconform import compat, zoo
    from kvconform.checks._drive import encoder_input

    assert "whisper" in zoo.ALL_NAMES and "whisper" not in zoo.ZOO_NAMES  # full tier only
    assert whisper.is_encoder_decoder and whisper.encoder_features == (8, 20)
    # its cross-attention holds the 10 states its forward fixes, whatever a case's encoder_len says
    assert whisper.encoder_states(10) == 10 and whisper.encoder_states(4) == 10
    first = encoder_input(whisper, torch.Generator().manual_seed(3), 2, 10)
    again = encoder_input(whisper, torch.Generator().manual_seed(3), 2, 10)
    assert first.dtype == torch.float64 and tuple(first.shape) == (2, 8, 20) and torch.equal(first, again)
    cased = compat.encoder_kwargs(whisper.model, first)
    assert list(cased) == ["input_features"] and cased["input_features"].dtype == torch.float32
    assert compat.encoder_kwargs(whisper.oracle_model(), first)["input_features"].dtype == torch.float64
    # t5 keeps its token ids, drawn as before
    t5 = zoo.build_zoo_model("t5")
    ids = encoder_input(t5, torch.Generator().manual_seed(3), 2, 10)
    assert ids.dtype == torch.int64 and tuple(ids.shape) == (2, 10) and t5.encoder_states(4) == 4
    assert list(compat.encoder_kwargs(t5.model, ids)) == ["input_ids"]


def test_a_speech_encoder_decoder_config_maps_to_its_auto_class():
    from transformers import AutoModelForSpeechSeq2Seq

    from kvconform import zoo
    from kvconform.architectures import auto_model_class

    assert auto_model_class(zoo.zoo_config("whisper")) is AutoModelForSpeechSeq2Seq


def _outcomes(factory, checks, cases):
    results = kvconform.check_cache(factory, models=["whisper"], checks=checks, cases=cases, full=True)
    return {r.case: r for r in results}


BATCH_CASES = ["repeat_padded", "select_padded", "beam_search"]
BATCH_CHECKS = ["check_repeat_then_decode", "check_select_then_decode", "check_beam_search"]


@pytest.mark.parametrize("factory", [faulty_encdec.ReferenceEncoderDecoder, faulty_encdec.PagedEncoderDecoder])
def test_correct_wrappers_of_two_designs_pass_repeat_select_and_beam_search_on_whisper(factory):
    found = _outcomes(factory, BATCH_CHECKS, BATCH_CASES)
    assert sorted(found) == sorted(BATCH_CASES)
    assert all(r.outcome == "passed" for r in found.values()), {k: r.message for k, r in found.items()}


def test_cross_attention_not_repeated_per_row_is_caught_on_whisper():
    found = _outcomes(faulty_encdec.SharedEncoderStates, BATCH_CHECKS, BATCH_CASES)
    for case in ("repeat_padded", "select_padded"):
        r = found[case]
        assert r.outcome == "failed", (case, r.outcome, r.message)
        assert "did not resize every tensor of every layer alike" in r.message, r.message
        assert "cross.layers[0]" in r.message, r.message
    # generate() expands the encoder's output per beam before the cache is made, so beam search itself never asks
    # the wrapper to repeat: the fault stays unseen there (as on t5 and bart)
    assert found["beam_search"].outcome == "passed", found["beam_search"].message
