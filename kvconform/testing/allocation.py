"""Correct caches with allocation policies other than "token by token" or "pages", written the way their authors
would, and faulty variants that really over-hold.

* ``RingWindowCache``: every sliding-window layer keeps a fixed ring of ``sliding_window`` slots, allocated at its
  first update (what a serving engine does to avoid reallocating as the window slides); full-attention layers as
  ``DynamicCache``. Its sliding layers hold ``sliding_window`` tokens' bytes from the first token on: more than
  ``min(S, window)`` while ``S`` is small, by design. It declares ``kvconform_allocation = "preallocated"`` (the
  memory family infers it too: the held bytes equal the capacity after every op).
* ``DoublingCache``: every full-attention layer appends into a buffer whose capacity doubles when full (amortised
  O(1) appends, as a C++ vector does) and is halved back by ``crop`` when less than half full, freed by ``reset``:
  at most twice the tokens held. It declares ``kvconform_allocation = "doubling"`` (also inferred: the held bytes
  double at each growth and stay flat between).

All three are exact: attention reads exactly the tokens it would read from ``DynamicCache`` (checked against the
float64 oracle by every family).

* ``BufferCache``: every full-attention layer keeps one buffer of ``max_cache_len`` slots, allocated at its first
  write and kept across ``crop`` and ``reset`` (a preallocating cache that is not compileable); it declares nothing,
  the memory family infers the preallocation.

Faulty variants (``FAULTY``): ``RingTwoWindows`` (a ring of ``2 · sliding_window`` slots "for headroom": twice the
window, beyond its declared preallocation), ``DoublingNeverShrinks`` (crop never gives the buffer back: after a deep
crop it holds many times the tokens left), ``BufferIgnoresMaxCacheLen`` (4,096 slots whatever ``max_cache_len`` it
is given).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from kvconform.compat import crop_tokens_to_remove, layer_types_and_kwargs
from kvconform.testing import FaultyCache


# ------------------------------------------------------------------------------------------------ ring
class HonestSlidingLayer(DynamicSlidingWindowLayer):
    """``DynamicSlidingWindowLayer`` with an honest crop: ``is_croppable`` is False once the window is full without
    past recording, and ``crop(-k)`` removes ``k`` tokens only while what remains still holds every token the
    window needs (else a ``RuntimeError`` naming the problem, nothing changed); with past recording on, the recorded
    past is kept across crops (5.24's layer throws it away, see the known fault ``dynamic-sliding-crop-twice``)."""

    @property
    def is_croppable(self) -> bool:
        return self.record_past or self.cumulative_length < self.sliding_window

    def update(self, key_states, value_states, *args, **kwargs):
        """As ``DynamicSlidingWindowLayer.update``, but the kept window is a copy: 5.24's layer keeps a slice of the
        whole prefill, which pins its buffer (the known fault ``dynamic-sliding-view-pins-buffer``)."""
        out = super().update(key_states, value_states, *args, **kwargs)
        keys, values = self.keys, self.values
        if not self.record_past and keys is not None and keys.dim() == 4 and \
                keys.untyped_storage().nbytes() > keys.numel() * keys.element_size():
            self.keys, self.values = keys.clone(), values.clone()
        return out

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens (the installed release's sign contract).

        Raises:
            ValueError: a positive count (transformers ≥ 5.20).
            RuntimeError: the tokens left would not cover the window (they were dropped as it slid).
        """
        k = crop_tokens_to_remove(tokens_to_remove, self.get_seq_length)
        if k == 0 or not self.is_initialized or self.keys is None or self.keys.dim() != 4:
            return
        held = self.keys.shape[-2]
        remaining = max(self.cumulative_length - k, 0)
        if remaining == 0:  # every token goes: an empty layer, whatever the window dropped before
            k = held
        elif held - k < min(remaining, self.sliding_window - 1):
            raise RuntimeError(f"cannot crop({-k}): this sliding layer holds only its last {held} tokens (the window "
                               f"slid past the others; call activate_past_recording() before decoding to crop later)")
        keys, values = self.keys[..., :max(held - k, 0), :], self.values[..., :max(held - k, 0), :]
        self.keys, self.values = keys, values
        self.cumulative_length = remaining


class RingSlidingLayer(HonestSlidingLayer):
    """A sliding-window layer whose keys/values live in a ring of ``slots`` (default ``sliding_window``) rows per
    head, allocated once; ``keys`` / ``values`` are the held tokens in order (a gather of the ring), and assigning
    them (what ``DynamicSlidingWindowLayer``'s update, crop and batch ops do) writes them back into the ring,
    reallocating only when the batch or head shape changes (or past recording holds more than the ring). Keys and
    values each keep their own start and count, so assigning one never moves the other."""

    ring_factor = 1

    def __init__(self, sliding_window: int, **kwargs):
        self._ring = {"keys": None, "values": None}
        self._held = {"keys": 0, "values": 0}
        self._start = {"keys": 0, "values": 0}
        super().__init__(sliding_window=sliding_window, **kwargs)

    @property
    def slots(self) -> int:
        return self.ring_factor * self.sliding_window

    def _read(self, name):
        ring = self._ring[name]
        if ring is None or ring.dim() != 4:
            return ring
        idx = (self._start[name] + torch.arange(self._held[name], device=ring.device)) % ring.shape[-2]
        return ring.index_select(-2, idx)

    def _write(self, name, t):
        if t is None or t.dim() != 4:
            self._ring[name], self._held[name], self._start[name] = t, 0, 0
            return
        n = t.shape[-2]
        ring = self._ring[name]
        if ring is None or ring.dim() != 4 or ring.shape[:2] != t.shape[:2] or ring.shape[-1] != t.shape[-1] \
                or ring.dtype != t.dtype or ring.shape[-2] < n:
            ring = torch.zeros(*t.shape[:2], max(self.slots, n), t.shape[-1], dtype=t.dtype, device=t.device)
        else:
            t = t.clone()  # t may be a gather of this very ring
        ring[..., :n, :] = t
        self._ring[name], self._held[name], self._start[name] = ring, n, 0

    def kvconform_poison(self, value: float) -> int:
        """Fill every ring slot that holds no kept token with ``value`` (kvconform's poisoned-capacity cases): before
        the window fills, the slots past the held tokens; after it, the slot of the token that just left the window
        (a ring of ``sliding_window`` slots keeps ``sliding_window - 1`` tokens between forwards), and every slot
        beyond those in a larger ring. The next write goes into one of them, so no held token is touched. Returns the
        token slots filled (rows × slots of the key ring)."""
        filled = 0
        for name in ("keys", "values"):
            ring = self._ring[name]
            if ring is None or ring.dim() != 4:
                continue
            slots, held = ring.shape[-2], self._held[name]
            free = (self._start[name] + held + torch.arange(slots - held, device=ring.device)) % slots
            ring.index_fill_(-2, free, value)
            if name == "keys":
                filled = (slots - held) * ring.shape[0]
        return filled

    keys = property(lambda self: self._read("keys"), lambda self, t: self._write("keys", t))
    values = property(lambda self: self._read("values"), lambda self, t: self._write("values", t))

    def update(self, key_states, value_states, *args, **kwargs):
        """As ``DynamicSlidingWindowLayer.update``; once the window is full, new tokens overwrite the oldest slots of
        the ring in place."""
        ring = self._ring["keys"]
        q = key_states.shape[-2]
        keep = self.sliding_window - 1
        if (self.is_initialized and not self.record_past and ring is not None and ring.dim() == 4
                and ring.shape[:2] == key_states.shape[:2] and ring.shape[-2] == self.slots
                and self._held["keys"] + q > keep and q < self.sliding_window):
            full_k = torch.cat([self.keys, key_states], dim=-2)
            full_v = torch.cat([self.values, value_states], dim=-2)
            self.cumulative_length += q
            for name, new in (("keys", key_states), ("values", value_states)):
                slots, held = self._ring[name].shape[-2], self._held[name]
                pos = ((self._start[name] + held) % slots + torch.arange(q, device=new.device)) % slots
                self._ring[name].index_copy_(-2, pos, new)
                total = held + q
                self._start[name] = (self._start[name] + max(total - keep, 0)) % slots
                self._held[name] = min(total, keep)
            return full_k, full_v
        return super().update(key_states, value_states, *args, **kwargs)


class RingWindowCache(Cache):
    """Sliding-window layers in rings of ``sliding_window`` slots, full-attention layers as ``DynamicCache``
    (module docstring). ``RingWindowCache(config)``; other keyword arguments are accepted and ignored. Models
    without sliding layers get plain dynamic layers (nothing to ring).

    Raises:
        ValueError: a config without layer types transformers can read (``layer_types_and_kwargs``).
    """

    kvconform_allocation = "preallocated"
    sliding_class = RingSlidingLayer

    def __init__(self, config=None, **ignored_kwargs):
        if config is None:
            super().__init__(layer_class_to_replicate=DynamicLayer)
            return
        layers = []
        for layer_type, kw in zip(*layer_types_and_kwargs(config)):
            window = kw.get("sliding_window")
            if layer_type in ("sliding_attention", "chunked_attention") and window:
                layers.append(type(self).sliding_class(sliding_window=window))
            else:
                layers.append(_plain_layer(layer_type, kw))
        super().__init__(layers=layers)


def _plain_layer(layer_type, kw):
    """A correct layer for a type neither cache changes: ``DynamicLayer`` for full attention, else kvconform's
    reference layer of that type (linear attention, hybrid)."""
    from kvconform.reference import make_reference_layer

    return DynamicLayer() if layer_type == "full_attention" else make_reference_layer(layer_type, kw)


# ------------------------------------------------------------------------------------------------ doubling
def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


class DoublingLayer(DynamicLayer):
    """A full-attention layer appending into a buffer of ``capacity`` token slots per row and head that doubles
    when full; ``crop`` halves it back to the smallest power of two that holds what is left, ``reset`` frees it.
    ``keys`` / ``values`` are views of the first ``length`` slots (each with its own length, so assigning one never
    moves the other)."""

    shrink_on_crop = True

    def __init__(self, **kwargs):
        self._buf = {"keys": None, "values": None}
        self._len = {"keys": 0, "values": 0}
        super().__init__()

    def _slots_for(self, n: int) -> int:
        """The token slots of a new buffer that must hold ``n`` tokens: the next power of two."""
        return _pow2(n)

    @property
    def length(self) -> int:
        return self._len["keys"]

    def _read(self, name):
        buf = self._buf[name]
        return buf if buf is None or buf.dim() != 4 else buf[..., :self._len[name], :]

    def _write(self, name, t):
        if t is None or t.dim() != 4:
            self._buf[name], self._len[name] = t, 0
            return
        buf = self._buf[name]
        n = t.shape[-2]
        fits = (buf is not None and buf.dim() == 4 and buf.shape[:2] == t.shape[:2] and buf.shape[-2] >= n
                and buf.dtype == t.dtype)
        if fits and not (self.shrink_on_crop and buf.shape[-2] > self._slots_for(max(n, 1))):
            buf[..., :n, :] = t.clone()  # t may be a view of this very buffer
        else:
            new = torch.empty(*t.shape[:2], self._slots_for(max(n, 1)), t.shape[-1], dtype=t.dtype,
                              device=t.device)
            new[..., :n, :] = t
            self._buf[name] = new
        self._len[name] = n

    keys = property(lambda self: self._read("keys"), lambda self, t: self._write("keys", t))
    values = property(lambda self: self._read("values"), lambda self, t: self._write("values", t))

    def update(self, key_states, value_states, *args, **kwargs):
        """Append ``[B, H, q, D]`` in place, doubling the buffer when it is full; return views of every token."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        for name, new in (("keys", key_states), ("values", value_states)):
            n, q = self._len[name], new.shape[-2]
            buf = self._buf[name]
            if buf is None or buf.dim() != 4 or buf.shape[:2] != new.shape[:2] or buf.shape[-2] < n + q:
                grown = torch.empty(*new.shape[:2], self._slots_for(n + q), new.shape[-1], dtype=new.dtype,
                                    device=new.device)
                if n:
                    grown[..., :n, :] = buf[..., :n, :]
                self._buf[name] = buf = grown
            buf[..., n:n + q, :] = new
            self._len[name] = n + q
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length


class DoublingCache(Cache):
    """Full-attention layers in doubling buffers; sliding and other layers as ``DynamicCache`` builds them
    (module docstring). ``DoublingCache(config)``; other keyword arguments are accepted and ignored."""

    kvconform_allocation = "doubling"
    layer_class = DoublingLayer

    def __init__(self, config=None, **ignored_kwargs):
        if config is None:
            super().__init__(layer_class_to_replicate=type(self).layer_class)
            return
        layers = []
        for layer_type, kw in zip(*layer_types_and_kwargs(config)):
            window = kw.get("sliding_window")
            if layer_type == "full_attention":
                layers.append(self._full_attention_layer())
            elif layer_type in ("sliding_attention", "chunked_attention") and window:
                layers.append(HonestSlidingLayer(sliding_window=window))
            else:
                layers.append(_plain_layer(layer_type, kw))
        super().__init__(layers=layers)

    def _full_attention_layer(self):
        return type(self).layer_class()

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens in every layer (the installed release's sign contract)."""
        count = -crop_tokens_to_remove(tokens_to_remove, self.get_seq_length)
        for layer in self.layers:
            layer.crop(count)


# ------------------------------------------------------------------------------------------------ one buffer
class BufferLayer(DoublingLayer):
    """A full-attention layer in one buffer of ``capacity`` token slots per row and head, allocated at its first
    write and kept until the batch shape changes (``reset`` and ``crop`` only rewind the length): what a serving
    engine that sizes its buffers by ``max_cache_len`` does without being compileable. ``get_max_length()`` is
    ``capacity``; a write of more tokens than that grows the buffer to hold them."""

    shrink_on_crop = False

    def __init__(self, capacity: int, **kwargs):
        self.capacity = int(capacity)
        super().__init__(**kwargs)

    def _slots_for(self, n: int) -> int:
        return max(self.capacity, n)

    def get_max_length(self) -> int:
        return self.capacity

    get_max_cache_shape = get_max_length

    def reset(self) -> None:
        """Forget every token; the buffer stays allocated for the next sequence (its capacity, preallocated)."""
        self._len = {"keys": 0, "values": 0}


class BufferCache(DoublingCache):
    """Full-attention layers in one buffer of ``max_cache_len`` slots each (``BufferLayer``); sliding and other layers
    as ``DynamicCache`` builds them. ``BufferCache(config, max_cache_len)``; other keyword arguments are accepted and
    ignored. Correct and exact: its full-attention layers hold their whole capacity from the first token on, which
    the memory family infers (the held bytes equal ``get_max_length()`` slots' after every op)."""

    kvconform_allocation = None

    def __init__(self, config=None, max_cache_len: int = 256, **ignored_kwargs):
        self.asked_len = int(max_cache_len)
        super().__init__(config=config)

    def _full_attention_layer(self):
        return BufferLayer(self._capacity())

    def _capacity(self) -> int:
        return self.asked_len


# ------------------------------------------------------------------------------------------------ faulty variants
class _TwoWindowRing(RingSlidingLayer):
    ring_factor = 2  # BUG: "headroom": the ring is allocated twice the window the layer ever reads


class RingTwoWindows(RingWindowCache):
    """FAULTY: its rings have ``2 · sliding_window`` slots — twice what its declared preallocation allows."""

    sliding_class = _TwoWindowRing


class _NeverShrinkLayer(DoublingLayer):
    shrink_on_crop = False  # BUG: crop only moves the length; the doubled buffer is never given back

    def reset(self) -> None:
        # BUG: "reuse the allocation for the next sequence": reset only rewinds the length
        self._len = {"keys": 0, "values": 0}


class DoublingNeverShrinks(DoublingCache):
    """FAULTY: ``crop`` and ``reset`` only rewind the length and keep the largest buffer ever grown: after a reset
    and a short sequence the layer holds many times the tokens it serves."""

    layer_class = _NeverShrinkLayer


class _HeadroomLayer(DoublingLayer):
    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        for name, new in (("keys", key_states), ("values", value_states)):
            n, q = self._len[name], new.shape[-2]
            buf = self._buf[name]
            if buf is None or buf.dim() != 4 or buf.shape[-2] < n + q:
                # BUG: "headroom": twice the next power of two, so a buffer is up to 4× the tokens it holds
                grown = torch.empty(*new.shape[:2], 2 * _pow2(n + q), new.shape[-1], dtype=new.dtype,
                                    device=new.device)
                if n:
                    grown[..., :n, :] = buf[..., :n, :]
                self._buf[name] = grown
        return super().update(key_states, value_states, *args, **kwargs)


class DoublingHeadroom(DoublingCache):
    """FAULTY: each growth allocates twice the next power of two of the tokens held ("headroom"): after a 200-token
    prefill a layer holds 512 slots, 2.56× its tokens — more than a doubling buffer (≤ 2×) may hold, declared or
    inferred. It declares no allocation policy."""

    kvconform_allocation = None
    layer_class = _HeadroomLayer


class UndeclaredDoublingCache(DoublingCache):
    """``DoublingCache`` without its declaration (``kvconform_allocation`` unset): correct, its policy is left for
    the memory family to infer — from the doubling of its held bytes, or, when one large prefill fills a buffer that
    then has room for every decode step, from the capacity of the buffer its keys are a view of."""

    kvconform_allocation = None


class BufferIgnoresMaxCacheLen(BufferCache):
    """FAULTY: every buffer has 4,096 slots whatever ``max_cache_len`` it is given ("room for any prompt"), and
    ``get_max_length()`` says so: asked for 64 tokens it holds 64× what they take."""

    def _capacity(self) -> int:
        return 4096  # BUG: a fixed capacity; the max_cache_len argument is ignored


_M = "kvconform.testing.allocation"
FAULTY = [
    FaultyCache("ring_two_windows", "RingTwoWindows", _M, "memory", "check_memory_bytes", "mistral",
                ("check_memory_bytes failed: RingTwoWindows on mistral", "allocation: its capacity preallocated"),
                case="memory_decode",
                cause=r"the preallocated buffer is larger than the layer's capacity \(8 tokens"),
    FaultyCache("doubling_never_shrinks", "DoublingNeverShrinks", _M, "memory", "check_memory_bytes", "llama",
                ("check_memory_bytes failed: DoublingNeverShrinks on llama", "allocation: amortised doubling"),
                also_caught_by=("lifecycle", "batch", "fuzz", "contract", "prefix", "generate"),
                case="memory_decode",
                cause=r"the doubling buffer is not shrunk by crop\(\)/reset\(\)"),
    FaultyCache("buffer_ignores_max_cache_len", "BufferIgnoresMaxCacheLen", _M, "memory", "check_memory_bytes",
                "llama", ("check_memory_bytes failed: BufferIgnoresMaxCacheLen on llama",
                          "allocation: its capacity preallocated"),
                case="memory_decode",
                cause=r"the cache ignores the max_cache_len it was built with: asked for 64 tokens, layer 0 declares "
                      r"a capacity of 4096"),
]
"""The faulty allocation variants (collected by ``kvconform.testing.faulty_caches``)."""
