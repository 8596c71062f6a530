"""A correct KV press, written the way a press author would, and faulty variants the press contract must catch.

A *press* compresses the prefill: after the first forward into an empty layer it keeps a subset of that forward's
tokens exactly and drops the rest, at any prompt length, and never evicts while decoding (kvpress's
StreamingLLM / Knorm / SnapKV / ExpectedAttention presses with a ``compression_ratio``). It declares
``kvconform_press = {budget}`` (``kind="press"``): no token bound, a quality budget, real compression.

``TailPress(config, ratio=0.25)`` keeps the last ``n - floor(ratio·n)`` tokens of each prefill of ``n`` tokens in
every full-attention layer (sliding-window and linear-attention layers are kept as ``ReferenceCache`` keeps them: a
press has nothing to gain on a window the model bounds already). What it must get right, and does:

* the prefill itself is exact: ``update()`` returns every token of the forward that brings them, and the press
  drops tokens only afterwards;
* ``get_seq_length()`` is the number of tokens *seen* (positions derive from it), not the number held;
* ``get_mask_sizes(q)`` is ``(held + q, seen - held)``: key slot ``j`` is read as position ``seen - held + j``. For a
  kept *suffix* that is each token's own position (a press that keeps tokens out of order, e.g. sinks in front,
  breaks that on padded rows: ``SinkPress`` below);
* a left-padded prefill is refused with a ``ValueError`` (seen in the ``position_ids`` the model hands ``update``):
  its rows would keep different numbers of real tokens, which one attention mask cannot express, so a padded row
  could not equal the same row run alone;
* ``crop(-k)`` of tokens fed after the prefill is exact; a crop reaching into the compressed prefill cannot be (the
  tokens a fresh press would keep of the shorter prompt were dropped) and is refused with a ``ValueError``, leaving
  the cache unchanged;
* batch ops move every tensor with the rows; ``reset()`` forgets the sequence and its counters.

Faulty variants (``FAULTY``): ``SinkPress`` (StreamingLLM's sinks in front of the kept tail: right on unpadded rows,
pads attended on a left-padded row), ``HeldLengthPress`` (``get_seq_length()`` reports the tokens held, as kvpress on
a ``DynamicCache`` does: positions derived from it restart after the compressed prefill).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from kvconform.compat import crop_tokens_to_remove, layer_types_and_kwargs
from kvconform.reference import ReferenceAttentionLayer, _check_crop_sign, make_reference_layer
from kvconform.testing import FaultyCache

PRESS_BUDGET = {"kl_max": 0.5, "top1_min": 0.3}
"""Quality budget of ``TailPress`` at ratio 0.25 (mean KL(oracle ‖ subject) nats per position, top-1 agreement),
the budget a user of a 25 % ratio press declares on the zoo's random-weight models."""


def _refuse_padding(kwargs, n: int) -> None:
    """Refuse a left-padded prefill (seen in the ``position_ids`` the model hands ``update``: a padded row's
    positions do not run ``0 .. n-1``). A press cannot compress it right: the rows would keep different numbers of
    real tokens, and the mask (one column per position seen, read through ``get_mask_sizes``) cannot hide the
    filler slots of the shorter ones.

    Raises:
        ValueError: naming the padding and the fix.
    """
    inner = kwargs.get("kwargs") if isinstance(kwargs.get("kwargs"), dict) else kwargs
    pos = inner.get("position_ids") if isinstance(inner, dict) else None
    if pos is None or pos.dim() != 2 or pos.shape[-1] != n:
        return
    span = pos[:, -1] - pos[:, 0]
    if bool((span != n - 1).any()):
        rows = (span != n - 1).nonzero().flatten().tolist()
        raise ValueError(f"a press cannot compress a left-padded prefill (rows {rows} are padded): rows would keep "
                         f"different numbers of real tokens, which one attention mask cannot express; prefill padded "
                         f"rows one at a time, or without padding")


class PressLayer(ReferenceAttentionLayer):
    """One full-attention layer of a press: the prefill's kept tokens, then every token fed after it.

    Attributes:
        ratio: fraction of each prefill dropped (``floor(ratio·n)`` tokens of ``n``), in ``[0, 1)``.
        sinks: leading tokens kept besides the tail (0: a pure tail press).
        seen: tokens fed since the last reset (``get_seq_length()``).
        prefill: length of the compressed prefill (tokens ``[0, prefill)`` of the sequence).
        dropped: how many of them were dropped.
    """

    def __init__(self, ratio: float = 0.25, sinks: int = 0, **kwargs):
        super().__init__(**kwargs)
        if not 0 <= ratio < 1:
            raise ValueError(f"press ratio must be in [0, 1), got {ratio}")
        self.ratio, self.sinks = float(ratio), int(sinks)
        self.seen = self.prefill = self.dropped = 0

    @property
    def is_croppable(self) -> bool:
        """False once a prefill was compressed: a crop reaching into it is refused (``crop_problem``); a crop of the
        tokens fed after it is still exact."""
        return self.dropped == 0

    def kept_indices(self, n: int) -> torch.Tensor:
        """Indices ``[0, n)`` kept of a prefill of ``n`` tokens (int64, increasing)."""
        drop = int(self.ratio * n)
        keep = n - drop
        if drop == 0:
            return torch.arange(n)
        sinks = min(self.sinks, keep)
        return torch.cat([torch.arange(sinks), torch.arange(n - (keep - sinks), n)])

    def update(self, key_states, value_states, *args, **kwargs):
        """Append ``[B, H, k, D]`` keys/values and return every held token plus them; a prefill (the first forward
        into an empty layer) is then compressed to ``kept_indices``."""
        first = self.seen == 0 and not self.key_chunks
        if first and self.ratio > 0:
            _refuse_padding(kwargs, key_states.shape[-2])
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        n = key_states.shape[-2]
        self.seen += n
        if first:
            idx = self.kept_indices(n).to(key_states.device)
            self.key_chunks = [key_states.index_select(-2, idx).clone()]
            self.value_chunks = [value_states.index_select(-2, idx).clone()]
            self.prefill, self.dropped = n, n - int(idx.numel())
        return keys, values

    def held(self) -> int:
        """Tokens held per row."""
        return sum(chunk.shape[-2] for chunk in self.key_chunks)

    def get_seq_length(self) -> int:
        """Tokens seen since the last reset (the next token's position), not tokens held."""
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(held + q, seen - held)``: key slot ``j`` is position ``seen - held + j`` (the kept tail's own)."""
        held = self.held()
        return held + query_length, self.seen - held

    def crop_problem(self, tokens_to_remove: int) -> str | None:
        """Why ``crop(tokens_to_remove)`` cannot be exact here, or None."""
        keep = self.seen + tokens_to_remove
        if tokens_to_remove == 0 or keep <= 0 or self.dropped == 0 or keep >= self.prefill:
            return None
        return (f"it would reach into the compressed prefill ({self.prefill} tokens, {self.dropped} dropped): a "
                f"press fed only {keep} tokens would keep other tokens of them; crop at most "
                f"{self.seen - self.prefill} tokens")

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens (all of them if more are asked).

        Raises:
            ValueError: a positive count, or a crop into the compressed prefill (``crop_problem``).
        """
        _check_crop_sign(tokens_to_remove)
        if tokens_to_remove == 0 or not self.key_chunks:
            return
        keep = self.seen + tokens_to_remove
        if keep <= 0:
            self.reset()
            return
        problem = self.crop_problem(tokens_to_remove)
        if problem:
            raise ValueError(f"{type(self).__name__} cannot crop({tokens_to_remove}): {problem}")
        held = max(self.held() + tokens_to_remove, 0)
        keys, values = self.keys[..., :held, :], self.values[..., :held, :]
        self.key_chunks, self.value_chunks = [keys], [values]
        self.seen = keep

    def reset(self) -> None:
        """Forget the sequence and its counters."""
        super().reset()
        self.seen = self.prefill = self.dropped = 0


class TailPress(Cache):
    """A correct press (module docstring): ``TailPress(config, ratio=0.25)`` keeps the last 75 % of each prefill in
    every full-attention layer. Other keyword arguments (``max_cache_len``, ``batch_size``, ``device``, ``dtype``)
    are accepted and ignored. Without a config (each half of an ``EncoderDecoderCache``) its layers are plain
    reference layers: a press on cross-attention would drop encoder states, which no caller wants.

    Raises:
        ValueError: a ratio outside ``[0, 1)``, a layer type the reference does not implement, a crop into the
            compressed prefill.
    """

    kvconform_press = PRESS_BUDGET
    layer_class = PressLayer
    sinks = 0

    def __init__(self, config=None, ratio: float = 0.25, **ignored_kwargs):
        if config is None:
            super().__init__(layer_class_to_replicate=ReferenceAttentionLayer)
            return
        layers = [type(self).layer_class(ratio=ratio, sinks=type(self).sinks) if t == "full_attention"
                  else make_reference_layer(t, kw) for t, kw in zip(*layer_types_and_kwargs(config))]
        super().__init__(layers=layers)

    @property
    def is_compileable(self) -> bool:
        return False

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens in every layer; all-or-nothing.

        Raises:
            ValueError: a positive count (transformers ≥ 5.20), or a crop into a compressed prefill (no layer is
                changed then).
        """
        count = -crop_tokens_to_remove(tokens_to_remove, self.get_seq_length)
        for idx, layer in enumerate(self.layers):
            problem = layer.crop_problem(count) if isinstance(layer, PressLayer) else None
            if problem:
                raise ValueError(f"{type(self).__name__} cannot crop({tokens_to_remove}): layer {idx}: {problem}")
        for layer in self.layers:
            layer.crop(count)


# ------------------------------------------------------------------------------------------------ faulty variants
class _PadBlindLayer(PressLayer):
    def update(self, key_states, value_states, *args, **kwargs):
        # BUG: compresses a left-padded prefill like any other (kvpress does): the sinks are the pads
        return super().update(key_states, value_states)


class SinkPress(TailPress):
    """FAULTY: StreamingLLM's press — 4 sink tokens in front of the kept tail — that compresses a left-padded
    prefill too. Its mask sizes say "key slot ``j`` is position ``seen - held + j``", true for the tail but not for
    the sinks: on an unpadded row every held token is visible anyway and the logits are right; on a left-padded row
    the sinks are pads, read under the columns of real tokens, and attended."""

    sinks = 4
    layer_class = _PadBlindLayer


class _HeldLengthLayer(PressLayer):
    def get_seq_length(self) -> int:
        # BUG: the length of the stored keys, as DynamicLayer reports it: the tokens held, not the tokens seen
        return self.held()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.held() + query_length, 0


class HeldLengthPress(TailPress):
    """FAULTY: reports the tokens held as its length (kvpress on a ``DynamicCache``): after a compressed prefill of
    12 tokens (9 kept) the next token gets position 9, and a crop is computed from the wrong length."""

    layer_class = _HeldLengthLayer


_M = "kvconform.testing.press"
FAULTY = [
    FaultyCache("press_held_length", "HeldLengthPress", _M, "contract", "check_press_contract", "llama",
                ("check_press_contract failed: HeldLengthPress on llama", "but should be"),
                also_caught_by=("contract", "crop", "fuzz", "batch", "logits", "prefix", "lifecycle", "quality",
                                "coverage", "compile", "generate"),
                case="press_contract",
                cause=r"get_seq_length\(\) reports the tokens held \(\d+\), not the tokens seen"),
    FaultyCache("press_sinks_padded", "SinkPress", _M, "batch", "check_padded_row_alone", "llama",
                ("check_padded_row_alone failed: SinkPress on llama", "the same row run alone"),
                also_caught_by=("batch", "fuzz", "logits", "crop", "prefix", "lifecycle", "contract"),
                case="padded_row_alone",
                cause=r"left-padded row|the cache keeps a share of the padded length, its \d+ pads counted as prompt"),
]
"""The faulty variants of ``TailPress`` (collected by ``kvconform.testing.faulty_caches``)."""
