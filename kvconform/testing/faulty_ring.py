"""A ring-buffer sliding-window cache whose start slot is misplaced once the ring wraps, written the way a
sliding-window cache author would: each token lives in slot ``position % sliding_window`` of a ring allocated at the
first update (decode writes one slot in place, a prefill longer than the window writes only its last
``sliding_window`` tokens), and the held keys are the ring gathered from ``start``, the slot of the oldest kept
token. The layer keeps ``sliding_window - 1`` tokens (as transformers' ``DynamicSlidingWindowLayer``: the new token
completes the window), but its start slot is computed for a ring that holds all ``sliding_window`` tokens ("the
oldest is where the next write goes"): from the wrap on, the gather starts one slot early — it reads the token that
just left the window and drops the newest one.

The prefill is stored intact: a prefill shorter than the window decodes exactly until the ring wraps; after a
prefill past the window the first decode step is already wrong. Caught by the logits family on mistral (window 8);
the likely cause must name the ring slot and the wrap, measured in the layer's keys, not the prefill
(``tests/engine/test_cause_lines_ring.py``). ``kvconform.testing.allocation.RingWindowCache`` (a ring of the same size,
start kept as an offset) is the correct cache of the same allocation policy and passes the same items.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer

from kvconform.testing import FaultyCache
from kvconform.testing.allocation import RingWindowCache


class _PositionSlotRing(DynamicSlidingWindowLayer):
    """Keys/values of one sliding layer in a ring of ``sliding_window`` slots; slot = position % sliding_window."""

    is_croppable = False

    def __init__(self, sliding_window: int, **kwargs):
        self._ring: dict = {"keys": None, "values": None}
        self._placeholder: dict = {"keys": None, "values": None}
        super().__init__(sliding_window=sliding_window)

    def _held(self) -> int:
        return min(self.cumulative_length, self.sliding_window - 1)

    def _gather(self, name):
        ring = self._ring[name]
        if ring is None:
            return self._placeholder[name]
        slots = ring.shape[-2]
        # BUG: the start of a ring holding all `slots` tokens once it wrapped ("the oldest token is where the next
        # write goes"); this layer keeps slots - 1 of them, so the oldest lies one slot later:
        # (cumulative_length - held) % slots
        start = 0 if self.cumulative_length < slots else self.cumulative_length % slots
        idx = (start + torch.arange(self._held(), device=ring.device)) % slots
        return ring.index_select(-2, idx)

    def _assign(self, name, value):
        if value is not None and value.dim() == 4 and value.shape[-2] > 0:
            raise NotImplementedError(f"{type(self).__name__} keeps its {name} in a ring; it cannot take them whole")
        self._ring[name], self._placeholder[name] = None, value

    keys = property(lambda self: self._gather("keys"), lambda self, t: self._assign("keys", t))
    values = property(lambda self: self._gather("values"), lambda self, t: self._assign("values", t))

    def update(self, key_states, value_states, *args, **kwargs):
        """Return the held keys/values followed by the new ones; write the new tokens (the last ``sliding_window``
        of them) into their slots."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q, first = key_states.shape[-2], self.cumulative_length
        held_k, held_v = self._gather("keys"), self._gather("values")
        full_k = key_states if held_k is None or held_k.dim() != 4 else torch.cat([held_k, key_states], dim=-2)
        full_v = value_states if held_v is None or held_v.dim() != 4 else torch.cat([held_v, value_states], dim=-2)
        slots = self.sliding_window
        n = min(q, slots)
        pos = torch.arange(first + q - n, first + q, device=key_states.device) % slots
        for name, new in (("keys", key_states), ("values", value_states)):
            if self._ring[name] is None:
                self._ring[name] = new.new_zeros(*new.shape[:2], slots, new.shape[-1])
            self._ring[name].index_copy_(-2, pos, new[..., -n:, :])
        self.cumulative_length += q
        return full_k, full_v

    def crop(self, tokens_to_remove):
        raise NotImplementedError(f"{type(self).__name__} does not support crop")

    def reset(self) -> None:
        self._ring = {"keys": None, "values": None}
        self._placeholder = {"keys": None, "values": None}
        self.cumulative_length = 0
        self.is_initialized = False


class RingStartSlotCache(RingWindowCache):
    """FAULTY: sliding-window rings addressed by position whose start slot is one early from the wrap on."""

    kvconform_capabilities = ("forward", "generate", "reset")
    sliding_class = _PositionSlotRing


FAULTY = [
    FaultyCache(
        name="ring_start_slot", attr="RingStartSlotCache", module=__name__, family="logits",
        check="check_prefill_then_decode", model="mistral", case="decode_explicit_positions",
        message=("check_prefill_then_decode failed: RingStartSlotCache on mistral", "[failed at decode 1]"),
        also_caught_by=("generate", "lifecycle"),  # greedy generation and the capacity case decode past the window
        cause=r"^likely cause: sliding layer 0 \(window 8\) holds the keys of positions 14-20 after 22 tokens, but "
              r"should hold the last 7: 15-21 — it keeps position 14 \(already out of the window\) in place of the "
              r"newest, 21: .* a ring buffer whose start slot .* is misplaced by 1 once the window wraps",
    ),
]
