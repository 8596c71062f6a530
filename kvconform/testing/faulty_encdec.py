"""A user's own ``EncoderDecoderCache`` subclass as the subject (a factory returning the wrapper is used as it is,
not wrapped again: ``CacheSpec.build``), and the fault of openai/whisper #1483 (fixed by #2197) and mlx-examples
#1429 written into one: the cross-attention keys and values are not repeated (or selected) per beam.

transformers' ``EncoderDecoderCache.batch_repeat_interleave`` / ``batch_select_indices`` / ``crop`` accept only
``DynamicCache`` halves (``check_dynamic_cache``). An author who keeps the halves in caches of their own lifts that
restriction in a subclass, and reasons that the cross-attention half holds the *encoder's* states, "the same for
every beam", so only the self-attention half needs the batch op. At batch 1 the cross-attention half then has one
row that every repeated row broadcasts over: right. At batch 2 the rows no longer line up: t5's eager attention
raises a size mismatch after ``repeat 2`` (4 queries' rows against 2 encoder rows); after ``select`` (3 rows → 2)
it raises alike. Caught by ``check_repeat_then_decode`` (``repeat_padded``) and ``check_select_then_decode``
(``select_padded``) on t5 and bart.

``BatchOpsEncoderDecoderCache`` is the correct subclass: every batch op and ``crop`` applied to the halves that
need it, for halves of any class; kvconform's ``ReferenceCache`` halves (``ReferenceEncoderDecoder``) and the bundled
``PagedCache`` halves (``PagedEncoderDecoder``) pass the same cases. The faulty class carries one bug (``# BUG:``);
``FAULTY`` pins the check, case and likely-cause line (``tests/caches/test_faulty_caches.py``).
"""

from __future__ import annotations

from transformers.cache_utils import EncoderDecoderCache

from kvconform.reference import ReferenceCache
from kvconform.testing import FaultyCache
from kvconform.testing.paged import PagedCache


class BatchOpsEncoderDecoderCache(EncoderDecoderCache):
    """An ``EncoderDecoderCache`` whose ``crop``, ``batch_repeat_interleave`` and ``batch_select_indices`` work for
    halves of any ``Cache`` class (transformers' accept only ``DynamicCache`` halves): each op goes to both halves
    (``crop`` to the self-attention half only: the encoder's states are not cropped).

    Args:
        self_attention_cache, cross_attention_cache: ``transformers.Cache`` instances (any class with the ops).
    """

    def crop(self, tokens_to_remove: int) -> None:
        self.self_attention_cache.crop(tokens_to_remove)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.self_attention_cache.batch_repeat_interleave(repeats)
        self.cross_attention_cache.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices) -> None:
        self.self_attention_cache.batch_select_indices(indices)
        self.cross_attention_cache.batch_select_indices(indices)


class SharedEncoderStatesCache(BatchOpsEncoderDecoderCache):
    """``BatchOpsEncoderDecoderCache`` whose batch ops leave the cross-attention half alone ("the encoder's states
    are the same for every beam"): right at batch 1, a size mismatch (or another row's encoder) at batch > 1."""

    def batch_repeat_interleave(self, repeats: int) -> None:
        # BUG: the cross-attention keys/values are not repeated per beam (openai/whisper #1483, mlx-examples #1429)
        self.self_attention_cache.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices) -> None:
        # BUG: the cross-attention half keeps every row, the self-attention half only the selected ones
        self.self_attention_cache.batch_select_indices(indices)


def ReferenceEncoderDecoder(config=None, **kwargs) -> BatchOpsEncoderDecoderCache:
    """The correct wrapper with kvconform's ``ReferenceCache`` halves (lists of K/V chunks joined by ``torch.cat``)."""
    return BatchOpsEncoderDecoderCache(ReferenceCache(config=config), ReferenceCache(config=config))


def PagedEncoderDecoder(config=None, **kwargs) -> BatchOpsEncoderDecoderCache:
    """The correct wrapper with the bundled ``PagedCache`` halves (keys/values in pages of 4 tokens)."""
    return BatchOpsEncoderDecoderCache(PagedCache(config=config), PagedCache(config=config))


def SharedEncoderStates(config=None, **kwargs) -> SharedEncoderStatesCache:
    """The faulty wrapper (cross-attention states not repeated/selected per beam) with ``ReferenceCache`` halves."""
    return SharedEncoderStatesCache(ReferenceCache(config=config), ReferenceCache(config=config))


for _factory in (ReferenceEncoderDecoder, PagedEncoderDecoder, SharedEncoderStates):
    _factory.kvconform_supports = {"encoder_decoder"}  # type: ignore[attr-defined]  # a wrapper needs an encoder

FAULTY = [
    FaultyCache(
        name="encdec_cross_not_repeated", attr="SharedEncoderStates", module=__name__, family="batch",
        check="check_repeat_then_decode", model="t5", case="repeat_padded",
        message=("check_repeat_then_decode failed: SharedEncoderStates on t5",),
        cause=r"repeat\(2\) did not resize every tensor of every layer alike",
    ),
]
