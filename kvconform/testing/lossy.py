"""A correct lossy cache, written the way a cache author would, and faulty variants that self-consistency must catch.

``Int8ResidualCache`` quantizes every attention key/value vector to int8 with its own absmax scale (per batch row,
KV head and token, over ``head_dim``: ``scale = max|x| / 127``, ``q = round(x / scale)``) and keeps the ``residual``
most recent tokens exact (KIVI-style: the recent tokens matter most for attention). A token leaves the residual
window — and is quantized — as soon as ``residual`` newer tokens follow it. Linear-attention (Mamba-style) states are
kept exactly, as in ``kvconform.reference``.

Crop: once quantized, a token cannot be made exact again, yet after ``crop(-n)`` the last ``residual`` tokens must be
exact again for the cache to behave like one that never saw the cropped tokens (a fresh instance fed the same
history). So the cache keeps the exact values of its last ``residual + rollback`` tokens (the *exact tail*): a crop
that keeps its new residual inside the tail is lossless; a deeper one is refused with a ``ValueError`` naming
``rollback``. Memory: int8 values + one float32 scale per vector for the quantized tokens, plus the exact tail
(``residual + rollback`` tokens per layer, constant), so on long contexts the cache holds well under a quarter of the
bytes of an fp32 cache plus a constant.

The class is deterministic (no randomness, per-token quantization independent of when a token is flushed), so
kvconform judges it by self-consistency exactly: every operation must give the logits of a fresh instance fed the
equivalent history.

Faulty variants (``FAULTY``, each one realistic bug caught by self-consistency with its cause line):
``Int8ReorderResidualOnly`` (reorder_cache moves only the exact tail, as transformers 5.5–5.18's QuantizedLayer did),
``Int8ReorderQuantizedOnly`` (only the quantized part), ``Int8CropIgnoresResidual`` (crop cuts the quantized part and
leaves the residual as it was) and ``Int8ResetKeepsQuantized`` (reset clears counters and the residual but keeps the
quantized buffers, which the next sequence then reads). ``Int8DequantPerToken`` keeps exact logits and bytes but
dequantizes its history token by token in Python at every step: the speed family's quantized budget must catch it.
``Int8ScaleOffByOne`` dequantizes each token with its predecessor's scale: every instance errs alike, so only the
quality budget against the oracle can catch it.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from kvconform.reference import (ATTENTION_LAYER_TYPES, HYBRID_LAYER_TYPES, BatchOpsMixin, ReferenceCache,
                                 ReferenceLinearAttentionLayer, ReferenceSingleStateLinearLayer, _check_crop_sign,
                                 make_reference_layer)
from kvconform.compat import layer_types_and_kwargs, linear_attention_protocol
from kvconform.testing import FaultyCache

INT8_BUDGET = {"kl_max": 1e-4, "top1_min": 0.95}
"""Quality budget of ``Int8ResidualCache`` (mean KL(oracle ‖ subject) in nats per position, top-1 agreement with the
float64 oracle). Measured over 223 greedy-free decode steps after a 32-token prompt (batch 2, fp32, residual 4) on
the 12 zoo models with attention layers: mean KL 1e-6 … 2.1e-5 (qwen2), top-1 0.984 (phi3) … 1.0; the budget
leaves ~5× on the KL and ~3 points on top-1."""


def quantize(x: torch.Tensor):
    """Per-vector absmax int8 quantization over the last dim.

    Args:
        x: ``[..., D]`` float tensor.

    Returns:
        ``(q, scale)``: ``q`` int8 ``[..., D]`` in ``[-127, 127]``, ``scale`` float32 ``[..., 1]`` (``max|x| / 127``;
        0 for an all-zero vector, which dequantizes to zeros).
    """
    scale = x.detach().float().abs().amax(dim=-1, keepdim=True) / 127.0
    q = torch.round(x.float() / scale.clamp_min(torch.finfo(torch.float32).tiny)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    """``q * scale`` in ``dtype`` (``[..., D]``)."""
    return (q.float() * scale).to(dtype)


class Int8ResidualLayer(BatchOpsMixin, CacheLayerMixin):
    """Keys/values of one attention layer: quantized tokens ``[0, n_quant)`` and an exact tail of the last
    ``residual + rollback`` tokens (``[tail_start, length)``); attention reads ``dequantized[0, n_quant)`` followed by
    the exact ``[n_quant, length)`` (``n_quant = max(length - residual, 0)``).

    Tensors (all batch first): ``qk`` / ``qv`` int8 ``[B, H, n_quant, D]``, ``sk`` / ``sv`` float32
    ``[B, H, n_quant, 1]``, ``tail_k`` / ``tail_v`` ``[B, H, length - tail_start, D]`` in the model's dtype.

    Args:
        residual: exact recent tokens attention sees (≥ 0).
        rollback: exact copies kept beyond the residual so that ``crop(-n)`` with ``n ≤ rollback`` is lossless.
        sliding_window: only sets ``is_sliding`` (the mask hides old tokens; nothing is evicted).
    """

    is_compileable = False
    is_croppable = True

    def __init__(self, residual: int = 4, rollback: int = 32, sliding_window: int | None = None, **ignored):
        # No super().__init__(): keys/values are read-only properties here.
        self.residual, self.rollback = int(residual), int(rollback)
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self._clear()

    def _clear(self) -> None:
        self.qk = self.qv = self.sk = self.sv = self.tail_k = self.tail_v = None
        self.length = self.n_quant = self.tail_start = 0
        self.dtype = None
        self.is_initialized = False

    # ------------------------------------------------------------------ what attention reads
    def _served(self, tensors) -> torch.Tensor | None:
        q, s, tail = tensors
        if tail is None:
            return None
        exact = tail[..., self.n_quant - self.tail_start:, :]
        if self.n_quant == 0:
            return exact
        return torch.cat([dequantize(q[..., :self.n_quant, :], s[..., :self.n_quant, :], self.dtype), exact], dim=-2)

    @property
    def keys(self) -> torch.Tensor | None:
        """``[B, H, length, D]``: dequantized old tokens, then the exact residual (None while empty)."""
        return self._served((self.qk, self.sk, self.tail_k))

    @property
    def values(self) -> torch.Tensor | None:
        """``[B, H, length, D]``, like ``keys``."""
        return self._served((self.qv, self.sv, self.tail_v))

    # ------------------------------------------------------------------ the model's calls
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Empty stores shaped like ``key_states`` ``[B, H, *, D]`` (int8 / float32 / the model's dtype)."""
        self._init_attention(key_states, value_states)

    def _init_attention(self, key_states, value_states) -> None:
        b, h, _, d = key_states.shape
        self.dtype = key_states.dtype
        empty = dict(device=key_states.device)
        self.qk = torch.empty(b, h, 0, d, dtype=torch.int8, **empty)
        self.qv = torch.empty(b, h, 0, value_states.shape[-1], dtype=torch.int8, **empty)
        self.sk = torch.empty(b, h, 0, 1, dtype=torch.float32, **empty)
        self.sv = torch.empty(b, h, 0, 1, dtype=torch.float32, **empty)
        self.tail_k, self.tail_v = key_states[..., :0, :].clone(), value_states[..., :0, :].clone()
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``[B, H, k, D]`` new keys/values, quantize the tokens that left the residual window, return what
        attention reads: ``(keys, values)`` ``[B, H, length + k, D]`` (position ``i`` is absolute token ``i``)."""
        if not self.is_initialized:
            self._init_attention(key_states, value_states)  # by name: a hybrid layer's linear half has its own
        self.tail_k = torch.cat([self.tail_k, key_states.to(self.dtype)], dim=-2)
        self.tail_v = torch.cat([self.tail_v, value_states.to(self.dtype)], dim=-2)
        self.length += key_states.shape[-2]
        self._flush()
        return self.keys, self.values

    quantize = staticmethod(quantize)  # the quantizer (a faulty variant may replace it)

    def _flush(self) -> None:
        """Quantize tokens ``[n_quant, length - residual)`` from the exact tail; trim the tail to
        ``residual + rollback`` tokens."""
        target = max(self.length - self.residual, 0)
        if target > self.n_quant:
            lo, hi = self.n_quant - self.tail_start, target - self.tail_start
            qk, sk = self.quantize(self.tail_k[..., lo:hi, :])
            qv, sv = self.quantize(self.tail_v[..., lo:hi, :])
            self._append_quantized(qk, sk, qv, sv)
            self.n_quant = target
        keep_from = max(self.length - self.residual - self.rollback, self.tail_start)
        if keep_from > self.tail_start:
            self.tail_k = self.tail_k[..., keep_from - self.tail_start:, :]
            self.tail_v = self.tail_v[..., keep_from - self.tail_start:, :]
            self.tail_start = keep_from

    def _append_quantized(self, qk, sk, qv, sv) -> None:
        self.qk, self.sk = torch.cat([self.qk, qk], dim=-2), torch.cat([self.sk, sk], dim=-2)
        self.qv, self.sv = torch.cat([self.qv, qv], dim=-2), torch.cat([self.sv, sv], dim=-2)

    def get_seq_length(self) -> int:
        """Tokens held."""
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(length + query_length, 0)``: every token is kept (see ``ReferenceAttentionLayer.get_mask_sizes``)."""
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        """-1: no maximum."""
        return -1

    get_max_cache_shape = get_max_length

    # ------------------------------------------------------------------ cache operations
    def crop_problem(self, tokens_to_remove: int) -> str | None:
        """Why ``crop(tokens_to_remove)`` cannot be lossless here, or None."""
        keep = self.length + tokens_to_remove
        if tokens_to_remove == 0 or keep <= 0 or not self.is_initialized:
            return None
        if max(keep - self.residual, 0) < self.tail_start:
            return (f"the {self.residual} tokens before position {keep} must be exact again, but only tokens from "
                    f"{self.tail_start} on are kept exact (rollback={self.rollback}): crop at most "
                    f"{self.length - self.residual - self.tail_start} tokens here, or build the cache with a larger "
                    f"rollback")
        return None

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens (all, if more are asked; 0 is a no-op). The new residual is
        restored exact from the tail, so the layer equals one fed only the kept tokens.

        Raises:
            ValueError: ``tokens_to_remove > 0``, or a crop deeper than the exact tail (``crop_problem``).
        """
        _check_crop_sign(tokens_to_remove)
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        keep = self.length + tokens_to_remove
        if keep <= 0:
            self._empty_keep_shapes()
            return
        problem = self.crop_problem(tokens_to_remove)
        if problem:
            raise ValueError(f"Int8ResidualLayer cannot crop({tokens_to_remove}): {problem}")
        self._cut(keep)

    def _cut(self, keep: int) -> None:
        n_quant = max(keep - self.residual, 0)
        self.qk, self.qv = self.qk[..., :n_quant, :], self.qv[..., :n_quant, :]
        self.sk, self.sv = self.sk[..., :n_quant, :], self.sv[..., :n_quant, :]
        self.tail_k = self.tail_k[..., :keep - self.tail_start, :]
        self.tail_v = self.tail_v[..., :keep - self.tail_start, :]
        self.length, self.n_quant = keep, n_quant

    def _empty_keep_shapes(self) -> None:
        for name in ("qk", "qv", "sk", "sv", "tail_k", "tail_v"):
            setattr(self, name, getattr(self, name)[..., :0, :])
        self.length = self.n_quant = self.tail_start = 0

    def reset(self) -> None:
        """Forget everything (the configuration stays)."""
        self._clear()

    def _map_batch(self, fn) -> None:
        """Apply a batch-dim function to every stored tensor: quantized values, scales and the exact tail."""
        self._map_quantized(fn)
        self._map_tail(fn)

    def _map_quantized(self, fn) -> None:
        if self.qk is not None:
            self.qk, self.qv, self.sk, self.sv = fn(self.qk), fn(self.qv), fn(self.sk), fn(self.sv)

    def _map_tail(self, fn) -> None:
        if self.tail_k is not None:
            self.tail_k, self.tail_v = fn(self.tail_k), fn(self.tail_v)


class Int8HybridLayer(ReferenceLinearAttentionLayer, Int8ResidualLayer):
    """A layer with both an exact SSM state and int8 attention keys/values (FalconH1's ``"hybrid"`` layers); see
    ``kvconform.reference.ReferenceHybridLayer`` for why every shared method is spelled out."""

    _linear_base = ReferenceLinearAttentionLayer

    def __init__(self, number_of_states: int = 1, sliding_window: int | None = None, attention_class=None,
                 **kwargs):
        (attention_class or Int8ResidualLayer).__init__(self, sliding_window=sliding_window, **kwargs)
        self._linear_base.__init__(self, number_of_states=number_of_states)

    def crop(self, tokens_to_remove: int) -> None:
        self._linear_base.crop(self, tokens_to_remove)
        Int8ResidualLayer.crop(self, tokens_to_remove)

    def reset(self) -> None:
        self._linear_base.reset(self)
        Int8ResidualLayer.reset(self)

    def _map_batch(self, fn) -> None:
        self._linear_base._map_batch(self, fn)
        Int8ResidualLayer._map_batch(self, fn)


class Int8SingleStateHybridLayer(ReferenceSingleStateLinearLayer, Int8HybridLayer):
    """``Int8HybridLayer`` with the single-state linear half of older releases (transformers 5.5)."""

    _linear_base = ReferenceSingleStateLinearLayer
    __init__ = Int8HybridLayer.__init__
    crop = Int8HybridLayer.crop
    reset = Int8HybridLayer.reset
    _map_batch = Int8HybridLayer._map_batch


class Int8ResidualCache(ReferenceCache):
    """A lossy cache: int8 per-token absmax keys/values with an exact residual of recent tokens (module docstring).

    ``Int8ResidualCache(config, residual=4, rollback=32)``: one layer per decoder layer of the config (attention
    layers ``Int8ResidualLayer``, linear-attention layers exact as in ``ReferenceCache``); without a config,
    attention layers are added lazily (each half of an ``EncoderDecoderCache``). Other keyword arguments
    (``max_cache_len``, ``batch_size``, ``device``, ``dtype``) are accepted and ignored.

    ``residual=4`` by default so that the zoo's short cases (≤ 30 tokens) reach the quantizer.

    Raises:
        ValueError: a layer type it does not implement; a crop deeper than its exact tail (``Int8ResidualLayer.crop``).
    """

    kvconform_lossy = INT8_BUDGET
    layer_class = Int8ResidualLayer

    def __init__(self, config=None, residual: int = 4, rollback: int = 32, **ignored_kwargs):
        from transformers.cache_utils import Cache

        self.residual, self.rollback = residual, rollback
        cls = type(self).layer_class

        def make(**kw):
            return cls(residual=residual, rollback=rollback, **kw)

        if config is None:
            Cache.__init__(self, layer_class_to_replicate=make)
            return
        hybrid = Int8SingleStateHybridLayer if linear_attention_protocol() == "single" else Int8HybridLayer
        layers = []
        for layer_type, kw in zip(*layer_types_and_kwargs(config)):
            window = kw.get("sliding_window")
            if layer_type in ATTENTION_LAYER_TYPES:
                layers.append(make(sliding_window=window if layer_type != "full_attention" else None))
            elif layer_type in HYBRID_LAYER_TYPES:
                layers.append(hybrid(number_of_states=kw.get("number_of_states", 1), sliding_window=window,
                                     attention_class=cls, residual=residual, rollback=rollback))
            else:
                layers.append(make_reference_layer(layer_type, kw))
        Cache.__init__(self, layers=layers)

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens in every layer; all-or-nothing (see ``ReferenceCache.crop``).

        Raises:
            ValueError: a positive count (transformers ≥ 5.20), or a crop deeper than an attention layer's exact tail.
            RuntimeError: a linear-attention layer cannot rewind.
        """
        from kvconform.compat import crop_tokens_to_remove

        count = -crop_tokens_to_remove(tokens_to_remove, self.get_seq_length)
        for idx, layer in enumerate(self.layers):
            problem = layer.crop_problem(count) if isinstance(layer, Int8ResidualLayer) else None
            if problem:
                raise ValueError(f"Int8ResidualCache cannot crop({tokens_to_remove}): layer {idx}: {problem}")
        super().crop(tokens_to_remove)


# ------------------------------------------------------------------------------------------------ faulty variants
class _ReorderResidualOnlyLayer(Int8ResidualLayer):
    def reorder_cache(self, beam_idx):
        self._map_tail(lambda t: t.index_select(0, beam_idx.to(t.device)))


class Int8ReorderResidualOnly(Int8ResidualCache):
    """FAULTY: ``reorder_cache`` moves the exact residual but leaves the quantized part in the old row order."""

    layer_class = _ReorderResidualOnlyLayer


class _ScaleOffByOneLayer(Int8ResidualLayer):
    def _served(self, tensors):
        q, s, tail = tensors
        if s is not None and s.shape[-2] > 1:  # each token dequantized with the previous token's scale
            s = torch.cat([s[..., :1, :], s[..., :-1, :]], dim=-2)
        return super()._served((q, s, tail))


class Int8ScaleOffByOne(Int8ResidualCache):
    """FAULTY: dequantizes every token with the scale of the token before it (an off-by-one index into the scales).
    Every instance makes the same error, so self-consistency cannot see it; only the quality budget against the
    float64 oracle does."""

    layer_class = _ScaleOffByOneLayer


class _ReorderQuantizedOnlyLayer(Int8ResidualLayer):
    def reorder_cache(self, beam_idx):
        self._map_quantized(lambda t: t.index_select(0, beam_idx.to(t.device)))


class Int8ReorderQuantizedOnly(Int8ResidualCache):
    """FAULTY: ``reorder_cache`` moves the quantized part but leaves the exact residual in the old row order."""

    layer_class = _ReorderQuantizedOnlyLayer


class _CropIgnoresResidualLayer(Int8ResidualLayer):
    def crop(self, tokens_to_remove):
        _check_crop_sign(tokens_to_remove)
        n = -tokens_to_remove
        if n == 0 or not self.is_initialized:
            return
        if n >= self.length:
            self._empty_keep_shapes()
            return
        from_quantized = min(n, self.n_quant)  # the cut lands on the quantized part; the residual keeps its tokens
        rest = n - from_quantized
        old = self.n_quant - self.tail_start
        self.n_quant -= from_quantized
        for name in ("qk", "qv", "sk", "sv"):
            setattr(self, name, getattr(self, name)[..., :self.n_quant, :])
        end = self.tail_k.shape[-2] - rest
        self.tail_k, self.tail_v = self.tail_k[..., old:end, :], self.tail_v[..., old:end, :]
        self.tail_start = self.n_quant  # the old residual now follows the shortened quantized part
        self.length -= n


class Int8CropIgnoresResidual(Int8ResidualCache):
    """FAULTY: ``crop`` removes tokens from the end of the quantized part and leaves the exact residual as it was,
    so the cropped tokens stay attended and older kept ones are gone."""

    layer_class = _CropIgnoresResidualLayer

    def crop(self, tokens_to_remove):
        ReferenceCache.crop(self, tokens_to_remove)


class _ResetKeepsQuantizedLayer(Int8ResidualLayer):
    def reset(self):
        kept = (self.qk, self.qv, self.sk, self.sv)
        self._clear()
        self._kept = kept

    def _init_attention(self, key_states, value_states):
        super()._init_attention(key_states, value_states)
        kept = getattr(self, "_kept", None)
        if kept is not None and kept[0] is not None and kept[0].shape[0] == key_states.shape[0]:
            # the old sequence's quantized tokens stay at the start of the buffers, and n_quant counts from 0:
            # the next sequence's flushed tokens are appended behind them and never read
            self.qk, self.qv, self.sk, self.sv = kept


class Int8ResetKeepsQuantized(Int8ResidualCache):
    """FAULTY: ``reset`` clears the residual and the counters but keeps the quantized buffers; the next sequence
    appends behind them and reads the previous sequence's quantized tokens in place of its own."""

    layer_class = _ResetKeepsQuantizedLayer


class _RequantOnBatchOpLayer(Int8ResidualLayer):
    def _map_batch(self, fn) -> None:
        if self.tail_k is not None and self.tail_k.shape[-2]:
            # BUG: "one code path for every layout change": the store is rebuilt from its decoded view, so the
            # exact tail comes back quantized (turboquant-kv 1.0.0 decodes and re-quantizes on every batch op)
            self.tail_k = dequantize(*quantize(self.tail_k), self.dtype)
            self.tail_v = dequantize(*quantize(self.tail_v), self.dtype)
        super()._map_batch(fn)


class Int8RequantOnBatchOp(Int8ResidualCache):
    """FAULTY: every batch op (reorder, select, repeat) rebuilds the store from its decoded view, quantizing the
    exact tail: an identity reorder or ``repeat(1)`` moves the next logits by the int8 error of the recent tokens."""

    layer_class = _RequantOnBatchOpLayer


class _WideCodesLayer(Int8ResidualLayer):
    def _append_quantized(self, qk, sk, qv, sv) -> None:
        # BUG: codes kept as int64 "indices" (what torch.bucketize / argmin return), never narrowed to int8
        super()._append_quantized(qk.to(torch.int64), sk, qv.to(torch.int64), sv)

    def _init_attention(self, key_states, value_states) -> None:
        super()._init_attention(key_states, value_states)
        self.qk, self.qv = self.qk.to(torch.int64), self.qv.to(torch.int64)


class Int8WideCodes(Int8ResidualCache):
    """FAULTY: quantizes to 255 levels but stores the codes as int64: 8 bytes a value where the float32 original took
    4, so the "compressed" cache holds more than an exact one."""

    layer_class = _WideCodesLayer


class _DequantPerTokenLayer(Int8ResidualLayer):
    def _served(self, tensors) -> torch.Tensor | None:
        q, s, tail = tensors
        if tail is None or self.n_quant == 0:
            return super()._served(tensors)
        # BUG: "a token is a page": each quantized token is dequantized on its own, in a Python loop, at every
        # step: O(context) interpreter steps per decoded token (the logits stay those of the correct cache)
        pages = [dequantize(q[..., i:i + 1, :], s[..., i:i + 1, :], self.dtype) for i in range(self.n_quant)]
        return torch.cat([*pages, tail[..., self.n_quant - self.tail_start:, :]], dim=-2)


class Int8DequantPerToken(Int8ResidualCache):
    """FAULTY: dequantizes its history one token at a time in a Python loop at every decode step — the same bytes
    and logits as ``Int8ResidualCache``, but each step costs O(context) interpreter work, so decoding at context 512
    is slower than not caching at all."""

    layer_class = _DequantPerTokenLayer


_M = "kvconform.testing.lossy"
FAULTY = [
    FaultyCache("int8_reorder_residual_only", "Int8ReorderResidualOnly", _M, "batch", "check_reorder_then_decode",
                "llama", ("vs a fresh Int8ReorderResidualOnly fed the equivalent history",
                          "likely cause: reorder_cache() did not move every part of the cache"),
                case="reorder_padded", cause=r"reorder_cache\(\) did not move every part of the cache"),
    FaultyCache("int8_reorder_quantized_only", "Int8ReorderQuantizedOnly", _M, "batch", "check_reorder_then_decode",
                "llama", ("vs a fresh Int8ReorderQuantizedOnly fed the equivalent history",
                          "likely cause: reorder_cache() did not move every part of the cache"),
                case="reorder_padded", cause=r"reorder_cache\(\) did not move every part of the cache"),
    FaultyCache("int8_crop_ignores_residual", "Int8CropIgnoresResidual", _M, "crop", "check_crop_then_continue",
                "llama", ("vs a fresh Int8CropIgnoresResidual fed the equivalent history",
                          "likely cause: crop() did not cut every part of the cache"), case="crop_short",
                cause=r"crop\(\) did not cut every part of the cache"),
    FaultyCache("int8_reset_keeps_quantized", "Int8ResetKeepsQuantized", _M, "lifecycle", "check_reset_then_reuse",
                "llama", ("vs a fresh Int8ResetKeepsQuantized fed the equivalent history",
                          "likely cause: reset() did not clear every part of the cache"), case="reset_reuse",
                cause=r"reset\(\) did not clear every part of the cache"),
    FaultyCache("int8_requant_on_batch_op", "Int8RequantOnBatchOp", _M, "batch", "check_identity_ops", "llama",
                ("check_identity_ops failed: Int8RequantOnBatchOp on llama", "vs the same cache without it"),
                also_caught_by=("batch", "fuzz", "prefix", "lifecycle", "contract"), case="identity_ops",
                cause=r"reorder_cache\(\) rebuilds the store instead of permuting it"),
    FaultyCache("int8_wide_codes", "Int8WideCodes", _M, "quality", "check_compression_real", "llama",
                ("check_compression_real failed: Int8WideCodes on llama",),
                case="compression_long",
                cause=r"the compressed codes are stored in wide dtypes — layers\[0\]\.qk int64 holding \d+ levels "
                      r"\(8 bits needed, 64 stored\)"),
    FaultyCache("int8_scale_off_by_one", "Int8ScaleOffByOne", _M, "quality", "check_quality_budget", "llama",
                ("check_quality_budget failed: Int8ScaleOffByOne on llama", "KL(oracle ‖ subject) ="),
                also_caught_by=("batch",),  # the left-padded row reads a pad's scale: check_padded_row_alone
                case="quality_long", cause=r"one every instance makes alike — a scale or zero point read for the "
                                            r"wrong token"),
    FaultyCache("int8_dequant_per_token", "Int8DequantPerToken", _M, "speed", "check_speed_vs_uncached",
                "llama",
                ("check_speed_vs_uncached failed: Int8DequantPerToken on llama",
                 "(the budget of a quantized cache, which dequantizes every step)"),
                case="speed_vs_uncached", cause=r"O\(context\) work per step"),
]
"""The faulty variants of ``Int8ResidualCache`` (collected by ``kvconform.testing.faulty_caches``)."""
