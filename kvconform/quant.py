"""Quantization on the reference side: the round trips, ``QuantConfig``, the fake-quant twin cache, quality metrics.

This module sits in the reference layer (see ARCHITECTURE.md): it imports only ``compat`` and ``reference``. The
built-in quantized and offloaded subjects are in ``kvconform.subjects``; the judge's twin targets in
``kvconform.checks._twin``.

A quantized cache cannot match the exact oracle: its keys and values are rounded. kvconform holds it to two
comparisons instead:

* **tight, against its fake-quant twin**: ``FakeQuantCache`` is ``ReferenceCache``'s twin that stores keys and
  values through the *same* quantize→dequantize round trip (same bits, group size, axis, residual length and flush
  rule) as the subject declares, written here in plain torch from the backends' published formulas. A subject that
  is wrong *beyond* its rounding (a stale order after a reorder, a dropped residual, keys stored at fewer bits than
  declared) differs from its twin by far more than float noise. The engine's ``judge`` compares a subject whose
  ``CacheSpec.twin`` is set with the twin run on the same ops, same model and dtype, under the exact path's noise
  floor (``kvconform.checks._twin.twin_targets``).
* **a quality budget, against the exact oracle**: KL divergence of the next-token distributions and top-1
  agreement (``quality_metrics``), within the subject's ``Budget`` (``subjects.QUANTIZED_BUDGETS`` for the built-in
  ones; the quality family's checks).

The quantization rules mirrored here (transformers 5.24 ``cache_utils``, optimum-quanto 0.2.7):

* ``QuantizedLayer`` (backends ``quanto``, ``hqq``): the first ``update`` (the prefill) quantizes everything it is
  given but attends the exact keys/values. Every later update attends ``dequant(quantized) ‖ residual ‖ new``
  (exact residual and new tokens); when ``len(residual) + len(new) >= residual_length`` all of that is quantized
  again (old tokens are re-quantized from their dequantized values) and the residual is emptied.
* ``Fp8QuantizedLayer`` (backend ``fp8``): a per-tensor scale ``amax / 448`` (clamped at the float32 ``tiny``) is
  frozen at the first update, whose attention is exact; every later token is cast to ``float8_e4m3fn`` with that
  scale on arrival, and attention reads the dequantized states, new tokens included. No residual.
* quanto's affine round trip (``MaxOptimizer`` + ``quantize_affine`` + ``QBitsDequantizer``): the contiguous tensor
  is split into groups of ``q_group_size`` consecutive elements (axis 0) or per channel (axis -1, see
  ``_group``); per group ``scale = (max - min) / (2**nbits - 1)``, ``shift = -min``,
  ``q = clamp(round((x + shift) / scale), 0, 2**nbits - 1)`` as uint8, ``x̂ = scale * q - shift``.
* HQQ's round trip is HQQ's own optimiser (``hqq.core.quantize.Quantizer``), called exactly as transformers calls
  it: the twin reproduces the cache's bookkeeping around it, not HQQ's arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvconform.compat import layer_types_and_kwargs
from kvconform.reference import BatchOpsMixin

BACKENDS = ("quanto", "hqq", "fp8")
FP8_DTYPE = torch.float8_e4m3fn
DEFAULT_GROUP = 64  # transformers' default q_group_size
DEFAULT_RESIDUAL = 4  # small, so the cases' decode loops cross several flushes (transformers' default is 128)


# ------------------------------------------------------------------------------------------ round trips (fake quant)
def _group(x: torch.Tensor, axis: int, group_size: int) -> torch.Tensor:
    """quanto's grouping: axis 0 → ``[-1, group_size]`` rows of consecutive elements; axis -1 → ``[group_size, -1]``
    columns, one column per (last-dim channel, group of ``group_size`` rows of the flattened leading dims).

    Raises:
        ValueError: ``group_size`` does not divide ``numel / x.shape[axis]`` (quanto's own rule and message).
    """
    axis_dim = x.shape[axis]
    axis_numel = x.numel() // axis_dim
    if group_size > axis_numel or axis_numel % group_size != 0:
        raise ValueError(f"Group size ({group_size}) must be a divisor of ({axis_numel})")
    if axis == 0:
        return x.reshape(-1, group_size)
    grouped = x.reshape(axis_numel // group_size, group_size, axis_dim).permute(1, 2, 0)
    return grouped.reshape(group_size, -1)


def _ungroup(g: torch.Tensor, axis: int, shape) -> torch.Tensor:
    if axis == 0:
        return g.reshape(shape)
    group_size, axis_dim = g.shape[0], shape[axis]
    return g.reshape(group_size, axis_dim, -1).permute(2, 0, 1).reshape(shape)


def affine_roundtrip(x: torch.Tensor, nbits: int, axis: int, group_size: int) -> torch.Tensor:
    """quanto's group-wise affine quantize→dequantize of ``x`` (any shape, float dtype); same shape and dtype.

    ``nbits`` 2 or 4; ``axis`` 0 or -1 (quanto's convention). Written from optimum-quanto 0.2.7's ``MaxOptimizer``,
    ``quantize_affine`` and ``QBitsDequantizer``, op for op, so that in float32 it is bitwise equal to quanto.

    Raises:
        ValueError: bad ``axis`` or a group size that does not divide the tensor (as quanto does).
    """
    if axis not in (0, -1):
        raise ValueError(f"axis must be 0 or -1 (quanto), got {axis}")
    g = _group(x.contiguous(), axis, group_size)
    reduce_axis = axis if g.shape[axis] != 1 else None  # quanto: a single group along the axis → per-tensor
    dims = list(range(1, g.ndim)) if reduce_axis == 0 else list(range(0, g.ndim - 1))
    rmin = torch.amin(g, dim=dims, keepdim=True)
    rmax = torch.amax(g, dim=dims, keepdim=True)
    scale = (rmax - rmin) / (2**nbits - 1)
    shift = -rmin
    q = torch.clamp(torch.round((g + shift) / scale), min=0, max=2**nbits - 1).to(torch.uint8)
    dq = scale * q
    dq -= shift
    return _ungroup(dq, axis, x.shape)


def fp8_scale(x: torch.Tensor) -> torch.Tensor:
    """The per-tensor fp8 scale transformers' ``Fp8QuantizedLayer`` freezes at the first update (float32 scalar)."""
    return (x.abs().amax().float() / torch.finfo(FP8_DTYPE).max).clamp(min=torch.finfo(torch.float32).tiny)


def fp8_roundtrip(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` cast to ``float8_e4m3fn`` with ``scale`` and back, in ``x.dtype`` (as ``Fp8QuantizedLayer`` does)."""
    return ((x.float() / scale).to(FP8_DTYPE).float() * scale).to(x.dtype)


def hqq_roundtrip(x: torch.Tensor, nbits: int, axis: int, group_size: int) -> torch.Tensor:
    """HQQ's quantize→dequantize, called exactly as transformers' ``HQQQuantizedLayer`` calls it.

    Raises:
        ImportError: hqq is not installed (``pip install kvconform[hqq]``).
    """
    from hqq.core.quantize import Quantizer

    q, meta = Quantizer.quantize(x, axis=axis, device=x.device, compute_dtype=x.dtype, nbits=nbits,
                                 group_size=group_size)
    meta["compute_dtype"] = x.dtype
    Quantizer.cuda(q, meta=meta, device=x.device)
    meta["scale"] = meta["scale"].to(q.device)
    meta["zero"] = meta["zero"].to(q.device)
    return Quantizer.dequantize(q, meta).to(x.dtype)


# ------------------------------------------------------------------------------------------ what a subject declares
@dataclass(frozen=True)
class QuantConfig:
    """The quantization a subject declares (the arguments of ``transformers.QuantizedCache``).

    Attributes:
        backend: ``"quanto"``, ``"hqq"`` or ``"fp8"``.
        nbits: 2 or 4 (quanto), 1/2/3/4/8 (hqq); None for fp8 (always 8-bit float, per tensor).
        axis_key, axis_value: quantization axis (quanto: 0 or -1; hqq: 0 or 1).
        q_group_size: elements per group; None → ``group_size_for(config)``.
        residual_length: tokens kept exact before a flush (quanto/hqq).
    """

    backend: str
    nbits: int | None = None
    axis_key: int = 0
    axis_value: int = 0
    q_group_size: int | None = None
    residual_length: int = DEFAULT_RESIDUAL

    @property
    def flush_rule(self) -> str:
        """``"residual"`` (QuantizedLayer: re-quantize everything when the residual fills) or ``"append"`` (fp8)."""
        return "append" if self.backend == "fp8" else "residual"

    def describe(self, config=None) -> str:
        if self.backend == "fp8":
            return "fp8 e4m3, per-tensor scale frozen at the prefill"
        group = self.q_group_size or (group_size_for(config) if config is not None else "auto")
        return (f"{self.backend} {self.nbits}-bit, group {group}, axis k/v {self.axis_key}/{self.axis_value}, "
                f"residual {self.residual_length}")

    def roundtrip(self, x: torch.Tensor, axis: int, group_size: int) -> torch.Tensor:
        """Quantize→dequantize ``x`` along ``axis`` as the backend does (not for fp8: see ``fp8_roundtrip``)."""
        if self.backend == "quanto":
            return affine_roundtrip(x, self.nbits, axis, group_size)
        if self.backend == "hqq":
            return hqq_roundtrip(x, self.nbits, axis, group_size)
        raise ValueError(f"no group-wise round trip for backend {self.backend!r}")


def group_size_for(config) -> int:
    """transformers' default group size 64, reduced to ``gcd(64, kv_heads · head_dim)`` where it does not divide
    the per-token slice: quanto needs the group to divide ``kv_heads · seq_len · head_dim`` at every length it
    quantizes (an odd prefill of llama-tiny, ``2 · 16`` per token, is refused with 64)."""
    text = config.get_text_config(decoder=True)
    heads = getattr(text, "num_attention_heads", None) or getattr(text, "n_head")
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or (getattr(text, "hidden_size", None) or text.n_embd) // heads
    return math.gcd(DEFAULT_GROUP, int(kv_heads) * int(head_dim))


# ------------------------------------------------------------------------------------------ the fake-quant twin
class FakeQuantLayer(BatchOpsMixin, CacheLayerMixin):
    """One attention layer of ``FakeQuantCache``: a quantized part (kept dequantized) and an exact residual.

    Holds ``q_keys``/``q_values`` ``[batch, kv_heads, n_quantized, head_dim]`` (the dequantized values the subject
    should reconstruct) and ``res_keys``/``res_values`` (exact). Beam reorder / batch surgery apply to both parts at
    once, which is what a correct quantized cache must amount to (quantization is row-independent here, and
    transformers 5.24 defers the reorder of its quantized part to the dequantized states, which is the same).
    """

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, qc: QuantConfig, group_size: int):
        self.qc, self.group_size = qc, group_size
        self.keys = self.values = None  # not used: kept for code that inspects layer.keys
        self.q_keys = self.q_values = self.res_keys = self.res_values = None
        self.scales = None
        self.is_initialized = False

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def _rt(self, x, axis):
        return self.qc.roundtrip(x.contiguous(), axis, self.group_size)

    def update(self, key_states, value_states, *args, **kwargs):
        """Store the new states per the backend's flush rule; return what the subject's attention should read."""
        first = not self.is_initialized
        self.is_initialized = True
        k, v = key_states, value_states
        if self.qc.flush_rule == "append":
            if first:
                self.scales = (fp8_scale(k), fp8_scale(v))
                self.q_keys, self.q_values = fp8_roundtrip(k, self.scales[0]), fp8_roundtrip(v, self.scales[1])
                return k, v
            self.q_keys = torch.cat([self.q_keys, fp8_roundtrip(k, self.scales[0])], dim=-2)
            self.q_values = torch.cat([self.q_values, fp8_roundtrip(v, self.scales[1])], dim=-2)
            return self.q_keys, self.q_values
        if first:
            self.q_keys, self.q_values = self._rt(k, self.qc.axis_key), self._rt(v, self.qc.axis_value)
            self.res_keys, self.res_values = k[..., :0, :].clone(), v[..., :0, :].clone()
            return k, v
        keys = torch.cat([self.q_keys, self.res_keys, k], dim=-2)
        values = torch.cat([self.q_values, self.res_values, v], dim=-2)
        if self.res_keys.shape[-2] + k.shape[-2] >= self.qc.residual_length:
            self.q_keys, self.q_values = self._rt(keys, self.qc.axis_key), self._rt(values, self.qc.axis_value)
            self.res_keys, self.res_values = k[..., :0, :].clone(), v[..., :0, :].clone()
        else:
            self.res_keys = torch.cat([self.res_keys, k], dim=-2)
            self.res_values = torch.cat([self.res_values, v], dim=-2)
        return keys, values

    def get_seq_length(self) -> int:
        if not self.is_initialized:
            return 0
        return self.q_keys.shape[-2] + (self.res_keys.shape[-2] if self.res_keys is not None else 0)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    get_max_cache_shape = get_max_length  # its name on transformers 5.5 (compat.LAYER_MAX_LENGTH_METHODS)

    def crop(self, tokens_to_remove: int) -> None:
        """Refused: like ``QuantizedCache``, the twin is not croppable (``is_croppable`` is False).

        Raises:
            NotImplementedError: always, unless ``tokens_to_remove == 0``.
        """
        if tokens_to_remove:
            raise NotImplementedError("FakeQuantCache cannot crop: a quantized cache is not croppable")

    def reset(self) -> None:
        self.q_keys = self.q_values = self.res_keys = self.res_values = self.scales = None
        self.is_initialized = False

    def _map_batch(self, fn) -> None:
        for name in ("q_keys", "q_values", "res_keys", "res_values"):
            if getattr(self, name) is not None:
                setattr(self, name, fn(getattr(self, name)))


class FakeQuantCache(Cache):
    """``ReferenceCache``'s fake-quant twin: what a correct quantized cache of ``qc`` would hold and return.

    Args:
        config: the model config; every decoder layer must be full attention (as ``QuantizedCache`` demands).
        qc: the declared ``QuantConfig``.
        **ignored_kwargs: the other construction kwargs (``max_cache_len``, ``device``...).

    Raises:
        ValueError: a layer type other than ``full_attention``.
    """

    def __init__(self, config, qc: QuantConfig, **ignored_kwargs):
        types, _ = layer_types_and_kwargs(config)
        bad = sorted(set(types) - {"full_attention"})
        if bad:
            raise ValueError(f"FakeQuantCache supports full-attention layers only, got {bad}")
        group = qc.q_group_size or group_size_for(config)
        super().__init__(layers=[FakeQuantLayer(qc, group) for _ in types])
        self.qc = qc

    @property
    def is_compileable(self) -> bool:
        return False


def twin_factory(qc: QuantConfig):
    """The ``CacheSpec.twin`` factory for a subject declaring ``qc``."""

    def twin(config, **ignored):
        return FakeQuantCache(config, qc)

    twin.__name__ = "FakeQuantCache"
    twin.quant_config = qc
    return twin


def quantized_factory(qc: QuantConfig):
    """A factory building ``transformers.QuantizedCache`` with ``qc`` for a model config."""

    def build(config):
        from transformers import QuantizedCache

        if qc.backend == "fp8":
            return QuantizedCache("fp8", config)
        return QuantizedCache(qc.backend, config, nbits=qc.nbits, axis_key=qc.axis_key, axis_value=qc.axis_value,
                              q_group_size=qc.q_group_size or group_size_for(config),
                              residual_length=qc.residual_length)

    build.quant_config = qc
    return build


# ------------------------------------------------------------------------------------------ built-in declarations
QUANTIZED = (
    ("QuantizedCache_quanto4", QuantConfig("quanto", nbits=4)),
    ("QuantizedCache_quanto2", QuantConfig("quanto", nbits=2)),
    ("QuantizedCache_hqq4", QuantConfig("hqq", nbits=4)),
    ("QuantizedCache_hqq2", QuantConfig("hqq", nbits=2)),
    ("QuantizedCache_fp8", QuantConfig("fp8")),
)
"""``(subject name, QuantConfig)`` of the built-in ``QuantizedCache`` subjects (``subjects.quantized_subjects``)."""


# ------------------------------------------------------------------------------------------ quality metrics
def quality_metrics(observed, oracle) -> dict:
    """Next-token quality of ``observed`` logits against the float64 ``oracle`` logits (both ``[B, T, V]``).

    Returns ``{"kl_mean", "kl_worst", "top1", "positions", "worst"}``: KL(p_oracle ‖ p_observed) in nats per position
    (mean and maximum over the ``B·T`` positions), the fraction of positions whose argmax agrees, the number of
    positions, and ``(batch, offset)`` of the worst KL. Non-finite observed logits give ``kl = inf``.
    """
    obs = observed.detach().to("cpu", torch.float64)
    ref = oracle.detach().to("cpu", torch.float64)
    if not torch.isfinite(obs).all():
        return {"kl_mean": math.inf, "kl_worst": math.inf, "top1": 0.0, "positions": int(obs.shape[0] * obs.shape[1]),
                "worst": (0, 0)}
    logp = torch.log_softmax(ref, dim=-1)
    logq = torch.log_softmax(obs, dim=-1)
    kl = (logp.exp() * (logp - logq)).sum(-1).clamp(min=0)  # [B, T]
    flat = int(kl.argmax())
    return {"kl_mean": float(kl.mean()), "kl_worst": float(kl.max()),
            "top1": float((obs.argmax(-1) == ref.argmax(-1)).double().mean()),
            "positions": int(kl.numel()), "worst": (flat // kl.shape[1], flat % kl.shape[1])}
