"""What is measured on a cache when a forward fails or raises, read by ``_diagnosis``: non-finite values it holds
(``nonfinite_in``), every ``update()`` call of one forward (``UpdateWatch``), the facts at a raise
(``raise_facts``), what its layers answer as ``keys`` / ``values`` (``public_kv_facts``), a fixed-size cache attended
without its mask (``unmasked_slots``) and layer lengths against what attention needs (``kv_length_mismatch``). Reads
the cache through ``_measure``.
"""

from __future__ import annotations

from typing import Any

from kvconform import compat
from kvconform.failure import Cause
from kvconform.checks._measure import (cache_layers, held_tensor_items, layer_list, read_attr, self_half,
                                       tensors_of)


def nonfinite_in(cache) -> str | None:
    """Where the first NaN/inf is among the floating-point tensors a cache holds (``tensors_of``), e.g.
    ``"layers[1].keys[batch 0, head 1, position 5]"`` for a ``[B, H, T, D]`` key/value tensor (else the index), or None
    when all are finite. Measured in the cache itself, whatever the attention kernel later makes of it (some fused CPU
    attention kernels turn NaN keys into zeros, so the logits alone can look finite)."""
    for name, t in tensors_of(cache).items():
        try:
            if not t.is_floating_point() or t.numel() == 0 or t.device.type == "meta":
                continue
            if all_finite(t):
                continue
            return _describe_index(name, t, nonfinite_mask(t))
        except Exception:  # noqa: BLE001 - a tensor subclass that cannot be read element-wise: not measured
            continue
    return None


def nonfinite_mask(t):
    """``[*t.shape]`` bool, True where ``t`` is NaN or ±inf; read in float64 (exact for every floating dtype; torch has
    no element-wise ``isfinite`` for float8_e4m3fn on CPU)."""
    import torch

    return ~torch.isfinite(t.detach().double())


def all_finite(t) -> bool:
    """Whether every element of floating-point tensor ``t`` is finite, in one reduction: its sum accumulated in float64
    is finite exactly when no element is NaN or ±inf (NaN propagates, inf + -inf is NaN, and finite float32, float16,
    bfloat16 or float8 values cannot overflow float64 in any tensor that fits in memory). A float64 tensor whose sum
    overflows, or a dtype the sum does not take, gets the element-wise test. This runs after every forward of every
    item (the cache's tensors, each ``update()``'s answer): the element-wise ``isfinite(t).all()`` cost ~6 µs per
    tensor against ~1.5 µs for the sum, a tenth of a tiny model's decode step. Raises what torch raises for a
    tensor it can neither sum nor read element-wise."""
    import math

    import torch

    t = t.detach()
    try:
        if math.isfinite(t.sum(dtype=torch.float64).item()):
            return True
    except Exception:  # noqa: BLE001 - a dtype or tensor subclass the sum does not take: the element-wise test
        pass
    return not bool(nonfinite_mask(t).any())


def _describe_index(name: str, t, bad) -> str:
    index = [int(i) for i in bad.nonzero()[0].tolist()]
    if t.dim() == 4:
        return f"{name}[batch {index[0]}, head {index[1]}, position {index[2]}]"
    return f"{name}{index}"


class UpdateWatch:
    """Watches every ``update()`` call of a cache during one forward, from outside: the runner puts a wrapper on the
    cache *instance* (and on both halves of an ``EncoderDecoderCache``) for the duration of the forward and removes it
    after; the class and the tensors are untouched.

    Records in ``fault`` the first of:

    * ``update(layer_idx=i)`` returned NaN/inf keys or values (where: batch, head, position) — measured on what the
      cache hands to attention, whatever the attention kernel then makes of it;
    * ``update()`` wrote into the ``key_states`` / ``value_states`` it was given (the caller's tensors, which the
      model may still use: e.g. for the next layer's input or a draft model in speculative decoding).
    """

    def __init__(self, cache):
        self.fault: str | None = None
        self.dtype_fault: str | None = None
        """An ``update()`` that returned keys/values of another dtype than the states it was given: the likely cause
        when the forward then raises (``raise_facts``); not a fault of a forward that went through."""
        self.calls: list[list] = []
        """``[layer_idx, new tokens, returned key length or None]`` per ``update()`` of the (self-attention) cache,
        in call order; None: the call raised (or returned no tensor)."""
        self.mask_sizes: dict = {}
        """``{layer_idx: (kv_length, kv_offset)}`` the (self-attention) cache's ``get_mask_sizes`` returned during
        the forward (the attention mask is built from them)."""
        self._targets = [c for c in (getattr(cache, "self_attention_cache", None),
                                     getattr(cache, "cross_attention_cache", None)) if c is not None] or [cache]

    def _wrap_mask_sizes(self, target):
        original = target.get_mask_sizes

        def get_mask_sizes(*args, **kwargs):
            out = original(*args, **kwargs)
            layer_idx = kwargs.get("layer_idx", args[1] if len(args) > 1 else 0)
            try:
                self.mask_sizes[int(layer_idx)] = (int(out[0]), int(out[1]))
            except Exception:  # noqa: BLE001 - a malformed answer is the contract family's finding
                pass
            return out

        return get_mask_sizes

    def _wrap(self, target, record=False):
        import torch

        original = target.update

        def update(key_states, value_states, layer_idx, *args, **kwargs):
            before = (key_states.detach().clone(), value_states.detach().clone()) \
                if self.fault is None and isinstance(key_states, torch.Tensor) else None
            call = [layer_idx, int(key_states.shape[-2]) if isinstance(key_states, torch.Tensor) else None, None]
            if record:
                self.calls.append(call)
            out = original(key_states, value_states, layer_idx, *args, **kwargs)
            try:
                self._inspect(out, call, layer_idx, key_states, value_states, before)
            except Exception:  # noqa: BLE001 - an answer kvconform cannot inspect: the forward judges it
                pass
            return out

        return update

    def _inspect(self, out, call, layer_idx, key_states, value_states, before) -> None:
        """What one ``update()`` returned: the key length into ``call``, the faults into ``fault`` /
        ``dtype_fault``."""
        import torch

        if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor) and out[0].dim() >= 2:
            call[2] = int(out[0].shape[-2])
        if self.fault is None and before is not None:
            for what, given, kept in (("key_states", key_states, before[0]),
                                      ("value_states", value_states, before[1])):
                if given.shape == kept.shape and not torch.equal(given.detach(), kept):
                    self.fault = (f"update(layer_idx={layer_idx}) wrote into the {what} it was given (the "
                                  f"caller's tensor changed during the call)")
                    break
        if self.dtype_fault is None and isinstance(out, (tuple, list)) and isinstance(key_states, torch.Tensor):
            for what, t in zip(("keys", "values"), out):
                if isinstance(t, torch.Tensor) and t.dtype != key_states.dtype:
                    self.dtype_fault = (f"update(layer_idx={layer_idx}) returned {what} of dtype "
                                  f"{str(t.dtype).removeprefix('torch.')} for key/value states of dtype "
                                  f"{str(key_states.dtype).removeprefix('torch.')}: the attention then runs in "
                                  f"another dtype or raises; return the states' dtype (cast back after "
                                  f"dequantizing)")
                    break
        if self.fault is None and isinstance(out, (tuple, list)):
            for what, t in zip(("keys", "values"), out):
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type != "meta" \
                        and not all_finite(t):
                    self.fault = (f"update(layer_idx={layer_idx}) returned NaN/inf "
                                  f"{_describe_index(what, t, nonfinite_mask(t))}")
                    break

    def __enter__(self):
        self._saved = []
        for k, target in enumerate(self._targets):
            own = getattr(target, "__dict__", None)
            if not isinstance(own, dict) or not callable(read_attr(target, "update")):
                continue  # a cache without an instance __dict__ (slots) or update(): watched no further
            try:
                self._saved.append((target, "update", own.get("update")))
                target.update = self._wrap(target, record=k == 0)
                if k == 0 and callable(read_attr(target, "get_mask_sizes")):
                    self._saved.append((target, "get_mask_sizes", own.get("get_mask_sizes")))
                    target.get_mask_sizes = self._wrap_mask_sizes(target)
            except Exception:  # noqa: BLE001 - a cache whose attributes cannot be set (a __setattr__ of its own)
                continue
        return self

    def __exit__(self, *exc):
        for target, name, previous in self._saved:
            try:
                if previous is None:
                    target.__dict__.pop(name, None)
                else:
                    setattr(target, name, previous)
            except Exception:  # noqa: BLE001 - see __enter__
                continue
        return False


def raise_facts(cache, model, watch: UpdateWatch | None, held: int, batch: int, trail) -> dict:
    """What can be measured on ``cache`` right after a forward raised, for ``_diagnosis.measured_cause``.

    Args:
        cache: the subject's cache (an ``EncoderDecoderCache``'s self-attention half is measured).
        model: the ``ZooModel`` (its ``decoder_depth``).
        watch: the forward's ``UpdateWatch`` (``update()`` calls, ``get_mask_sizes`` answers), or None.
        held: tokens the cache should hold after the forward (pads included).
        batch: rows of the batch fed.
        trail: labels of the ops before this forward.

    Returns a dict: ``held``, ``batch``, ``trail``, ``update_calls`` / ``mask_sizes`` (from ``watch``),
    ``cache_layers`` (len of ``layers``, or None), ``grows_layers`` (layers appended on demand),
    ``decoder_depth``, ``layer_max`` (each layer's ``get_max_length()``, -1 unbounded, None unknown),
    ``kv_mismatch`` (``kv_length_mismatch``: an ``update()`` that returned a wrong number of keys, or None) and
    ``batch_sizes`` (``{tensor name: dim 0}`` of every ≥3-dim tensor the cache holds), ``shared_layers``
    (``shared_layers``: one layer object listed for several layers, or None), ``update_fault`` (what the
    watch saw an ``update()`` do wrong: another dtype returned, NaN returned, its inputs written; or None).
    """
    target = self_half(cache)
    layers = read_attr(target, "layers")
    facts: dict[str, Any] = {"held": int(held), "batch": int(batch), "trail": list(trail),
             "update_calls": [tuple(c) for c in (watch.calls if watch else ())],
             "mask_sizes": dict(watch.mask_sizes if watch else {}),
             "cache_layers": len(layers) if isinstance(layers, (list, tuple)) else None,
             "grows_layers": read_attr(target, "layer_class_to_replicate") is not None,
             "decoder_depth": getattr(model, "decoder_depth", None),
             "encoder_decoder": bool(getattr(model, "is_encoder_decoder", False)),
             # transformers' own Cache.update reads self.layers; a cache's own update() may keep its storage elsewhere
             "layers_updated": getattr(getattr(type(target), "update", None), "__module__", "")
             == "transformers.cache_utils"}
    facts["shared_layers"] = shared_layers(cache)
    facts["update_fault"] = (watch.fault or watch.dtype_fault) if watch else None
    facts["layer_max"] = layer_max_lengths(cache)
    facts["kv_mismatch"] = kv_length_mismatch(facts["update_calls"], facts["mask_sizes"], facts["layer_max"], held)
    try:
        facts["batch_sizes"] = {name: int(t.shape[0]) for name, t in tensors_of(cache).items() if t.dim() >= 3}
    except Exception:  # noqa: BLE001 - a cache too broken to walk: no batch measurement
        facts["batch_sizes"] = {}
    if not facts["batch_sizes"] and not layers:  # no layers: the cache keeps its storage in attributes of its own
        try:
            facts["batch_sizes"] = {path: int(t.shape[0]) for path, t in held_tensor_items(cache) if t.dim() >= 3}
        except Exception:  # noqa: BLE001 - a cache too broken to walk: no batch measurement
            pass
    facts["public_batch"], facts["keys_missing"] = public_kv_facts(cache)
    return facts


def public_kv_facts(cache) -> tuple[dict, list]:
    """What the layers answer as ``layer.keys`` / ``layer.values``, the tensors transformers itself reads (as
    attributes or properties): ``({"layer 0.keys": dim 0, ...}, [labels of layers that hold tokens, by
    get_seq_length(), but answer None or no tensor for keys])``. The first dimension of these is the batch by the
    Cache contract; a layer's other tensors may be laid out otherwise (a paged pool's first dimension counts pages)."""
    import torch
    from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin

    def answer(layer, attr):
        try:
            t = getattr(layer, attr, None)
        except Exception:  # noqa: BLE001 - a property that raises answers nothing
            return None
        return t if isinstance(t, torch.Tensor) and t.dim() >= 3 else None

    def holds_tokens(layer) -> bool:
        if isinstance(layer, LinearAttentionCacheLayerMixin) and not isinstance(layer, CacheLayerMixin):
            return False  # a linear-attention layer holds states, not keys (5.25 gives it a token count)
        try:
            return int(layer.get_seq_length()) > 0
        except Exception:  # noqa: BLE001 - no length to read: no claim
            return False

    sizes, missing = {}, []
    for label, layer in cache_layers(cache):
        keys, values = answer(layer, "keys"), answer(layer, "values")
        sizes.update({f"{label}.{attr}": int(t.shape[0]) for attr, t in (("keys", keys), ("values", values))
                      if t is not None})
        # a linear-attention layer holds states, not keys (no `keys` attribute at all): nothing is missing there
        if keys is None and _has_keys_attribute(layer) and holds_tokens(layer):
            missing.append(label)
    return sizes, missing



def _has_keys_attribute(layer) -> bool:
    """Whether ``layer`` has a ``keys`` attribute or property at all (an attention layer's; a linear-attention
    layer of transformers holds conv/recurrent states and has none)."""
    return "keys" in getattr(layer, "__dict__", {}) or any("keys" in vars(k) for k in type(layer).__mro__)


def unmasked_slots(cache, held: int, new_tokens: int, mask=None) -> str | None:
    """Evidence that a fixed-size cache is attended without its attention mask at a forward of ``new_tokens`` that
    left ``held`` tokens in it, or None: the cache reports a capacity larger than ``held`` while saying
    ``is_compileable = False`` — then the model's SDPA path drops the mask of unpadded single-token steps (it keeps
    it only for compileable caches) and attends the empty slots. ``mask``: the 2D attention mask passed (``[B, T]``,
    None: none); a padded one is kept by the model, so there is no evidence then."""
    if new_tokens != 1 or getattr(cache, "is_compileable", False):
        return None
    if mask is not None and not bool(mask.all()):
        return None
    # fixed-size storage: the layers' max_cache_len (a dynamic sliding layer reports its window as its maximum
    # length, but holds no empty slots); hybrid layers (a linear-attention state next to a fixed-size attention
    # part) report no capacity as a whole, their layers do
    layers = layer_list(self_half(cache))
    capacity = -1
    if layers:
        for layer in layers:
            try:
                capacity = max(capacity, int(read_attr(layer, "max_cache_len", -1) or -1))
            except Exception:  # noqa: BLE001
                continue
    else:
        try:
            capacity = int(compat.max_length(cache))
        except Exception:  # noqa: BLE001 - no capacity: an unbounded cache
            capacity = -1
    if capacity > held:
        return (f"the cache has {capacity} slots for {held} tokens but says is_compileable = False, so the model "
                f"drops the attention mask of single-token steps and the {capacity - held} empty slots are "
                f"attended (a fixed-size cache must stay compileable, or keep the mask)")
    return None


def layer_max_lengths(cache) -> list:
    """``get_max_length()`` of each layer of ``cache`` (its self-attention half): -1 unbounded, None unknown."""
    out: list[int | None] = []
    for layer in layer_list(self_half(cache)):
        try:
            out.append(compat.max_length(layer))
        except Exception:  # noqa: BLE001
            out.append(None)
    return out


def shared_layers(cache) -> str | None:
    """Why ``cache.layers`` (an encoder-decoder cache: its self-attention half) is wrong when it lists one layer
    object for several decoder layers (``[Layer()] * n``: every decoder layer writes into the same keys and
    values), else None."""
    layers = read_attr(self_half(cache), "layers")
    if not isinstance(layers, (list, tuple)):
        return None
    distinct = len({id(x) for x in layers})
    if distinct == len(layers):
        return None
    return (f"the cache's {len(layers)} layers are fewer distinct objects ({distinct}): one layer object is listed "
            f"for several decoder layers (e.g. layers = [Layer()] * n), so they all write into the same keys and "
            f"values — build one layer object per decoder layer")


def kv_length_mismatch(calls, mask_sizes: dict, layer_max: list, held: int) -> Cause | None:
    """The first ``update()`` of a forward that returned another number of keys than attention needs, as a
    ``Cause`` of id ``"kv_length"`` with facts ``{"layer_idx", "returned", "held", "mask"}`` (``mask``: the
    ``kv_length`` ``get_mask_sizes`` gave a bounded layer's mask, None for an unbounded layer), or None.

    Args:
        calls: ``UpdateWatch.calls`` (``[layer_idx, new tokens, returned length or None]``).
        mask_sizes: ``UpdateWatch.mask_sizes`` (``{layer_idx: (kv_length, kv_offset)}``).
        layer_max: ``layer_max_lengths`` of the cache.
        held: tokens the cache should hold after the forward (pads included).

    An unbounded layer (``get_max_length() == -1``) must return every token held; a bounded one (static, sliding)
    the ``kv_length`` its ``get_mask_sizes`` gave the mask, where it was asked.
    """
    for layer_idx, _new, returned in calls:
        if returned is None or not isinstance(layer_idx, int) or layer_idx >= len(layer_max):
            continue
        if layer_max[layer_idx] == -1 and returned != held:
            return Cause(f"update(layer_idx={layer_idx}) returned keys of length {returned} for a cache that should "
                         f"hold {held} tokens", "kv_length",
                         {"layer_idx": layer_idx, "returned": returned, "held": held, "mask": None})
        if layer_max[layer_idx] not in (-1, None) and layer_idx in mask_sizes \
                and returned != mask_sizes[layer_idx][0]:
            return Cause(f"update(layer_idx={layer_idx}) returned keys of length {returned}, but get_mask_sizes() "
                         f"sized the attention mask for {mask_sizes[layer_idx][0]} (the cache should hold {held} "
                         f"tokens)", "kv_length",
                         {"layer_idx": layer_idx, "returned": returned, "held": held, "mask": mask_sizes[layer_idx][0]})
    return None
