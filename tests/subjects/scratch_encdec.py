"""A from-scratch encoder-decoder whose ``select`` reorders the self-attention K/V but not the cross-attention K/V
(the fault openai/whisper #1483 shipped until #2197, and mlx-examples #1429): the model is the worked example's
(``kvconform.examples.tiny_encoder_decoder``), only ``select`` differs::

    pytest --kvconform --kvconform-model tests/subjects/scratch_encdec.py:StaleCrossSelect

Right at batch 1 (nothing to reorder), wrong at batch > 1 after a select, repeat or beam reorder: each row keeps
the cross-attention keys of the row that was there before (a repeat keeps the old batch's rows)."""

from __future__ import annotations

from kvconform.examples.tiny_encoder_decoder import TinyEncoderDecoder


class StaleCrossSelect(TinyEncoderDecoder):
    """``TinyEncoderDecoder`` whose ``select`` leaves the cross-attention half as it was."""

    name = "tiny_encdec_stale_cross"
    caches = {"StaleCrossCache": {}}

    def select(self, cache, rows):
        """Keep the rows ``rows`` of the self-attention keys and values only (the fault)."""
        for layer in cache:
            for name in ("key", "value"):
                if name in layer:
                    layer[name] = layer[name][rows]
        return cache
