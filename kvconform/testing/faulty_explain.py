"""Faulty caches whose verdicts were right but whose *explanations* pointed the wrong way: a cause line that names an
op which had not run yet, an oracle line that compared the reference at another step than the subject's, a memory
cause that named the wrong design, a build cause that asked for keyword arguments no argument could fix, a batch
mismatch shown with the layer that was right.

Each class carries one small, realistic bug (the line is marked ``# BUG:``), written as a new user would into a
correct design (a block cache, a paged cache, a codec cache, a wrapper). ``FAULTY`` lists the check that must catch
each one, on which model, and the likely-cause line it must print (``cause``), pinned by
``tests/caches/test_faulty_caches.py``; ``tests/engine/test_cause_lines_explain.py`` pins what each line must no longer
say.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from kvconform.compat import layer_types_and_kwargs
from kvconform.families import FAMILIES
from kvconform.testing import FaultyCache
from kvconform.testing.paged import PagedAttentionLayer, PagedCache

_ALL_FAMILIES = FAMILIES


# ------------------------------------------------------------------------------------------ wrong at the prefill
class _TailSlipLayer(DynamicLayer):
    """A block writer whose prefill copies its last token into the slot of the one before (an off-by-one in the
    tail slice): the keys/values a prefill returns are wrong at its last position, from the first forward on."""

    def update(self, key_states, value_states, *args, **kwargs):
        first = not self.is_initialized
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        if first and keys.shape[-2] > 1:
            # BUG: the tail slice is off by one: the prefill's last key/value is the one before it
            self.keys[..., -1, :] = self.keys[..., -2, :]
            self.values[..., -1, :] = self.values[..., -2, :]
        return self.keys, self.values


class TailSlipCache(DynamicCache):
    """A ``DynamicCache`` whose full-attention layers slip the prefill's last token (``_TailSlipLayer``); sliding
    and linear-attention layers are transformers' own. Every case fails at its prefill: a crop, a deep copy or a
    chunk later in the case is not the cause."""

    def __init__(self, config=None, **kwargs):
        super().__init__(config=config)
        self.layers = [_TailSlipLayer() if type(layer) is DynamicLayer else layer for layer in self.layers]


# ------------------------------------------------------------------------------------------ reset keeps the length
class _ResetKeepsLengthLayer(PagedAttentionLayer):
    def reset(self) -> None:
        self._free(0)
        # BUG: the pages are freed, but the length is not set back to 0: the next sequence is written after the
        # old one's positions
        self.is_initialized = False


class ResetKeepsLengthPagedCache(PagedCache):
    """kvconform's paged cache whose ``reset()`` frees every page but keeps the length: the next prefill is stored
    at the old offset, so the layer allocates pages for both sequences' positions (not pages it failed to free)."""

    kvconform_capabilities = ("forward", "generate", "reset", "crop")
    layer_class = _ResetKeepsLengthLayer


# ------------------------------------------------------------------------------------------ repeat skips a layer
class RepeatSkipsLastLayerCache(DynamicCache):
    """Repeats the rows of every layer but the last in ``batch_repeat_interleave``: layer 0 has the new batch,
    layer 1 still the old one."""

    def batch_repeat_interleave(self, repeats: int):
        # BUG: range(len - 1): the last layer is never repeated
        for idx in range(len(self.layers) - 1):
            self.layers[idx].batch_repeat_interleave(repeats)


# ------------------------------------------------------------------------------------------ a codec round trip
class _RoundTripLayer(DynamicLayer):
    """Quantizes each new key/value token to int8 per (row, head, token) and stores the *dequantized* floats,
    plus the float32 scale of each token."""

    def update(self, key_states, value_states, *args, **kwargs):
        def round_trip(x):
            scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-8) / 127
            return (x / scale).round().clamp(-127, 127) * scale, scale

        k, k_scale = round_trip(key_states)
        v, v_scale = round_trip(value_states)
        # BUG: the codes are decoded before storing: the stored floats take as many bytes as the input, the scales
        # come on top — nothing is ever stored compressed
        if getattr(self, "scales", None) is None:
            self.scales = torch.cat([k_scale, v_scale], dim=-1)
        else:
            self.scales = torch.cat([self.scales, torch.cat([k_scale, v_scale], dim=-1)], dim=-2)
        return super().update(k, v, *args, **kwargs)

    is_croppable = False

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("crop: this codec layer does not crop its scales")

    def reset(self) -> None:
        super().reset()
        self.scales = None


class DecodedStoreCache(Cache):
    """An int8 key/value codec that stores what it decodes (float32 keys/values and per-token scales): lossy as
    declared, and about 1.06× an exact cache's bytes where it promises a saving."""

    kvconform_lossy = {"kl_max": 0.05, "top1_min": 0.8}
    kvconform_capabilities = ("forward",)

    def __init__(self, config=None, **kwargs):
        types, _ = layer_types_and_kwargs(config)
        super().__init__(layers=[_RoundTripLayer() for _ in types])


# ------------------------------------------------------------------------------------------ batch pinned at build
class PinnedBatchCache(Cache):
    """Keeps its keys/values in preallocated buffers of its own (``self.k`` / ``self.v``, one per layer), sized at
    construction for one row; ``layers`` stays empty. Right at batch 1, a size error at the first forward of any
    larger batch — a layer count has nothing to do with it."""

    kvconform_capabilities = ("forward",)

    def __init__(self, config=None, max_cache_len=64, **kwargs):
        super().__init__(layers=[])
        text = config.get_text_config(decoder=True)
        heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        n = len(layer_types_and_kwargs(config)[0])
        # BUG: the batch size is fixed to 1 here instead of taken from the batch_size argument or the first forward
        self.k = [torch.zeros(1, heads, max(int(max_cache_len or 64), 64), dim) for _ in range(n)]
        self.v = [torch.zeros_like(t) for t in self.k]
        self.length = [0] * n

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        start, n = self.length[layer_idx], key_states.shape[-2]
        self.k[layer_idx][:, :, start:start + n] = key_states
        self.v[layer_idx][:, :, start:start + n] = value_states
        self.length[layer_idx] = start + n
        return self.k[layer_idx][:, :, :start + n], self.v[layer_idx][:, :, :start + n]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length[layer_idx]

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.length[layer_idx] + query_length, 0

    def get_max_length(self, layer_idx: int = 0) -> int:
        return -1

    get_max_cache_shape = get_max_length

    @property
    def is_compileable(self) -> bool:
        return False


# ------------------------------------------------------------------------------------------ get_max_length
class MaxLengthMissingCache(DynamicCache):
    """Stores like ``DynamicCache`` but answers ``get_max_length()`` with ``NotImplementedError`` from its first
    call: a stub never filled in, not a value that changes."""

    def get_max_length(self, *args, **kwargs) -> int:
        # BUG: a stub left from the first draft
        raise NotImplementedError("get_max_length")

    get_max_cache_shape = get_max_length


# ------------------------------------------------------------------------------------------ read-only batch_size
class BatchSizeFieldCache(DynamicCache):
    """Remembers the batch size it was built for as ``self.batch_size`` — a read-only property of transformers'
    ``Cache`` (5.24), so the constructor raises whatever keyword arguments it is given."""

    def __init__(self, config=None, batch_size: int = 1, **kwargs):
        super().__init__(config=config)
        # BUG: Cache.batch_size is a property without a setter
        self.batch_size = batch_size


# ------------------------------------------------------------------------------------------ recording not forwarded
class RecordingNotForwardedCache(Cache):
    """A wrapper around a ``DynamicCache`` that shares its layers and remembers ``activate_past_recording()`` for
    itself without forwarding it to them: after the sliding window filled, the crop of a recording caller is refused
    by the sliding layers (they kept no past). ``is_croppable`` is transformers' own and right."""

    def __init__(self, config=None, **kwargs):
        self.inner = DynamicCache(config=config)
        super().__init__(layers=self.inner.layers)
        self.recording = False

    def activate_past_recording(self, **kwargs):
        # BUG: the wrapper notes it and never calls the layers' activate_past_recording
        self.recording = True


# ------------------------------------------------------------------------------------------ a norm press
class _NormPressLayer(DynamicLayer):
    """After the prefill keeps, per row and head, the ``int(n·(1 − ratio))`` keys of lowest norm in position order,
    ``n`` the prefill's width — kvpress's KnormPress on a ``DynamicCache`` layer: slot ``j`` is read as position
    ``j`` and ``get_seq_length()`` is the tokens held (kvpress's own length fault, which the press contract names;
    explicit positions make the padded-row comparison independent of it)."""

    ratio = 0.25

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = 0

    def update(self, key_states, value_states, *args, **kwargs):
        first = self.seen == 0
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        self.seen += key_states.shape[-2]
        n = key_states.shape[-2]
        if first and n > 1:
            # BUG: the count kept is a share of the batch's width, pads included: a left-padded row keeps another
            # number of its real tokens than the same row alone (the pads, of low norm, are kept as "tokens")
            kept = int(n * (1 - self.ratio))
            idx = key_states.norm(dim=-1).topk(kept, dim=-1, largest=False).indices.sort(dim=-1).values
            gather = idx.unsqueeze(-1).expand(-1, -1, -1, key_states.shape[-1])
            self.keys, self.values = key_states.gather(-2, gather), value_states.gather(-2, gather)
        return keys, values

    def reset(self) -> None:
        super().reset()
        self.seen = 0


class NormPress(Cache):
    """A KnormPress-style press: exact on unpadded rows' own terms (compared with a fresh instance), but a
    left-padded batch keeps ``int(n·0.75)`` slots of its padded width ``n`` per row. With pads [0, 3] at a 12-token
    prefill the padded row and the row alone drop the same 3 tokens (9 → 9 slots, 9 → 6 real tokens kept) and agree
    to 1e-15; at 13 the padded row drops 4 of its tokens and the row alone 3."""

    kvconform_press = {"kl_max": 0.5, "top1_min": 0.3}

    def __init__(self, config=None, **kwargs):
        types, _ = layer_types_and_kwargs(config)
        super().__init__(layers=[_NormPressLayer() for _ in types])

    @property
    def is_compileable(self) -> bool:
        return False


FAULTY = [
    FaultyCache(
        name="tail_slip_crop", attr="TailSlipCache", module=__name__, family="crop",
        check="check_crop_then_continue", model="llama", case="crop_short",
        message=("check_crop_then_continue failed: TailSlipCache on llama", "[failed at prefill(4)]"),
        cause=r"the cache is already wrong at prefill\(4\), before crop\(-2\) ran \(those ops are not the cause\)",
        also_caught_by=_ALL_FAMILIES,
    ),
    FaultyCache(
        name="tail_slip_fork", attr="TailSlipCache", module=__name__, family="prefix",
        check="check_prefix_fork", model="llama", case="prefix_fork_steps",
        message=("check_prefix_fork failed: TailSlipCache on llama", "[failed at prefill(8)]"),
        cause=r"the cache is already wrong at prefill\(8\), before fork ran \(those ops are not the cause\)",
        also_caught_by=_ALL_FAMILIES,
    ),
    FaultyCache(
        name="tail_slip_oracle", attr="TailSlipCache", module=__name__, family="logits",
        check="check_prefill_then_decode", model="bamba", case="decode_implicit_positions",
        message=("check_prefill_then_decode failed: TailSlipCache on bamba", "[failed at prefill(12)]",
                 "is within the tolerance up to prefill(12), where the subject fails, and fails only later, at "
                 "decode 1", "→ the fault at prefill(12) is in the subject"),
        cause=r"the prefill itself is wrong",
        also_caught_by=_ALL_FAMILIES,
    ),
    FaultyCache(
        name="norm_press_padded", attr="NormPress", module=__name__, family="batch",
        check="check_padded_row_alone", model="llama", case="padded_row_alone",
        message=("check_padded_row_alone failed: NormPress on llama", "prefill(13, rows left-padded by [0, 3])"),
        cause=r"after prefill\(13\) the padded batch holds 9 slots per row and the row alone 7 \(of 10 real tokens\): "
              r"the cache keeps a share of the padded length",
        also_caught_by=_ALL_FAMILIES,  # and its length is kvpress's (the tokens held): the press contract names it
    ),
    FaultyCache(
        name="reset_keeps_length", attr="ResetKeepsLengthPagedCache", module=__name__, family="memory",
        check="check_memory_bytes", model="llama", case="memory_decode",
        message=("check_memory_bytes failed: ResetKeepsLengthPagedCache on llama", "after the reset"),
        cause=r"reset\(\) does not reset the length: after reset\(\) → prefill\(6\) get_seq_length\(\) = 30 where "
              r"the cache should hold 6 tokens",
        also_caught_by=_ALL_FAMILIES,
    ),
    FaultyCache(
        name="repeat_skips_last_layer", attr="RepeatSkipsLastLayerCache", module=__name__, family="batch",
        check="check_repeat_then_decode", model="llama", case="repeat_padded",
        message=("check_repeat_then_decode failed: RepeatSkipsLastLayerCache on llama",),
        cause=r"the cache holds tensors of batch sizes 2, 4 \(layers\[1\]\.keys: 2, ",
        also_caught_by=_ALL_FAMILIES,
    ),
    FaultyCache(
        name="decoded_store", attr="DecodedStoreCache", module=__name__, family="quality",
        check="check_compression_real", model="llama", case="compression_long",
        also_caught_by=("logits",),  # the bf16/fp16 cases: it stores keys less precisely than the model's dtype
        message=("check_compression_real failed: DecodedStoreCache on llama",),
        cause=r"nothing is stored compressed: every tensor the cache holds over the tokens is in the model's dtype",
    ),
    FaultyCache(
        name="pinned_batch", attr="PinnedBatchCache", module=__name__, family="logits",
        check="check_prefill_then_decode", model="llama", case="decode_explicit_positions",
        message=("check_prefill_then_decode failed: PinnedBatchCache on llama", "[raised at prefill(12)]"),
        cause=r"the cache holds tensors of batch sizes 1 .* for a batch of 2 rows: its storage was sized for another "
              r"batch before any batch op",
        also_caught_by=_ALL_FAMILIES,
    ),
    FaultyCache(
        name="max_length_missing", attr="MaxLengthMissingCache", module=__name__, family="contract",
        check="check_length_bookkeeping", model="llama", case="length_bookkeeping",
        message=("check_length_bookkeeping failed: MaxLengthMissingCache on llama", "raised NotImplementedError"),
        cause=r"get_max_length\(\) raises from its first call",
        also_caught_by=_ALL_FAMILIES,
    ),
    FaultyCache(
        name="batch_size_field", attr="BatchSizeFieldCache", module=__name__, family="logits",
        check="check_prefill_then_decode", model="llama", case="decode_explicit_positions",
        message=("check_prefill_then_decode failed: BatchSizeFieldCache on llama", "building the subject raised"),
        cause=r"the constructor assigns self\.batch_size, a read-only property of a base class",
        also_caught_by=_ALL_FAMILIES,
    ),
    FaultyCache(
        name="recording_not_forwarded", attr="RecordingNotForwardedCache", module=__name__, family="crop",
        check="check_crop_contract", model="mistral", case="crop_past_window_recording",
        message=("check_crop_contract failed: RecordingNotForwardedCache on mistral",),
        cause=r"activate_past_recording\(\) was called on the cache but did not reach its layers",
        also_caught_by=("fuzz",),
    ),
]
