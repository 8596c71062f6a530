"""Models written from scratch (no transformers), with their own KV cache: the model adapter behind
``--kvconform-model MODULE:ATTR`` (or ``FILE.py:ATTR``).

An **adapter** is a class (instantiated with no arguments) or an object its author writes in 20–40 lines; it is the
model and its subjects at once. Required (``REQUIRED``):

* ``build(dtype, device)`` → the model, an ``nn.Module`` with seeded weights (float64 must work: the oracle is
  this model's own uncached forward in float64).
* ``new_cache(model, batch_size, max_len, **options)`` → an empty cache (any object: a list of dicts, a class
  of the author's...). ``max_len`` is the most tokens a row holds in the item.
* ``forward(model, ids, cache, start, mask=None)`` → ``(logits, cache)``: the cached forward of the new token ids
  ``ids`` ``[B, T]`` (int64) at sequence offsets ``start .. start+T-1`` (``start``: the tokens the cache holds,
  pads included); ``mask`` ``[B, start+T]`` (1 real token, 0 left pad) or None; logits ``[B, T, V]`` float in the
  model's dtype.
* ``forward_uncached(model, ids, mask=None)`` → logits ``[B, T, V]`` of the whole sequence without a cache.

Optional, each a capability (a check needing one the adapter lacks skips, saying which method would enable it):

* ``crop(cache, n)`` → cache: forget the last ``n`` tokens (rollback, speculative decoding) — capability ``crop``.
* ``select(cache, rows)`` → cache: keep the batch rows ``rows`` (int64 ``[B']``) in that order — one method gives
  beam reorder, select and repeat (``reorder``, ``batch_select``, ``batch_repeat``).
* ``fork(cache)`` → an independent copy (default ``copy.deepcopy``) — prefix forks.
* ``seq_length(cache)`` → the tokens it says it holds (default: kvconform's own count).
* ``reset(cache)`` → the cache emptied for a new sequence, its batch size free (default: ``new_cache`` again).
* ``takes_mask = False``: its forward takes no padding mask: the left-padded cases skip, and their unpadded twins
  (the batch ops and the bfloat16 / float16 cases on distinct rows of equal length; case feature
  ``no_padding_mask``) run instead; the float64 pre-check (``float64_problem``) passes it no mask.
* ``capacity(cache)`` → the most tokens per row it keeps (a ring buffer of its window), or -1 / None: unbounded
  (default).
* ``kv_layout``: ``{"layers", "kv_heads", "head_dim"}`` — the keys and values it must hold per token, for the
  memory family's byte formula (without it the memory items skip, saying so).
* ``caches``: ``{subject name: new_cache keyword arguments}`` — several caches of one model (default one, named
  after the adapter's class with ``Cache`` appended); ``name``: the model's name in ids (default the class name);
  ``vocab_size`` (default 128): tokens are drawn below it; ``window``: a sliding window in tokens, or None;
  ``max_positions``: the most tokens its model takes in one sequence (a learned position table), or None: items
  that would make it see more are skipped with that reason (``plan.position_limit``), never run into its limit.

* ``compiled_decode = {"fullgraph", "step", "caches"}`` and ``decode_step(model, ids, cache, pos)`` (``pos`` a 0-dim
  int64 tensor): a decode step compiled with ``torch.compile`` for those caches — capability ``compile``
  (``compiled_decode``; ``ScratchModule.compiled_forward`` compiles that step only; full tier, ``FULL_TIER``).

The oracle's model is ``build(float64, "cpu")`` (``oracle_module``), refused before any item runs where its forward
computes in a narrower dtype inside (``narrow_computation``, in ``float64_problem``).

kvconform wraps the adapter's model in ``ScratchModule`` (an ``nn.Module`` whose forward takes the keyword
arguments kvconform's drivers pass a transformers model) and each cache in ``ScratchCache`` (a
``transformers.Cache`` whose ``crop`` / ``reorder_cache`` / ``batch_select_indices`` / ``batch_repeat_interleave`` /
``reset`` / ``deepcopy`` call the adapter), so the op interpreter (``checks/_interpreter.py``) drives it like any
subject; ``ScratchModule.generate`` is kvconform's own greedy decoding loop over the cached forward. What cannot
apply to a model outside transformers is skipped with its reason (``not_applicable``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import re
import weakref
from typing import Any

from kvconform.failure import Cause, OpsTrail

REQUIRED = {
    "build": "build(self, dtype, device) -> nn.Module with seeded weights",
    "new_cache": "new_cache(self, model, batch_size, max_len) -> an empty cache",
    "forward": "forward(self, model, ids, cache, start, mask=None) -> (logits [B, T, V], cache)",
    "forward_uncached": "forward_uncached(self, model, ids, mask=None) -> logits [B, T, V]",
}
"""The methods every adapter defines, with the signature its usage error shows."""

EXAMPLES = ("kvconform.examples.tiny_decoder:TinyDecoder", "kvconform.examples.tiny_decoder:TinySlidingDecoder",
            "kvconform.examples.tiny_decoder:TinyDecoderTwoCaches",
            "kvconform.examples.tiny_decoder:TinyMasklessDecoder")
"""The worked examples: run when named with ``--kvconform-model``, and in the full tier (``--kvconform-full``)."""

_SPEC = re.compile(r"^(?:[A-Za-z_][\w]*(?:\.[A-Za-z_][\w]*)*|.+\.py):[A-Za-z_]\w*$")


def is_scratch_spec(spec) -> bool:
    """Whether a ``--kvconform-model`` value names a model adapter (``pkg.module:Attr`` or ``path/file.py:Attr``)
    rather than a zoo name, a checkpoint folder or ``transformers:PATTERN``."""
    return (isinstance(spec, str) and not spec.startswith("transformers:") and bool(_SPEC.match(spec))
            and not os.path.isdir(os.path.expanduser(spec)))


def spec_problem(spec: str) -> str | None:
    """What is wrong with an adapter spec, seen from the file system and the source alone (no import), or None."""
    from kvconform.subjects.resolve import spec_problem_before_import

    if spec in _ADAPTERS:  # registered from Python (register_adapter)
        return None
    problem = spec_problem_before_import(spec)
    return f"--kvconform-model {problem}" if problem else None


_ADAPTERS: dict = {}


def _usage_error_class():
    from kvconform.outcomes import UsageError

    class AdapterUsageError(UsageError, ValueError):
        """A model adapter that cannot be used (exit 4): ``str(err)`` names the spec, what is wrong and the fix."""

    return AdapterUsageError


AdapterUsageError = _usage_error_class()


def load_adapter(spec: str):
    """The adapter object a spec names (a class is instantiated with no arguments), imported once per process.

    Raises:
        AdapterUsageError: the module does not import, has no such attribute, or the adapter lacks a required method
            (``adapter_problem``): the message names the spec, the method and the fix.
    """
    if spec in _ADAPTERS:
        return _ADAPTERS[spec]
    import inspect
    import sys

    from kvconform.subjects.resolve import _import_file, _import_module

    target, attr = spec.rsplit(":", 1)
    try:
        module = _import_file(target) if target.endswith(".py") else _import_module(target)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's spec problem
        raise AdapterUsageError(f"--kvconform-model {spec!r}: importing {target!r} failed: {type(exc).__name__}: {exc}"
                         ) from None
    if not hasattr(module, attr):
        raise AdapterUsageError(f"--kvconform-model {spec!r}: module {target!r} has no attribute {attr!r}")
    obj = getattr(module, attr)
    if inspect.isclass(obj):
        try:
            obj = obj()
        except Exception as exc:  # noqa: BLE001
            raise AdapterUsageError(f"--kvconform-model {spec!r}: {attr}() raised {type(exc).__name__}: {exc} (an "
                             f"adapter class is instantiated with no arguments)") from None
    problem = adapter_problem(obj)
    if problem:
        raise AdapterUsageError(f"--kvconform-model {spec!r}: {problem}")
    sys.modules.setdefault(type(obj).__module__, module)
    _ADAPTERS[spec] = obj
    return obj


def is_adapter(obj) -> bool:
    """Whether a Python object (not a spec string) is a model adapter: it (or, for a class, its instances) has every
    ``REQUIRED`` method — what tells it from a cache class or factory in ``pytest_kvconform_caches``'s list."""
    return not isinstance(obj, str) and all(callable(getattr(obj, name, None)) for name in REQUIRED)


def register_adapter(obj) -> str:
    """The model spec of an adapter given as a Python object (``check_cache(models=[TinyDecoder()])``,
    ``parametrize_with_checks``): ``module:Class`` of its class, bound to this very object for the process (a class
    is instantiated with no arguments). A string is returned as it is.

    Raises:
        AdapterUsageError: the object is no model adapter (``adapter_problem``).
    """
    import inspect

    if isinstance(obj, str):
        return obj
    adapter = obj() if inspect.isclass(obj) else obj
    cls = type(adapter)
    spec = f"{cls.__module__}:{cls.__qualname__}"
    problem = adapter_problem(adapter) or (None if is_scratch_spec(spec) else f"{spec!r} is no module:attr name")
    if problem:
        raise AdapterUsageError(f"models: {cls.__name__}: {problem}")
    _ADAPTERS[spec] = adapter
    return spec


def adapter_problem(adapter) -> str | None:
    """Why ``adapter`` is not a model adapter (a required method missing or not callable; ``caches`` not a dict of
    dicts), naming the method and the fix, or None."""
    missing = [name for name in REQUIRED if not callable(getattr(adapter, name, None))]
    if missing:
        what = type(adapter).__name__
        return (f"{what} has no {', '.join(missing)} method{'s' if len(missing) > 1 else ''}; a model adapter "
                f"defines " + "; ".join(REQUIRED[m] for m in missing) + " (kvconform.scratch documents the protocol; "
                "kvconform.examples.tiny_decoder is a worked example)")
    if getattr(adapter, "is_encoder_decoder", False):
        return (f"{type(adapter).__name__} declares is_encoder_decoder, but the adapter protocol cannot express an "
                "encoder-decoder model: forward(model, ids, cache, start, mask) feeds decoder tokens only — it has no "
                "encoder input, no cross-attention half of the cache, and nothing that repeats or selects encoder "
                "states with the rows — so kvconform can neither build nor judge it; check its decoder alone (the "
                "encoder states fixed inside the model, is_encoder_decoder unset) or give it a transformers model "
                "class (an encoder-decoder there is judged through EncoderDecoderCache, your own subclass included)")
    caches = getattr(adapter, "caches", None)
    if caches is not None and (not isinstance(caches, dict) or not all(
            isinstance(k, str) and re.fullmatch(r"[A-Za-z0-9_.]+", k) and isinstance(v, dict)
            for k, v in caches.items())):
        return ("caches must be a dict {subject name ([A-Za-z0-9_.]+): new_cache keyword arguments (a dict)}, got "
                f"{caches!r}")
    return None


def model_name(adapter) -> str:
    """The model's name in item ids: the adapter's ``name``, else its class name (``[A-Za-z0-9_.]`` kept)."""
    name = str(getattr(adapter, "name", None) or type(adapter).__name__)
    return "".join(c if c.isalnum() or c in "_." else "_" for c in name)


def layer_types(adapter) -> tuple:
    """The cache layer types of the adapter's model for the case scope: ``sliding_attention`` where it declares a
    ``window``, else ``full_attention`` (a from-scratch model's layers are not introspected)."""
    return ("sliding_attention",) if getattr(adapter, "window", None) else ("full_attention",)


def vocab_size(adapter) -> int:
    """The ids tokens are drawn below (the adapter's ``vocab_size``, default 128)."""
    return int(getattr(adapter, "vocab_size", 128))


def takes_mask(adapter) -> bool:
    """Whether the adapter's forward takes a padding mask: False only where it declares ``takes_mask = False``
    (its model then gets the unpadded twins of the left-padded cases: feature ``no_padding_mask``)."""
    return getattr(adapter, "takes_mask", True) is not False


def capabilities(adapter, cache_name: str | None = None) -> frozenset:
    """The capabilities the adapter's optional methods give (module docstring); ``compile`` for the cache
    ``cache_name`` where the adapter declares a compiled decode step for it (``compiled_decode``)."""
    caps = {"forward", "deepcopy", "reset", "generate"}
    if callable(getattr(adapter, "crop", None)):
        caps.add("crop")
    if callable(getattr(adapter, "select", None)):
        caps |= {"reorder", "batch_select", "batch_repeat"}
    if cache_name is not None and compiled_decode(adapter, cache_name) is not None:
        caps.add("compile")
    return frozenset(caps)


def compiled_decode(adapter, cache_name: str) -> dict | None:
    """The compiled decode step the adapter declares for its cache ``cache_name``, or None (it declares none).

    The declaration is the adapter attribute ``compiled_decode = {"fullgraph": bool, "step": "decode_step" |
    "forward", "caches": [names]}`` (every key optional: ``fullgraph`` True; ``step`` ``"decode_step"`` where the
    adapter defines it, else ``"forward"``; ``caches`` every cache). Returned with every key filled in.

    Raises:
        AdapterUsageError: a malformed declaration (not a dict, an unknown key, a step the adapter does not
            define, a cache name it does not list).
    """
    declared = getattr(adapter, "compiled_decode", None)
    if declared is None or declared is False:
        return None
    what = type(adapter).__name__
    if declared is True:
        declared = {}
    if not isinstance(declared, dict) or set(declared) - {"fullgraph", "step", "caches"}:
        raise AdapterUsageError(f"{what}.compiled_decode must be a dict with the keys fullgraph (bool), step "
                                f"('decode_step' or 'forward') and caches (subject names), any of them optional; "
                                f"got {declared!r}")
    step = declared.get("step") or ("decode_step" if callable(getattr(adapter, "decode_step", None)) else "forward")
    if step not in ("decode_step", "forward") or not callable(getattr(adapter, step, None)):
        raise AdapterUsageError(f"{what}.compiled_decode names step {step!r}, but the adapter defines no such "
                                f"method: decode_step(self, model, ids, cache, pos) -> (logits, cache), pos a 0-dim "
                                f"int64 tensor (the start offset), or 'forward'")
    names = list(getattr(adapter, "caches", None) or {f"{what}Cache": {}})
    caches = declared.get("caches")
    caches = list(names) if caches is None else [caches] if isinstance(caches, str) else list(caches)
    unknown = [c for c in caches if c not in names]
    if unknown:
        raise AdapterUsageError(f"{what}.compiled_decode names caches {unknown} that the adapter does not list "
                                f"(its caches: {names})")
    if cache_name not in caches:
        return None
    return {"fullgraph": bool(declared.get("fullgraph", True)), "step": step, "caches": caches}


_NOTES = {
    "crop": "the adapter defines no crop(cache, n) (rollback of the last n tokens)",
    "reorder": "the adapter defines no select(cache, rows) (batch rows kept, in order)",
    "batch_select": "the adapter defines no select(cache, rows) (batch rows kept, in order)",
    "batch_repeat": "the adapter defines no select(cache, rows) (batch rows kept, in order)",
    "compile": "the adapter declares no compiled decode step for this cache (compiled_decode = {'fullgraph': "
               "True, 'caches': [...]} and, for a static cache, a decode_step(model, ids, cache, pos) taking the "
               "start offset as a tensor, as gpt-fast's input_pos)",
}


# ----------------------------------------------------------------------------------------------- the wrapped model
def _torch():
    import torch

    return torch


class ScratchOutput:
    """What ``ScratchModule.forward`` returns: ``logits`` ``[B, T, V]`` and the cache (``past_key_values``)."""

    def __init__(self, logits, past_key_values=None):
        self.logits, self.past_key_values = logits, past_key_values


class ScratchConfig:
    """The little of a transformers config that kvconform's drivers read of a model adapter's model."""

    is_encoder_decoder = False

    def __init__(self, adapter):
        self.vocab_size = vocab_size(adapter)
        self.model_type = "scratch"
        self.sliding_window = getattr(adapter, "window", None)
        self.layer_types = list(layer_types(adapter))
        self.per_layer_config = [self for _ in self.layer_types]

    def get_text_config(self, decoder=True):
        """This config (a from-scratch model has one)."""
        return self


class AdapterError(Exception):
    """A model adapter broke its protocol in a forward (wrong logits shape or dtype, input ids changed in place,
    a cache not returned): raised inside the call on the subject, so it fails the item as the subject's fault."""


class ModelForwardError(AdapterError):
    """The adapter's uncached forward (``forward_uncached``: kvconform's oracle and noise floor) raised: the model's
    failure, judged as such (``model_at_fault``), never blamed on the cache."""

    model_at_fault = True


def _module_class():
    torch = _torch()

    class ScratchModule(torch.nn.Module):
        """A model adapter's model behind the forward keywords kvconform passes a transformers model:
        ``forward(input_ids, cache=None, use_cache=False, attention_mask=None, position_ids=None)`` →
        ``ScratchOutput``. ``position_ids`` are not passed on: the adapter's model takes its positions from
        ``start`` (and the mask). ``generate`` is kvconform's own greedy decoding over the cached forward."""

        def __init__(self, adapter, net):
            super().__init__()
            self.net = net
            self.__dict__["adapter"] = adapter
            self.config = ScratchConfig(adapter)

        def forward(self, input_ids, cache=None, use_cache=False, attention_mask=None, position_ids=None):
            adapter = self.adapter
            before = input_ids.clone()
            if cache is None or not use_cache:
                try:
                    logits = adapter.forward_uncached(self.net, input_ids, attention_mask)
                except Exception as exc:  # noqa: BLE001 - the model's failure, never the cache's (checks.escaped)
                    raise ModelForwardError(f"{type(adapter).__name__}.forward_uncached on ids of shape "
                                            f"{list(input_ids.shape)} ({next(self.net.parameters()).dtype}) raised "
                                            f"{type(exc).__name__}: {exc}") from exc
                where = "forward_uncached"
            else:
                if not isinstance(cache, ScratchCache):
                    raise AdapterError(f"a from-scratch model takes its own caches only, not {type(cache).__name__}")
                logits = cache.feed(self.net, input_ids, attention_mask)
                where = "forward"
            _check_logits(logits, input_ids, vocab_size(adapter), where, self.net)
            if not torch.equal(input_ids, before):
                raise AdapterError(f"{type(adapter).__name__}.{where} changed the input ids in place (they must be "
                                   f"read only: kvconform keeps them as the sequence the cache holds)")
            return ScratchOutput(logits, cache)

        def compiled_forward(self, compile_fn, cache_name: str | None = None):
            """The decode step the adapter declares compiled (``compiled_decode``), compiled with ``compile_fn``
            (``torch.compile`` with the check's options), behind this module's forward keywords: ``call(input_ids,
            cache, use_cache=True, attention_mask=None, position_ids=None)`` → ``ScratchOutput``. Only the adapter's
            step (``decode_step(net, ids, state, pos)``, ``pos`` a 0-dim int64 tensor holding the start offset, or
            ``forward(net, ids, state, start)``) is compiled; kvconform's bookkeeping (the tokens held, the logits'
            shape and dtype) runs eagerly around it, after the compiled call returned (so a call that raises, e.g.
            a recompile refused by ``fail_on_recompile``, leaves the cache as it was).

            Raises:
                AdapterError: the step returned no ``(logits, cache)`` pair or wrong logits; the cache is no
                    ``ScratchCache``.
            """
            adapter = self.adapter
            names = list(getattr(adapter, "caches", None) or {f"{type(adapter).__name__}Cache": {}})
            declared = compiled_decode(adapter, cache_name or names[0]) or {"step": "forward"}
            step = getattr(adapter, declared["step"])
            compiled = compile_fn(step)
            tensor_pos = declared["step"] == "decode_step"
            what = f"{type(adapter).__name__}.{declared['step']}"

            def call(input_ids, cache: Any = None, use_cache=True, attention_mask=None, position_ids=None):
                if not isinstance(cache, scratch_cache_class()):
                    raise AdapterError(f"a from-scratch model takes its own caches only, not {type(cache).__name__}")
                if tensor_pos:
                    pos = torch.tensor(cache.held, dtype=torch.long, device=input_ids.device)
                    out = compiled(self.net, input_ids, cache.state, pos)
                else:
                    out = compiled(self.net, input_ids, cache.state, cache.held, attention_mask)
                if not isinstance(out, (tuple, list)) or len(out) != 2 or out[1] is None:
                    raise AdapterError(f"{what} returned {type(out).__name__}, but should return (logits [B, T, V], "
                                       f"cache)")
                logits, cache.state = out
                cache.renewed = False
                cache.held += int(input_ids.shape[1])
                cache.batch = int(input_ids.shape[0])
                _check_logits(logits, input_ids, vocab_size(adapter), declared["step"], self.net)
                return ScratchOutput(logits, cache)

            return call

        def kv_token_dims(self):
            """``(layers × kv_heads, head_dim)`` of the K/V the cache must hold per token and row, from the adapter's
            ``kv_layout`` (``{"layers", "kv_heads", "head_dim"}``), or None where it declares none: the memory
            family's byte formula (keys and values, in the model's dtype)."""
            layout = getattr(self.adapter, "kv_layout", None)
            if not isinstance(layout, dict):
                return None
            return int(layout["layers"]) * int(layout["kv_heads"]), int(layout["head_dim"])

        def generate(self, input_ids, attention_mask=None, max_new_tokens=1, num_beams=1, cache=None,
                     past_key_values=None, use_cache=True, **ignored):
            """Greedy decoding of ``max_new_tokens`` tokens: one forward of the tokens the cache does not hold yet
            (all of them without a cache), then one per new token. Returns ``.sequences`` ``[B, S + N]`` and
            ``.logits`` (one ``[B, V]`` per step), as transformers' ``generate(return_dict_in_generate=True,
            output_logits=True)``."""
            if num_beams != 1:
                raise NotImplementedError("kvconform drives greedy decoding of a from-scratch model only")
            cache = cache if cache is not None else past_key_values
            cache = cache if use_cache else None
            seq, mask, steps = input_ids, attention_mask, []
            # a warm cache: the prompt's tokens it does not hold yet (the whole prompt when it is only the suffix)
            new = None if cache is None else seq[:, cache.held:] if seq.shape[1] > cache.held else seq
            for _ in range(int(max_new_tokens)):
                if cache is None:
                    logits = self(seq, attention_mask=mask).logits
                else:
                    logits = self(new, cache=cache, use_cache=True, attention_mask=mask).logits
                nxt = logits[:, -1].argmax(-1, keepdim=True)
                steps.append(logits[:, -1])
                seq, new = torch.cat([seq, nxt], dim=1), nxt
                if mask is not None:
                    mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            out = ScratchOutput(None, cache)
            out.sequences, out.logits = seq, tuple(steps)
            return out

    return ScratchModule


def _check_logits(logits, ids, vocab: int, where: str, net) -> None:
    torch = _torch()
    expected = (ids.shape[0], ids.shape[1], vocab)
    if not isinstance(logits, torch.Tensor):
        raise AdapterError(f"forward returned {type(logits).__name__} as its logits, but should return a tensor "
                           f"of shape {list(expected)}")
    if tuple(logits.shape) != expected:
        raise AdapterError(f"{where} returned logits of shape {list(logits.shape)}, but should return "
                           f"{list(expected)} ([batch, new tokens, vocab_size] for ids of shape {list(ids.shape)})")
    want = next(net.parameters()).dtype if any(True for _ in net.parameters()) else logits.dtype
    if logits.dtype != want:
        raise AdapterError(f"{where} returned {logits.dtype} logits of shape {list(logits.shape)} from a "
                           f"{want} model, but should return {want} logits of shape {list(expected)}")


_MODULE_CLASS = None


def scratch_module(adapter, net):
    """``ScratchModule(adapter, net)`` (the class is built on first use, so that importing this module does not
    import torch)."""
    global _MODULE_CLASS
    if _MODULE_CLASS is None:
        _MODULE_CLASS = _module_class()
    return _MODULE_CLASS(adapter, net)


# ----------------------------------------------------------------------------------------------- the wrapped cache
def _cache_base():
    from transformers import Cache

    return Cache


class _LazyCache:
    """Placeholder replaced by the real ``ScratchCache`` class on first use (see ``scratch_cache_class``)."""


ScratchCache = _LazyCache  # the isinstance target above; rebound by scratch_cache_class()


def scratch_cache_class():
    """The ``ScratchCache`` class: a ``transformers.Cache`` holding one adapter cache (``state``) and
    kvconform's own count of the tokens fed (``held``); every cache method calls the adapter."""
    global ScratchCache
    if ScratchCache is not _LazyCache:
        return ScratchCache
    Cache = _cache_base()

    class _ScratchCache(Cache):
        """One cache of a model adapter as a subject (see the module docstring). ``state`` is what the adapter's
        ``new_cache`` returned; ``held`` the tokens per row fed and not cropped (pads included); ``batch`` the
        rows."""

        is_compileable = False

        def __init__(self, adapter, net, batch_size: int, max_len: int, options=None):
            super().__init__(layers=[])
            self.adapter, self.options = adapter, dict(options or {})
            self._net = weakref.ref(net)
            self.batch, self.max_len, self.held = int(batch_size), int(max_len), 0
            self.renewed = False  # emptied by the default reset (new_cache) and not fed since
            self.state = adapter.new_cache(net, batch_size=self.batch, max_len=self.max_len, **self.options)

        def feed(self, net, ids, mask):
            if self.renewed and int(ids.shape[0]) != self.batch:
                # the default reset built the empty cache for the old batch; the next forward brings another: the
                # cache is built for the batch it is fed (docs/from-scratch.md: reset, any batch size)
                self.batch = int(ids.shape[0])
                self.state = self.adapter.new_cache(net, batch_size=self.batch, max_len=self.max_len, **self.options)
            self.renewed = False
            out = self.adapter.forward(net, ids, self.state, self.held, mask)
            if not isinstance(out, (tuple, list)) or len(out) != 2:
                what = f"{len(out)} values" if isinstance(out, (tuple, list)) else type(out).__name__
                raise AdapterError(f"{type(self.adapter).__name__}.forward returned {what}, but should return "
                                   f"(logits [B, T, V], cache)")
            logits, state = out
            if state is None:
                raise AdapterError(f"{type(self.adapter).__name__}.forward returned None as its cache; it returns "
                                   f"(logits, cache)")
            self.state = state
            self.held += int(ids.shape[1])
            self.batch = int(ids.shape[0])
            return logits

        def get_seq_length(self, layer_idx: int = 0) -> int:
            own = getattr(self.adapter, "seq_length", None)
            return int(own(self.state)) if callable(own) else self.held

        def get_max_length(self) -> int:
            own = getattr(self.adapter, "capacity", None)
            value = own(self.state) if callable(own) else None
            return -1 if value is None else int(value)  # None or -1: unbounded

        get_max_cache_shape = get_max_length

        @property
        def kvconform_poison(self):
            """The poisoned-capacity hook (``checks/poison.py``) when the adapter defines ``poison(cache, start,
            value) -> int`` (fill every slot the cache holds no token in, past the ``start`` tokens it holds, with
            ``value``; return how many token slots, rows × blocks, it filled), else None (no hook)."""
            own = getattr(self.adapter, "poison", None)
            if not callable(own):
                return None
            return lambda value: own(self.state, self.held, value)

        def crop(self, max_length: int):
            from kvconform.compat import crop_tokens_to_remove

            n = crop_tokens_to_remove(int(max_length), lambda: self.held)  # the installed release's contract
            fn = getattr(self.adapter, "crop", None)
            if not callable(fn):
                raise NotImplementedError(_NOTES["crop"])
            self.state = fn(self.state, n)
            self.held = max(self.held - n, 0)

        def _select(self, rows):
            fn = getattr(self.adapter, "select", None)
            if not callable(fn):
                raise NotImplementedError(_NOTES["batch_select"])
            torch = _torch()
            rows = torch.as_tensor(rows, dtype=torch.long)
            self.state = fn(self.state, rows)
            self.batch = int(rows.shape[0])

        def reorder_cache(self, beam_idx):
            self._select(beam_idx)

        def batch_select_indices(self, indices):
            self._select(indices)

        def batch_repeat_interleave(self, repeats: int):
            self._select(_torch().arange(self.batch).repeat_interleave(int(repeats)))

        def reset(self):
            own = getattr(self.adapter, "reset", None)
            if callable(own):
                self.state = own(self.state)
            else:  # new_cache for this batch now; the next forward rebuilds it if it brings another (feed)
                net = self._net()
                self.state = self.adapter.new_cache(net, batch_size=self.batch, max_len=self.max_len, **self.options)
                self.renewed = True
            self.held = 0

        def __deepcopy__(self, memo):
            new = object.__new__(type(self))
            for key, value in self.__dict__.items():
                if key == "state":
                    fork = getattr(self.adapter, "fork", None)
                    new.state = fork(value) if callable(fork) else copy.deepcopy(value, memo)
                elif key in ("adapter", "_net"):
                    new.__dict__[key] = value
                else:
                    new.__dict__[key] = copy.deepcopy(value, memo)
            return new

        def __repr__(self):
            return f"{type(self).__name__}({type(self.adapter).__name__}, held={self.held})"

    ScratchCache = _ScratchCache
    return ScratchCache


# ------------------------------------------------------------------------------------------- model and subjects
def build_model(spec: str, dtype=None, device: str = "cpu"):
    """The adapter's model as a ``zoo.ZooModel`` (its ``model`` a ``ScratchModule``; ``source`` the spec)."""
    torch = _torch()
    from kvconform.zoo import ZooModel

    adapter = load_adapter(spec)
    dtype = dtype or torch.float32
    net = adapter.build(dtype=dtype, device=device)
    module = scratch_module(adapter, net).eval()
    module.requires_grad_(False)
    window = getattr(adapter, "window", None)
    return ZooModel(name=model_name(adapter), model=module, config=module.config, dtype=dtype,
                    is_encoder_decoder=False, layer_types=layer_types(adapter), sliding_window=window, source=spec,
                    oracle_build=lambda: oracle_module(adapter))


def oracle_module(adapter):
    """The oracle's model: ``adapter.build(dtype=torch.float64, device="cpu")`` (never a cast copy of the case
    dtype's model: a model that needs its own tables or patched modules in float64 builds them), wrapped in
    ``ScratchModule``, in eval mode without gradients."""
    torch = _torch()
    module = scratch_module(adapter, adapter.build(dtype=torch.float64, device="cpu")).eval()
    module.requires_grad_(False)
    return module


def float64_problem(spec: str) -> str | None:
    """Why the adapter's model cannot be the float64 oracle, or None: ``build(float64)`` or its uncached forward
    of 2 rows × 6 tokens raises, returns logits of another shape or dtype, or NaN/inf — without a mask and, unless
    the adapter declares ``takes_mask = False`` (no item then passes it one), with a left-padding mask. Checked once
    when the session is built (the oracle of every item is this forward)."""
    torch = _torch()
    adapter = load_adapter(spec)
    what = type(adapter).__name__
    try:
        net = adapter.build(dtype=torch.float64, device="cpu")
    except Exception as exc:  # noqa: BLE001
        return f"{what}.build(dtype=torch.float64) raised {type(exc).__name__}: {exc}"
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in net.parameters() if p.is_floating_point()})
    if dtypes and dtypes != ["float64"]:
        return (f"{what}.build(dtype=torch.float64) returned a model whose weights are {'/'.join(dtypes)}: build must "
                f"put the model in the dtype it is given (kvconform's oracle is its uncached forward in float64, and "
                f"the bfloat16 / float16 cases build it in those)")
    module = scratch_module(adapter, net)
    ids = (torch.arange(12).view(2, 6) * 7 + 3) % vocab_size(adapter)
    try:
        narrow = narrow_computation(net, lambda: module(ids, attention_mask=None))
    except Exception:  # noqa: BLE001 - the forward's own failure is reported below, naming it
        narrow = None
    if narrow:
        return (f"its uncached forward at float64 computes in a narrower dtype inside: {narrow} (kvconform's oracle "
                f"is this forward in float64: a module that casts to float32 — x.float() in a norm, a rotary table "
                f"built or kept in float32 — caps the oracle at float32's precision; compute in the input's dtype, "
                f"e.g. x.to(torch.promote_types(x.dtype, torch.float32)))")
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    masks = (("", None), (" with an attention mask (a left-padded row)", mask))
    for label, m in masks if takes_mask(adapter) else masks[:1]:
        try:
            with torch.no_grad():
                logits = module(ids, attention_mask=m).logits
        except Exception as exc:  # noqa: BLE001
            shown = exc.__cause__ if isinstance(exc, ModelForwardError) and exc.__cause__ is not None else exc
            return (f"its uncached forward fails at float64{label}: {what}.forward_uncached raised "
                    f"{type(shown).__name__}: {shown} (kvconform's oracle is this forward in float64: every dtype the "
                    f"model computes in must follow the weights')")
        if not torch.isfinite(logits[m.bool()] if m is not None else logits).all():
            return (f"its uncached forward at float64{label} returns NaN/inf logits: a mask or constant built in "
                    f"another dtype than the scores (e.g. a float32 mask multiplied by torch.finfo(float64).min, "
                    f"which overflows to -inf, and 0 × -inf = NaN) — build the mask in the scores' dtype")
    return None


def narrow_computation(net, run) -> str | None:
    """Where ``run()`` (a forward of the float64 model ``net``) computes in a narrower floating dtype: the first op
    inside one of ``net``'s modules that returns a float32 / float16 / bfloat16 tensor, as ``"module 'blocks.0.norm'
    (RMSNorm): Tensor.float returned float32"``, or None. Seen with a ``TorchFunctionMode`` (every torch function
    and tensor method) and forward hooks naming the innermost module running.

    Raises:
        Exception: whatever ``run`` raises.
    """
    torch = _torch()
    from torch.overrides import TorchFunctionMode

    narrow = (torch.float32, torch.float16, torch.bfloat16)
    names = {id(m): name or "(the model)" for name, m in net.named_modules()}
    stack: list = []
    found: list = []

    def tensors(out):
        if isinstance(out, torch.Tensor):
            yield out
        elif isinstance(out, (tuple, list)):
            for item in out:
                yield from tensors(item)

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not found and stack:
                bad = next((t for t in tensors(out) if t.dtype in narrow), None)
                if bad is not None:
                    mod = stack[-1]
                    what = getattr(func, "__qualname__", None) or getattr(func, "__name__", str(func))
                    found.append(f"module {names[id(mod)]!r} ({type(mod).__name__}): {what} returned "
                                 f"{str(bad.dtype).removeprefix('torch.')}")
            return out

    def enter(mod, args):
        stack.append(mod)

    def leave(mod, args, out):
        if stack:
            stack.pop()

    handles = []
    for m in net.modules():
        handles += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave)]
    try:
        with torch.no_grad(), Watch():
            run()
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None


_SPEC_CLASS = None


def adapter_cache_spec_class():
    """``AdapterCacheSpec``: a ``CacheSpec`` that also names the adapter spec it belongs to (``adapter_spec``);
    the plan pairs it with that model only (``plan.in_scope``)."""
    global _SPEC_CLASS
    if _SPEC_CLASS is None:
        from dataclasses import dataclass

        from kvconform.subjects import CacheSpec

        @dataclass(frozen=True)
        class AdapterCacheSpec(CacheSpec):
            adapter_spec: str = ""
            compileable: bool | None = None  # the compiled decode step it declares: fullgraph, or None (none)

        _SPEC_CLASS = AdapterCacheSpec
    return _SPEC_CLASS


def allocation_of(adapter) -> dict:
    """The ``CacheSpec`` allocation fields an adapter declares: ``grows_by`` (its buffers grow in steps of that many
    tokens: the memory family allows one step of slack per row, ``page_size``) and ``allocation``
    (``"preallocated"``: a bounded cache holds its whole ``capacity`` from the first token; ``"doubling"``). Each
    judged against what the cache then holds.

    Raises:
        AdapterUsageError: ``grows_by`` not a positive int, or ``allocation`` not one of those names.
    """
    from kvconform.subjects.spec import ALLOCATIONS

    out: dict = {}
    grows_by = getattr(adapter, "grows_by", None)
    if grows_by is not None:
        if isinstance(grows_by, bool) or not isinstance(grows_by, int) or grows_by < 1:
            raise AdapterUsageError(f"{type(adapter).__name__}.grows_by must be a positive int (tokens per growth "
                                    f"step of its buffers), got {grows_by!r}")
        out["page_size"] = grows_by
    allocation = getattr(adapter, "allocation", None)
    if allocation is not None:
        if allocation not in ALLOCATIONS:
            raise AdapterUsageError(f"{type(adapter).__name__}.allocation must be one of {', '.join(ALLOCATIONS)}, "
                                    f"got {allocation!r}")
        out["allocation"] = allocation
    return out


def subjects(spec: str) -> list:
    """The adapter's caches as ``CacheSpec`` s (``caches``; default one named ``<Class>Cache``), each applying to
    this model only."""
    spec_class = adapter_cache_spec_class()
    adapter = load_adapter(spec)
    cls = scratch_cache_class()
    caches = getattr(adapter, "caches", None) or {f"{type(adapter).__name__}Cache": {}}
    name = model_name(adapter)
    out = []
    for subject, options in caches.items():
        caps = capabilities(adapter, subject)
        declared = compiled_decode(adapter, subject)
        compileable = None if declared is None else declared["fullgraph"]

        def factory(model, batch_size, max_cache_len, _options=dict(options), _compileable=compileable):
            cache = cls(model.adapter, model.net, batch_size, max_cache_len, _options)
            cache.is_compileable = bool(_compileable)
            return cache

        out.append(spec_class(subject, factory, capabilities=caps, source=f"model adapter {spec}",
                              adapter_spec=spec, compileable=compileable, **allocation_of(adapter),
                              applies_to=lambda info, _name=name: None if info.name == _name else "another model",
                              notes={k: v for k, v in _NOTES.items() if k not in caps}))
    return out


NOT_APPLICABLE = {
    "coverage": "the coverage family checks transformers' cache_implementation strings and layer table",
    "check_beam_search": "beam search is transformers' generate(num_beams > 1); kvconform decodes a from-scratch "
                         "model greedily",
    "check_beam_search_self_consistent": "beam search is transformers' generate(num_beams > 1)",
    "check_mamba_kernel_paths": "transformers' Mamba kernels",
    "check_encoder_decoder_subcaches": "transformers' EncoderDecoderCache",
    "check_offloaded_matches": "transformers' offloaded caches",
    "check_cache_implementation": "transformers' generate(cache_implementation=...)",
    "check_speed_compiled_static": "the compiled StaticCache is timed against transformers' DynamicCache eager on "
                                   "the same model, a cache a from-scratch model does not take",
    "speculative": "transformers' candidate generators (prompt lookup, a draft model) run inside transformers' "
                   "generate(); kvconform decodes a from-scratch model with its own greedy loop",
}
"""Checks (by name, or a whole family) that cannot apply to a model outside transformers, with the reason."""


FULL_TIER = ("check_speed_prefill", "check_speed_flat_decode", "check_compile_static_decode", "check_compile_claim")
"""Checks a from-scratch model gets only under ``--kvconform-full``: its default tier keeps to 15 s wall on 2 cores
(the speed two took 4.4 s each on the worked example, a compile item 7.8 CPU-s: inductor's compile);
``check_speed_vs_uncached``, the cached-vs-uncached claim, and ``check_static_addresses`` (no compile) stay."""


def not_applicable(check, case, spec: str | None = None) -> str | None:
    """Why ``check`` (a registered check) on ``case`` cannot apply to a from-scratch model (the adapter ``spec``
    names), or None."""
    reason = NOT_APPLICABLE.get(check.name) or NOT_APPLICABLE.get(check.family)
    if reason:
        return f"not for a model outside transformers: {reason}"
    if case.params.get("padding") and spec is not None and not takes_mask(load_adapter(spec)):
        twin = unpadded_twin(case.id)
        return ("the model adapter declares takes_mask = False: its forward takes no padding mask ("
                + (f"its unpadded twin {twin} runs instead" if twin else "this case checks left-padded rows "
                   "themselves and has no unpadded twin")
                + "; a forward taking mask [B, start + T], 1 real / 0 left pad, runs this one too)")
    if check.name == "check_length_bookkeeping" and spec is not None \
            and not callable(getattr(load_adapter(spec), "seq_length", None)):
        return ("the model adapter defines no seq_length(cache): kvconform would compare its own count of tokens "
                "fed with itself — define seq_length(cache) (the tokens your cache says it holds) to have it checked "
                "after every op, with capacity(cache) stable over the cache's life (transformers' get_mask_sizes / "
                "update() bookkeeping has no counterpart in an adapter)")
    if spec is not None and case.dtype in ("bfloat16", "float16") and (problem := dtype_problem(spec, case.dtype)):
        return problem
    if case.position_ids == "explicit":
        return ("not for a model outside transformers: its positions come from the start offset the adapter is "
                "given, not from position_ids (nothing for the adapter to add: the implicit-positions twin runs)")
    return None


@functools.lru_cache(maxsize=None)
def dtype_problem(spec: str, dtype: str) -> str | None:
    """Why the adapter's model cannot run at ``dtype`` (``"bfloat16"`` / ``"float16"``) whatever the cache, or None:
    ``build(dtype, "cpu")`` or its uncached forward of 2 rows × 6 tokens (no cache, no mask) raises or returns
    NaN/inf. Measured once per model and dtype when the plan is made; the items at that dtype skip with this reason,
    the model's, instead of failing on every cache."""
    torch = _torch()
    adapter = load_adapter(spec)
    what = type(adapter).__name__
    try:
        net = adapter.build(dtype=getattr(torch, dtype), device="cpu")
        ids = (torch.arange(12).view(2, 6) * 7 + 3) % vocab_size(adapter)
        with torch.no_grad():
            logits = adapter.forward_uncached(net, ids)
    except Exception as exc:  # noqa: BLE001 - the model's own failure: the reason
        return (f"the model fails at {dtype} whatever the cache: its uncached forward (forward_uncached, no cache) "
                f"at {dtype} raised {type(exc).__name__}: {str(exc)[:200]} — the model's fault, judged on no cache "
                f"(make every dtype inside {what}'s forward follow the weights', e.g. rotary tables cast to the "
                f"input's dtype)")
    if isinstance(logits, torch.Tensor) and logits.is_floating_point() and not bool(torch.isfinite(logits).all()):
        return (f"the model fails at {dtype} whatever the cache: its uncached forward (forward_uncached, no cache) "
                f"at {dtype} returns NaN/inf logits — the model's fault, judged on no cache")
    return None


def unpadded_twin(case_id: str) -> str | None:
    """The id of the built-in unpadded twin of the left-padded case ``case_id`` (``reorder_padded`` →
    ``reorder_unpadded``, ``bf16_long_decode`` → ``bf16_long_decode_unpadded``), or None when there is none."""
    twin = case_id.removesuffix("_padded") + "_unpadded"
    return twin if twin in _builtin_case_ids() else None


@functools.lru_cache(maxsize=1)
def _builtin_case_ids() -> frozenset:
    from kvconform.cases import load_cases

    return frozenset(case.id for case in load_cases())


# ------------------------------------------------------------------------------------------ messages in its terms
_POSITIONS = "positions: the start offset kvconform passes the adapter (cumsum(mask) - 1 on left-padded rows)"

_BATCH_WORDS = ("reorder", "select", "repeat", "swap", "beam")
"""The batch ops (in an op label or a case's ops line) a from-scratch model's ``select`` performs."""
_ANY, _PREFILL = ("",), ("prefill",)  # any op; an op label that begins with "prefill"
_CROP, _RESET = ("crop",), ("reset",)

_CAUSES = (
    # (check name, or "*"; words of the op label the step failed or raised at; cause in the model's terms)
    ("check_length_bookkeeping", _ANY,
     "your seq_length(cache) does not count the tokens the cache holds after that op: a counter your forward, crop, "
     "select or reset forgets to update (kvconform passes positions as start, so the logits stay right; code that "
     "reads your count — your own generation loop — continues at the wrong position)"),
    ("check_poisoned_capacity", _ANY,
     "your model reads slots your poison(cache, start, value) filled — slots the cache holds no token in: it attends "
     "a buffer past the start tokens it holds, or derives how many tokens it holds (where it writes next) from the "
     "buffer's contents (nonzero slots) rather than from start or a counter"),
    ("*", ("chunk(",),
     "your cached forward, given T > 1 new tokens while the cache already holds some (start > 0), attends them "
     "wrongly while single tokens and the prefill are right: look for a causal mask applied only when the queries "
     "are as long as the keys (a warm-cache chunk then attends its own later tokens), or a ring buffer written "
     "before it is read (a chunk that wraps overwrites keys its own earlier queries still need)"),
    ("check_multi_turn", _ANY,
     "your cache does not continue the first turn: kvconform fed your forward the turn-1 prompt, then one token per "
     "step, and feeds the second turn's tokens it does not hold yet (turn 1's last token and the new ones) as one "
     "chunk at start = the tokens held — a cached forward wrong on several new tokens into a warm cache (see the "
     "chunk items), or a cache that holds something else than the tokens it was fed"),
    ("check_prefix_generate", _ANY,
     "your cache does not continue the prefix: kvconform fed your forward the prefix, then the prompt's tokens past "
     "it as one chunk at start = the prefix's length, then one token per step — a cached forward wrong on several "
     "new tokens into a warm cache (see the chunk items), or a cache that lost or changed the prefix"),
    ("check_prefix_fork", _ANY,
     "fork(cache) (default copy.deepcopy) leaves the copy and the original sharing state: a forward on one "
     "changed the other — a list of per-block dicts copied shallowly (list(cache), cache.copy(), dict(layer)) keeps "
     "the same dicts, and a forward that assigns layer['key'] = cat(...) then writes into both"),
    ("*", _CROP,
     "after your crop(cache, n) the next forward is wrong: it must drop exactly the last n tokens of every block, "
     "and the positions of the next tokens must continue at the tokens kept — a position counter kept in the cache "
     "that crop resets to 0 or does not rewind, or a ring buffer whose evicted slots crop cannot bring back"),
    ("*", _RESET,
     "after your reset (or new_cache) the next sequence is wrong: buffers kept from the previous sequence — its "
     "batch size (a setup that returns early when buffers exist), its length or its tokens"),
    ("*", _BATCH_WORDS,
     "your select(cache, rows) does not move every tensor of every block to the rows asked, in that order"),
    ("*", _PREFILL,
     "your cached forward of the first tokens, into an empty cache, differs from your uncached forward of the same "
     "tokens: the cached path computes something else — look for a causal mask (or positions) built only when no "
     "cache is passed"),
)


def likely_cause(check_name: str, ops: OpsTrail | None, failed_at: str | None = None) -> str | None:
    """A likely cause in the adapter's own terms for a failure of a from-scratch model's item, from the op it
    failed or raised at (``ops.at``; ``failed_at`` where the failure has no ops trail), the ops it ran (``ops``)
    and the check; None where none applies (the generic one stays)."""
    at = (ops.at or "") if ops is not None else (failed_at or "")
    ran = (ops.label + (f"   [{ops.verb} at {ops.at}]" if ops.at else "")) if ops is not None else ""
    for check, words, cause in _CAUSES:
        if check not in ("*", check_name):
            continue
        by_ops = words in (_CROP, _RESET) or (words == _BATCH_WORDS and not at.startswith("prefill"))
        if by_ops and ops is not None and ops.op_index is not None:  # measured: only the ops before the failing one
            ran = " → ".join(label for _, label in ops.ops[:ops.op_index])
        if check != "*" or _names(at, words) or (by_ops and _names(ran, words) and at):
            return cause
    return None


def _names(text: str, words) -> bool:
    """Whether ``text`` (an op label or the ops run) holds one of ``words`` (``_PREFILL``: begins with it)."""
    if words is _ANY:
        return True
    if words is _PREFILL:
        return text.startswith("prefill")
    return any(w in text for w in words)


def adapter_lines(check_name: str, lines: list, failed_at: str | None = None, raised: bool = False) -> list:
    """A failure's body (``Failure.body``: strings, an ``OpsTrail``, a ``Cause``) for an item of a from-scratch
    model: the likely cause said in the adapter's terms (``likely_cause``; the generic reading kept after it, the
    cause's id and facts kept), positions described as the start offset it is given (the trail's note).
    ``failed_at``: the step label a failure without an ops trail failed at (a fuzz program's), or None; ``raised``:
    the item failed on an exception (the generic cause then says so)."""
    ops = next((x for x in lines if isinstance(x, OpsTrail)), None)
    cause = likely_cause(check_name, ops, failed_at)
    out: list = []
    for line in lines:
        if isinstance(line, str) and line.startswith("likely cause: "):  # a check's plain cause line: typed here
            line = Cause(line.removeprefix("likely cause: "))
        if isinstance(line, OpsTrail) and line.note:
            line = dataclasses.replace(line, note=_POSITIONS)
        if isinstance(line, Cause):
            foreign = _foreign(line.text)
            if cause:
                line = line.with_text(cause if foreign else f"{cause} (kvconform's reading: {line.text})")
                cause = None
            elif foreign:
                line = line.with_text(_generic_cause(ops, failed_at, raised))
        out.append(line)
    if cause:
        out.append(Cause(cause, "adapter"))
    return out


_FOREIGN = ("get_seq_length", "generate()", "generate calls", "update(", "reorder_cache", "batch_repeat_interleave",
            "batch_select_indices", "repeat_interleave", "__deepcopy__", "get_mask_sizes", "is_croppable",
            "kvconform_poison", "DynamicCache", "StaticCache", "DynamicLayer", "StaticLayer", "cache_implementation",
            "get_max_length", "get_max_cache_shape")
"""Words of kvconform's generic causes that name transformers' cache API (or kvconform's hook for it): a cause that
holds one is not said to a from-scratch model, whose adapter has none of them."""


def _foreign(text: str) -> str | None:
    """The first word of ``_FOREIGN`` in ``text``, or None."""
    return next((w for w in _FOREIGN if w in text), None)


def _generic_cause(ops: OpsTrail | None, failed_at: str | None, raised: bool = False) -> str:
    """The cause said to an adapter where no cause in its terms applies and kvconform's names transformers' API:
    where it failed, and the ops that ran before it (measured: ``OpsTrail.op_index``)."""
    at = (ops.at if ops is not None else None) or failed_at
    before = ""
    if ops is not None and ops.op_index:
        before = " → ".join(label for _, label in ops.ops[:ops.op_index])
    if raised or (ops is not None and ops.verb == "raised"):
        return ("your adapter's code raised" + (f" at {at}" if at else "") + (f", after {before}" if before else "")
                + " (see the exception and its line): the cache cannot take this call in the state those ops left")
    return ("your cached forward" + (f" at {at}" if at else "") + " differs from your uncached forward of the same "
            "tokens" + (f", after {before}" if before else "") + ": the cache held something else than the tokens "
            "kvconform fed it, or your forward reads them at the wrong positions")
