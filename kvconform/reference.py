"""ReferenceCache: the simplest correct cache, the oracle's twin and the worked example for cache authors.

A transformers cache is a list of *layers*, one per decoder layer. The model talks to the cache through two small
protocols, and this module implements each of them in the plainest way that is still correct:

* attention layers (``cache.update(keys, values, layer_idx)``): keep every key/value ever given, in a Python list of
  chunks, and return ``torch.cat`` of all of them. Sliding-window and chunked layers keep everything too: the mask
  built from absolute positions (``masking_utils``) hides the tokens outside the window, so nothing needs evicting.
* linear-attention layers (Mamba-style SSMs: ``get_conv_state`` / ``update_conv_state`` / ``get_recurrent_state`` /
  ``update_recurrent_state``): keep the last ``conv_kernel_size`` conv inputs and the recurrent state, exactly as the
  models expect, because the models mutate those tensors in place during single-token decode. Older releases
  (transformers 5.5) speak another protocol to these layers (``compat.linear_attention_protocol``); their layers are
  ``ReferenceSingleStateLinearLayer`` / ``ReferenceSingleStateHybridLayer``.

Nothing here is fast or compileable; everything is easy to check by reading.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, LinearAttentionCacheLayerMixin

from kvconform.compat import (count_linear_tokens, crop_tokens_to_remove, layer_types_and_kwargs,
                              linear_attention_protocol, run_bookkeeping_init)

try:  # not in every supported release (absent from 5.16)
    from transformers.cache_utils import DummyLayer
except ImportError:  # pragma: no cover - depends on the installed transformers
    DummyLayer = None

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
LINEAR_LAYER_TYPES = ("linear_attention", "conv")
HYBRID_LAYER_TYPES = ("hybrid", "hybrid_sliding")
INDEXED_LAYER_TYPE = "indexed_attention"


def _check_crop_sign(tokens_to_remove: int) -> None:
    if tokens_to_remove > 0:
        raise ValueError(
            f"crop({tokens_to_remove}): pass a negative count of tokens to remove, e.g. crop(-3); "
            "positive values (the legacy 'final length' meaning) are not accepted"
        )


class BatchOpsMixin:
    """Beam search and batch surgery for a layer whose held tensors all have the batch as dim 0.

    The layer only says how to apply a function to each of its tensors (``_map_batch``).
    """

    def _map_batch(self, fn) -> None:
        raise NotImplementedError

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row ``i`` becomes old row ``beam_idx[i]`` (beam search); ``beam_idx`` is ``[new_batch]`` int64."""
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times in place: ``[b0, b0, b1, b1, ...]`` (contrastive search)."""
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the rows ``indices`` (int64 indices or a bool mask over the batch)."""
        self._map_batch(lambda t: t[indices])


class ReferenceAttentionLayer(BatchOpsMixin, CacheLayerMixin):
    """Keys and values of one attention layer, kept as a list of chunks, one chunk per ``update`` call.

    Every chunk is a tensor ``[batch, kv_heads, chunk_len, head_dim]`` in the dtype and device the model gave it.
    ``keys`` / ``values`` are ``torch.cat`` of the chunks along dim -2 (``None`` while empty); encoder-decoder
    models read them directly to reuse cross-attention states.

    Args:
        sliding_window: the window of a sliding / chunked layer, or None for full attention. It only sets
            ``is_sliding``: all tokens are kept, and the sliding mask hides the old ones.
    """

    is_compileable = False
    is_croppable = True

    def __init__(self, sliding_window: int | None = None, **ignored_kwargs):
        # No super().__init__(): the mixin would assign ``self.keys``, which is a read-only property here.
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None  # masking_utils sizes sliding masks against such a layer
        self.key_chunks: list[torch.Tensor] = []
        self.value_chunks: list[torch.Tensor] = []
        self.is_initialized = False

    @property
    def keys(self) -> torch.Tensor | None:
        return torch.cat(self.key_chunks, dim=-2) if self.key_chunks else None

    @property
    def values(self) -> torch.Tensor | None:
        return torch.cat(self.value_chunks, dim=-2) if self.value_chunks else None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to allocate ahead of time: chunks are stored as they arrive."""
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append the new keys/values ``[batch, kv_heads, new_len, head_dim]``; return all held so far.

        Returns:
            ``(keys, values)``, each ``[batch, kv_heads, held_len + new_len, head_dim]``; position ``i`` along dim -2
            is absolute token position ``i`` (the mask offset is always 0, see ``get_mask_sizes``).
        """
        self.is_initialized = True
        # Copies: the model's tensors may be views into a larger activation (GPT-2 splits one qkv projection),
        # which the cache should neither keep alive nor share.
        self.key_chunks.append(key_states.clone())
        self.value_chunks.append(value_states.clone())
        return self.keys, self.values

    def get_seq_length(self) -> int:
        """Number of tokens held (an ``int``)."""
        return sum(chunk.shape[-2] for chunk in self.key_chunks)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of the keys the *next* ``update`` will return for ``query_length`` new tokens.

        It is called before ``update``, while building the mask. All tokens are kept, so the next update returns
        ``held + query_length`` keys starting at absolute position 0, for sliding layers as well.
        """
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        """-1: no maximum, the layer grows without bound."""
        return -1

    get_max_cache_shape = get_max_length  # its name on transformers 5.5 (compat.LAYER_MAX_LENGTH_METHODS)

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens (all of them if more than held; 0 is a no-op).

        Raises:
            ValueError: ``tokens_to_remove > 0``.
        """
        _check_crop_sign(tokens_to_remove)
        if tokens_to_remove == 0 or not self.key_chunks:
            return
        keep = max(self.get_seq_length() + tokens_to_remove, 0)
        # copies, not views: a view would pin the whole concatenated buffer (the cropped tokens' bytes) for as long
        # as the layer lives, so the reference would hold more than its formula after every crop
        keys, values = self.keys[..., :keep, :].clone(), self.values[..., :keep, :].clone()
        self.key_chunks, self.value_chunks = ([keys], [values]) if keep > 0 else ([], [])

    def reset(self) -> None:
        """Forget everything (the layer object and its configuration stay)."""
        self.key_chunks, self.value_chunks = [], []
        self.is_initialized = False

    def _map_batch(self, fn) -> None:
        self.key_chunks = [fn(chunk) for chunk in self.key_chunks]
        self.value_chunks = [fn(chunk) for chunk in self.value_chunks]


class ReferenceIndexedLayer(ReferenceAttentionLayer):
    """An attention layer of a sparse-attention model (``indexed_attention``: DeepSeek-V3.2-style DSA, dots3-note,
    GLM-DSA) that also keeps the *indexer keys*: the model's indexer calls ``cache.update_indexer(k, layer_idx)``
    with ``k`` ``[batch, new_len, index_head_dim]`` and scores every held token with what it gets back, to choose
    the top-k tokens its attention reads. Kept like the keys, one chunk per call (along dim 1), and cropped,
    reordered and reset with them."""

    def __init__(self, sliding_window: int | None = None, **ignored_kwargs):
        super().__init__(sliding_window=sliding_window)
        self.indexer_chunks: list[torch.Tensor] = []

    @property
    def indexer_keys(self) -> torch.Tensor | None:
        return torch.cat(self.indexer_chunks, dim=1) if self.indexer_chunks else None

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        """Append the new indexer keys ``[batch, new_len, index_head_dim]``; return all held ``[batch, held +
        new_len, index_head_dim]`` (position ``i`` along dim 1 is absolute token position ``i``)."""
        self.indexer_chunks.append(indexer_key_states.clone())
        return self.indexer_keys

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens' keys, values and indexer keys (see
        ``ReferenceAttentionLayer.crop``)."""
        held = sum(chunk.shape[1] for chunk in self.indexer_chunks)
        super().crop(tokens_to_remove)
        if tokens_to_remove and self.indexer_chunks:
            keep = max(held + tokens_to_remove, 0)
            self.indexer_chunks = [self.indexer_keys[:, :keep]] if keep > 0 else []

    def reset(self) -> None:
        super().reset()
        self.indexer_chunks = []

    def _map_batch(self, fn) -> None:
        super()._map_batch(fn)
        self.indexer_chunks = [fn(chunk) for chunk in self.indexer_chunks]


class ReferenceLinearAttentionLayer(BatchOpsMixin, LinearAttentionCacheLayerMixin):
    """Conv and recurrent states of one linear-attention (SSM) layer.

    **Bookkeeping is transformers', storage is kvconform's.** The layer runs the installed release's own
    ``LinearAttentionCacheLayerMixin.__init__`` and inherits every method of the mixin that only keeps books — the
    token counter and ``increase_count`` / ``get_seq_length`` (5.25), ``record_past`` and what
    ``activate_past_recording`` sets (``recurrent_states_to_keep``, 5.25), ``device`` / ``dtype`` — so a release that
    adds such a field or method reaches the reference without a change here. What it overrides is where the states
    live and how they are rewound: ``update_conv_state``, ``update_recurrent_state``, ``crop``, ``reset`` and the
    batch ops (``BatchOpsMixin``). The one piece of bookkeeping that a release keeps *inside* a storage method — the
    token counter that 5.25's ``LinearAttentionLayer.update_conv_state`` advances — goes through
    ``compat.count_linear_tokens``. ARCHITECTURE.md ("The reference follows the protocol") states the rule.

    The protocol, as the Mamba / Mamba2 / Jamba / Bamba / FalconH1 mixers use it (``transformers.Cache`` reads the
    attribute names set in ``__init__`` directly):

    1. Prefill or chunked continuation (``seq_len > 1``), and every step while past recording is on: the model calls
       ``update_conv_state(x)`` with its conv input ``x`` ``[batch, channels, seq_len]`` and runs a causal conv
       over what it gets back, so the return value must be ``x`` with its real left context prepended. It then
       calls ``update_recurrent_state(s)`` with the SSM state after the last token — or, since 5.25, while
       recording with ``recurrent_states_to_keep = N``, with the list of the states after each of the last N tokens.
    2. Single-token decode (and recording off): the model takes ``get_conv_state()`` ``[batch, channels, K]`` and
       updates it **in place**, without calling ``update_conv_state`` (5.25 calls ``Cache.increase_count`` for the
       token instead); the recurrent state is updated in place (up to 5.24) or handed to ``update_recurrent_state``
       (5.25). So the stored conv state must hold exactly the last ``K = conv_kernel_size`` inputs (zeros before
       the first token), and the stored tensors must be the cache's own (not views of the model's activations).
    3. ``get_*_state`` return None until the conv state of that slot was first written (``has_previous_state``).

    Crop: the conv history is kept whole while recording, so conv-only layers rewind; a recurrent state rewinds only
    to a length whose state was recorded (``activate_past_recording(recurrent_states_to_keep=N)``, 5.25), and
    ``crop`` refuses anything else.

    Args:
        number_of_states: how many independent (conv, recurrent) slots the layer has (``state_idx``), usually 1.
    """

    is_compileable = False
    supports_early_init = False

    def __init__(self, number_of_states: int = 1, **ignored_kwargs):
        run_bookkeeping_init(LinearAttentionCacheLayerMixin, self, number_of_states=number_of_states)
        slots = range(number_of_states)
        self.number_of_states = number_of_states
        self.conv_states = dict.fromkeys(slots)  # slot -> [batch, channels, K] (all history while recording)
        self.recurrent_states = dict.fromkeys(slots)  # slot -> model-defined shape, batch first
        self.conv_kernel_size = dict.fromkeys(slots)  # slot -> K
        self.has_previous_state = dict.fromkeys(slots, False)
        self.is_conv_states_initialized = dict.fromkeys(slots, False)
        self.is_recurrent_states_initialized = dict.fromkeys(slots, False)
        self.record_past = getattr(self, "record_past", False)  # read through Cache.is_recording_past(layer_idx)
        self.tokens_fed = 0  # conv inputs given to update_conv_state (slot 0): the clock of the recorded states
        self.recorded_states: dict = {slot: {} for slot in slots}  # slot -> {tokens_fed: recurrent state}

    def lazy_initialization(self, conv_states=None, recurrent_states=None, state_idx: int = 0, **kwargs) -> None:
        """Nothing to allocate ahead of time: each state is stored when first written."""

    def activate_past_recording(self, *args, **kwargs) -> None:
        """Keep the whole conv input history from now on, so that ``crop`` can rewind it, and, where the release
        asks for ``recurrent_states_to_keep = N > 0`` (5.25), the recurrent state after every token from now on.

        The release's own bookkeeping runs first (``LinearAttentionCacheLayerMixin.activate_past_recording``, with
        whatever arguments it takes). A count of ``None`` is stored as 0 (no intermediate states): transformers 5.25
        stores ``None``, and its mixers then compute ``min(None, seq_len)`` (known fault
        ``linear-recording-none-count``). While recording, the models route single-token decode through
        ``update_conv_state`` as well (step 1).
        """
        LinearAttentionCacheLayerMixin.activate_past_recording(self, *args, **kwargs)
        if getattr(self, "recurrent_states_to_keep", 0) is None:
            self.recurrent_states_to_keep = 0
        self.record_past = True
        if self._records_recurrent_states():  # the state now: where a crop of everything that follows goes back to
            for slot, recorded in self.recorded_states.items():
                held = self.is_recurrent_states_initialized[slot]
                recorded[self.tokens_fed] = self.recurrent_states[slot].clone() if held else None

    def _records_recurrent_states(self) -> bool:
        return self.record_past and bool(getattr(self, "recurrent_states_to_keep", 0))

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, conv_kernel_size: int | None = None,
                          **kwargs) -> torch.Tensor:
        """Store new conv inputs ``[batch, channels, new_len]``; return them with their left context prepended.

        Returns:
            ``[batch, channels, held + new_len]``: ``held`` is what was stored (``K - 1`` zeros on the first call).
        """
        if conv_kernel_size is not None:
            self.conv_kernel_size[state_idx] = conv_kernel_size
        elif self.conv_kernel_size[state_idx] is None:  # older callers pass an input already K wide
            self.conv_kernel_size[state_idx] = conv_states.shape[-1]
        kernel = self.conv_kernel_size[state_idx]

        if self.has_previous_state[state_idx]:
            previous = self.conv_states[state_idx]
        else:  # before the first token the context is zeros, exactly like the uncached conv's padding
            previous = conv_states.new_zeros(*conv_states.shape[:-1], kernel - 1)
        full = torch.cat([previous, conv_states], dim=-1)
        kept = full if self.record_past else full[..., -kernel:]
        self.conv_states[state_idx] = kept.clone()  # our own tensor: decode will mutate it in place
        self.is_conv_states_initialized[state_idx] = True
        self.has_previous_state[state_idx] = True
        if state_idx == 0:
            self.tokens_fed += conv_states.shape[-1]
            count_linear_tokens(self, conv_states.shape[-1])
        return full

    def update_recurrent_state(self, recurrent_states, state_idx: int = 0, **kwargs) -> torch.Tensor:
        """Store the recurrent state after the last token (shape, dtype as the model gives); return the stored copy.

        ``recurrent_states`` is one tensor, or (5.25, recording with ``recurrent_states_to_keep = N``) the list of
        the states after each of the last N tokens of the forward. While recording recurrent states, a copy of each
        is kept under the token count it belongs to, for ``crop``.
        """
        states = [recurrent_states] if isinstance(recurrent_states, torch.Tensor) else list(recurrent_states)
        if self._records_recurrent_states():
            for back, state in enumerate(reversed(states)):
                self.recorded_states[state_idx][self.tokens_fed - back] = state.clone()
        self.recurrent_states[state_idx] = states[-1].clone()  # our own tensor: decode may mutate it in place
        self.is_recurrent_states_initialized[state_idx] = True
        return self.recurrent_states[state_idx]

    @property
    def is_croppable(self) -> bool:
        """True once a conv state is held while past recording is on, and either no recurrent state is held or
        recurrent states are being recorded (a recurrent state rewinds only to a recorded one; ``crop`` says when the
        one asked for is not). Without recording the layer keeps only the ``K - 1`` inputs the next token needs, so
        it promises no crop (``crop(-1)`` of a decoded token may still succeed)."""
        if not any(self.is_conv_states_initialized.values()) or not self.record_past:
            return False  # without recording only K - 1 conv inputs of context are held: no crop can be promised
        return self._records_recurrent_states() or not any(self.is_recurrent_states_initialized.values())

    def get_max_length(self) -> int:
        """-1: a linear-attention layer has no sequence dimension, so no maximum length."""
        return -1

    get_max_cache_shape = get_max_length  # its name on transformers 5.5 (compat.LAYER_MAX_LENGTH_METHODS)

    if hasattr(LinearAttentionCacheLayerMixin, "get_seq_length"):  # 5.25: the layer counts its tokens
        def get_seq_length(self) -> int:
            """Tokens seen, as an ``int``: the attention half's count in a hybrid layer (the next class in the
            MRO), else the release's own counter (5.25 returns its live 0-d tensor, which the next forward
            changes: known fault ``linear-live-length``)."""
            return int(super().get_seq_length())

    def _crop_problem(self, tokens_to_remove: int) -> str | None:
        if tokens_to_remove == 0 or not any(self.is_conv_states_initialized.values()):
            return None
        for slot, held in self.is_recurrent_states_initialized.items():
            if held and (self.tokens_fed + tokens_to_remove) not in self.recorded_states[slot]:
                if not self.record_past:
                    return "it holds a recurrent (SSM) state, which cannot be rewound"
                return (f"it holds a recurrent (SSM) state and none was recorded for the length after crop("
                        f"{tokens_to_remove}); activate_past_recording(recurrent_states_to_keep=N) keeps the last N")
        for slot, conv in self.conv_states.items():  # the next token needs K - 1 inputs of left context
            if conv is not None and conv.shape[-1] + tokens_to_remove < self.conv_kernel_size[slot] - 1:
                removable = conv.shape[-1] - self.conv_kernel_size[slot] + 1
                return (f"at most {removable} conv inputs can be removed (the next token needs the K - 1 before "
                        "them); call activate_past_recording() before the tokens to remove arrive")
        return None

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` conv inputs, and put back the recurrent state recorded at the length
        left (0 is a no-op).

        Raises:
            ValueError: ``tokens_to_remove > 0``.
            RuntimeError: a recurrent state is held and none was recorded for the length left, or the inputs to
                remove plus ``K - 1`` before them are not all held (past recording was not active when they came).
        """
        _check_crop_sign(tokens_to_remove)
        problem = self._crop_problem(tokens_to_remove)
        if problem:
            raise RuntimeError(f"{type(self).__name__} cannot crop({tokens_to_remove}): {problem}")
        if tokens_to_remove == 0:
            return
        for slot, conv in self.conv_states.items():
            if conv is not None:
                self.conv_states[slot] = conv[..., : conv.shape[-1] + tokens_to_remove]
        left = self.tokens_fed + tokens_to_remove
        for slot, recorded in self.recorded_states.items():
            if self.is_recurrent_states_initialized[slot]:
                state = recorded[left]  # None: recording began before the first token, so nothing was held
                self.recurrent_states[slot] = None if state is None else state.clone()
                self.is_recurrent_states_initialized[slot] = state is not None
            self.recorded_states[slot] = {at: state for at, state in recorded.items() if at <= left}
        count_linear_tokens(self, tokens_to_remove)
        self.tokens_fed = left

    def reset(self) -> None:
        """Forget all states (``record_past`` and the kernel sizes stay)."""
        for slot in range(self.number_of_states):
            self.conv_states[slot] = self.recurrent_states[slot] = None
            self.has_previous_state[slot] = False
            self.is_conv_states_initialized[slot] = self.is_recurrent_states_initialized[slot] = False
            self.recorded_states[slot] = {}
        count_linear_tokens(self, None)
        self.tokens_fed = 0

    def _map_batch(self, fn) -> None:
        for states in (self.conv_states, self.recurrent_states):
            for slot, state in states.items():
                if state is not None:
                    states[slot] = fn(state)
        for recorded in self.recorded_states.values():
            for at, state in recorded.items():
                recorded[at] = None if state is None else fn(state)


class ReferenceHybridLayer(ReferenceLinearAttentionLayer, ReferenceAttentionLayer):
    """One layer holding both an SSM state and attention keys/values (FalconH1's ``"hybrid"`` layers).

    It must be an instance of both mixins: ``Cache`` checks ``isinstance`` to route ``update`` and
    ``get_conv_state`` calls. Every method that both parents define is spelled out to call both.
    """

    _linear_base = ReferenceLinearAttentionLayer  # the linear half (ReferenceSingleStateHybridLayer swaps it)

    def __init__(self, number_of_states: int = 1, sliding_window: int | None = None, **ignored_kwargs):
        ReferenceAttentionLayer.__init__(self, sliding_window=sliding_window)
        self._linear_base.__init__(self, number_of_states=number_of_states)

    def crop(self, tokens_to_remove: int) -> None:
        self._linear_base.crop(self, tokens_to_remove)  # raises before anything changed
        ReferenceAttentionLayer.crop(self, tokens_to_remove)

    def reset(self) -> None:
        self._linear_base.reset(self)
        ReferenceAttentionLayer.reset(self)

    def _map_batch(self, fn) -> None:  # used by reorder_cache / batch_repeat_interleave / batch_select_indices
        self._linear_base._map_batch(self, fn)
        ReferenceAttentionLayer._map_batch(self, fn)


class ReferenceSingleStateLinearLayer(ReferenceLinearAttentionLayer):
    """``ReferenceLinearAttentionLayer`` for the *single-state* protocol of older releases (transformers 5.5;
    ``compat.linear_attention_protocol() == "single"``), as the 5.5 Mamba / Mamba2 / Jamba / Bamba / FalconH1 mixers
    use it:

    1. Prefill (``has_previous_state`` False): the model pads or truncates its conv input to exactly ``K`` columns
       itself and calls ``update_conv_state(x)`` with ``x`` ``[batch, channels, K]`` (the last ``K`` inputs, zeros
       before the first token); it runs its own causal conv over the raw input, so the return value is unused.
    2. Later steps: ``update_conv_state(x)`` with the new inputs ``x`` ``[batch, channels, n]`` returns the last
       ``K`` conv inputs ``[batch, channels, K]`` (which the model multiplies with its conv kernel); the model reads
       ``layers[i].recurrent_states`` (a tensor, batch first) and ``layers[i].device`` directly and hands the next
       state to ``update_recurrent_state``. Nothing is mutated in place.
    3. ``Cache.has_previous_state(i)`` reads the layer's ``has_previous_state`` (a bool).

    One (conv, recurrent) pair per layer. While recording (``activate_past_recording``) the conv history is kept
    whole, so ``crop`` can rewind a conv-only layer; a recurrent state is never rewound (``crop`` refuses).

    Raises:
        ValueError: ``number_of_states != 1`` (the single-state protocol has no ``state_idx``).
    """

    def __init__(self, number_of_states: int = 1, **ignored_kwargs):
        if number_of_states != 1:
            raise ValueError(f"the single-state linear-attention protocol holds one state, not {number_of_states}")
        self.number_of_states = 1
        self.conv_states = None  # [batch, channels, K] (the whole history while recording)
        self.recurrent_states = None  # model-defined shape, batch first
        self.conv_kernel_size = None  # K, from the width of the prefill's conv input
        self.has_previous_state = False
        self.is_conv_states_initialized = False
        self.is_recurrent_states_initialized = False
        self.device = self.dtype = None
        self.record_past = False

    def activate_past_recording(self) -> None:
        """Keep the whole conv input history from now on, so that ``crop`` can rewind a conv-only layer."""
        self.record_past = True

    def update_conv_state(self, conv_states: torch.Tensor, **kwargs) -> torch.Tensor:
        """Store conv inputs; return the last ``K`` ``[batch, channels, K]`` (step 1: ``conv_states`` is that)."""
        if not self.has_previous_state:
            self.conv_kernel_size = conv_states.shape[-1]
            self.device, self.dtype = conv_states.device, conv_states.dtype
            full = conv_states
        else:
            full = torch.cat([self.conv_states, conv_states], dim=-1)
        kernel = self.conv_kernel_size
        self.conv_states = (full if self.record_past else full[..., -kernel:]).clone()  # our own tensor
        self.is_conv_states_initialized = self.has_previous_state = True
        return self.conv_states[..., -kernel:]

    def update_recurrent_state(self, recurrent_states: torch.Tensor, **kwargs) -> torch.Tensor:
        """Store the recurrent state after the last token (shape, dtype as the model gives); return the stored copy."""
        self.recurrent_states = recurrent_states.clone()
        self.device = self.device if self.device is not None else recurrent_states.device
        self.is_recurrent_states_initialized = True
        return self.recurrent_states

    @property
    def is_croppable(self) -> bool:
        """True once a conv state is held and no recurrent state is: a recurrent state cannot be rewound."""
        return self.is_conv_states_initialized and not self.is_recurrent_states_initialized

    def _crop_problem(self, tokens_to_remove: int) -> str | None:
        if tokens_to_remove == 0 or not self.is_conv_states_initialized:
            return None
        if self.is_recurrent_states_initialized:
            return "it holds a recurrent (SSM) state, which cannot be rewound"
        if self.conv_states.shape[-1] + tokens_to_remove < self.conv_kernel_size - 1:
            removable = self.conv_states.shape[-1] - self.conv_kernel_size + 1
            return (f"at most {removable} conv inputs can be removed (the next token needs the K - 1 before them); "
                    "call activate_past_recording() before the tokens to remove arrive")
        return None

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` conv inputs (0 is a no-op); see ``ReferenceLinearAttentionLayer.crop``.

        Raises:
            ValueError: ``tokens_to_remove > 0``.
            RuntimeError: a recurrent state is held, or the inputs to remove plus ``K - 1`` are not all held.
        """
        _check_crop_sign(tokens_to_remove)
        problem = self._crop_problem(tokens_to_remove)
        if problem:
            raise RuntimeError(f"{type(self).__name__} cannot crop({tokens_to_remove}): {problem}")
        if tokens_to_remove and self.conv_states is not None:
            self.conv_states = self.conv_states[..., : self.conv_states.shape[-1] + tokens_to_remove]

    def reset(self) -> None:
        """Forget all states (``record_past`` and the kernel size stay)."""
        self.conv_states = self.recurrent_states = None
        self.has_previous_state = self.is_conv_states_initialized = self.is_recurrent_states_initialized = False

    def _map_batch(self, fn) -> None:
        for name in ("conv_states", "recurrent_states"):
            if getattr(self, name) is not None:
                setattr(self, name, fn(getattr(self, name)))


class ReferenceSingleStateHybridLayer(ReferenceSingleStateLinearLayer, ReferenceHybridLayer):
    """``ReferenceHybridLayer`` with the single-state linear half (transformers 5.5, see
    ``ReferenceSingleStateLinearLayer``)."""

    _linear_base = ReferenceSingleStateLinearLayer
    __init__ = ReferenceHybridLayer.__init__
    crop = ReferenceHybridLayer.crop
    reset = ReferenceHybridLayer.reset
    _map_batch = ReferenceHybridLayer._map_batch


def make_reference_layer(layer_type: str, layer_kwargs: dict):
    """The reference layer for one entry of ``get_layer_types_and_kwargs``.

    Raises:
        ValueError: a layer type the reference does not implement.
    """
    window = layer_kwargs.get("sliding_window")
    states = layer_kwargs.get("number_of_states", 1)
    single = linear_attention_protocol() == "single"
    if layer_type in ATTENTION_LAYER_TYPES:
        return ReferenceAttentionLayer(sliding_window=window if layer_type != "full_attention" else None)
    if layer_type == INDEXED_LAYER_TYPE:
        return ReferenceIndexedLayer(sliding_window=window)
    if layer_type in LINEAR_LAYER_TYPES:
        return (ReferenceSingleStateLinearLayer if single else ReferenceLinearAttentionLayer)(number_of_states=states)
    if layer_type in HYBRID_LAYER_TYPES:
        cls = ReferenceSingleStateHybridLayer if single else ReferenceHybridLayer
        return cls(number_of_states=states, sliding_window=window)
    if layer_type == "dummy" and DummyLayer is not None:
        return DummyLayer()
    raise ValueError(f"ReferenceCache has no layer for layer type {layer_type!r}")


def unmodelled_layer_types(config) -> list[str]:
    """The layer types of ``config``'s decoder (``compat.layer_types_and_kwargs``) that ``ReferenceCache`` has no
    layer for, in first-seen order; ``[]`` when it models them all. A model with such a type cannot be judged (the
    reference is what kvconform derives memory formulas and model-fault verdicts from), so it is refused up front."""
    types, _ = layer_types_and_kwargs(config)
    missing: list[str] = []
    for layer_type in types:
        known = (layer_type in ATTENTION_LAYER_TYPES + LINEAR_LAYER_TYPES + HYBRID_LAYER_TYPES
                 or layer_type == INDEXED_LAYER_TYPE or (layer_type == "dummy" and DummyLayer is not None))
        if not known and layer_type not in missing:
            missing.append(layer_type)
    return missing


class ReferenceCache(Cache):
    """The simplest correct cache: every token's keys/values kept, SSM states kept as the models expect.

    ``ReferenceCache(config)`` builds one layer per decoder layer of ``config.get_text_config(decoder=True)``
    (``ReferenceAttentionLayer``, ``ReferenceIndexedLayer``, ``ReferenceLinearAttentionLayer``, ``ReferenceHybridLayer``
    or ``DummyLayer``).
    ``ReferenceCache()`` adds full-attention layers lazily as the model updates them, which is what each half of
    ``EncoderDecoderCache(ReferenceCache(), ReferenceCache())`` needs. Models with SSM layers need the config.

    Args:
        config: a transformers ``PretrainedConfig`` or None.
        **ignored_kwargs: ``max_cache_len``, ``batch_size``, ``device``, ``dtype``... are accepted and ignored:
            the layers take dtype and device from the tensors they are given.

    Raises:
        ValueError: the config has a layer type the reference does not implement.
    """

    def __init__(self, config=None, **ignored_kwargs):
        layer_types, layer_kwargs = layer_types_and_kwargs(config) if config is not None else ([], [])
        if not layer_types:
            # no config, or one whose layer types the installed release reads as none (transformers 5.5 cuts them to
            # layer_types[:-num_kv_shared_layers], so none when that is 0): a full-attention layer per layer index
            # the model updates, as DynamicCache does then
            super().__init__(layer_class_to_replicate=ReferenceAttentionLayer)
        else:
            super().__init__(layers=[make_reference_layer(t, kw) for t, kw in zip(layer_types, layer_kwargs)])

    @property
    def is_compileable(self) -> bool:
        return False

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens in every layer; all-or-nothing.

        The argument follows the installed release's contract (``compat.crop_tokens_to_remove``): a negative count
        of tokens to remove; before 5.20 a positive one is the legacy length to keep (and before 5.14 ``crop(0)``
        empties the cache).

        Raises:
            ValueError: ``tokens_to_remove > 0`` on transformers ≥ 5.20.
            RuntimeError: a linear-attention layer cannot rewind (see ``ReferenceLinearAttentionLayer.crop``);
                no layer is changed then.
        """
        count = -crop_tokens_to_remove(tokens_to_remove, self.get_seq_length)
        for idx, layer in enumerate(self.layers):
            linear = isinstance(layer, ReferenceLinearAttentionLayer)
            problem = layer._crop_problem(count) if linear else None
            if problem:
                raise RuntimeError(f"ReferenceCache cannot crop({tokens_to_remove}): layer {idx} {problem}")
        for layer in self.layers:
            layer.crop(count)
