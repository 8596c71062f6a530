"""A model adapter's spec, loading and protocol validation (``kvconform.scratch`` documents the protocol): which
``--kvconform-model`` values name an adapter, importing it once per process, what it declares (name, layer types,
vocabulary, padding mask, capabilities, compiled decode step). Imports neither torch nor transformers."""

from __future__ import annotations

import os
import re

from kvconform.outcomes import UsageError

REQUIRED = {
    "build": "build(self, dtype, device) -> nn.Module with seeded weights",
    "new_cache": "new_cache(self, model, batch_size, max_len) -> an empty cache",
    "forward": "forward(self, model, ids, cache, start, mask=None) -> (logits [B, T, V], cache)",
    "forward_uncached": "forward_uncached(self, model, ids, mask=None) -> logits [B, T, V]",
}
"""The methods every adapter defines, with the signature its usage error shows."""

EXAMPLES = ("kvconform.examples.tiny_decoder:TinyDecoder", "kvconform.examples.tiny_decoder:TinySlidingDecoder",
            "kvconform.examples.tiny_decoder:TinyDecoderTwoCaches",
            "kvconform.examples.tiny_decoder:TinyMasklessDecoder",
            "kvconform.examples.tiny_encoder_decoder:TinyEncoderDecoder")
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


class AdapterUsageError(UsageError, ValueError):
    """A model adapter that cannot be used (exit 4): ``str(err)`` names the spec, what is wrong and the fix."""


class AdapterError(Exception):
    """A model adapter broke its protocol in a forward (wrong logits shape or dtype, input ids changed in place,
    a cache not returned): raised inside the call on the subject, so it fails the item as the subject's fault."""


class ModelForwardError(AdapterError):
    """The adapter's uncached forward (``forward_uncached``: kvconform's oracle and noise floor) raised: the model's
    failure, judged as such (``model_at_fault``), never blamed on the cache."""

    model_at_fault = True


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

    from kvconform.subjects.resolve import _import_file, _import_module, _where

    target, attr = spec.rsplit(":", 1)
    try:
        module = _import_file(target) if target.endswith(".py") else _import_module(target)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's spec problem
        raise AdapterUsageError(f"--kvconform-model {spec!r}: importing {target!r} failed: {type(exc).__name__}: {exc}"
                         ) from None
    if not hasattr(module, attr):
        raise AdapterUsageError(f"--kvconform-model {spec!r}: {_where(target)} has no attribute {attr!r}")
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
    problem = encoder_decoder_problem(adapter)
    if problem:
        return problem
    caches = getattr(adapter, "caches", None)
    if caches is not None and (not isinstance(caches, dict) or not all(
            isinstance(k, str) and re.fullmatch(r"[A-Za-z0-9_.]+", k) and isinstance(v, dict)
            for k, v in caches.items())):
        return ("caches must be a dict {subject name ([A-Za-z0-9_.]+): new_cache keyword arguments (a dict)}, got "
                f"{caches!r}")
    return None


ENCODER_DECODER = {
    "encode": "encode(self, model, encoder_ids) -> states (encoder_ids [B, S_enc] int64 token ids; states any object "
              "whose rows forward reads, e.g. a [B, S_enc, dim] tensor)",
    "forward": "forward(self, model, ids, cache, start, mask=None, encoder=None) -> (logits [B, T, V], cache)",
    "forward_uncached": "forward_uncached(self, model, ids, mask=None, encoder=None) -> logits [B, T, V]",
}
"""What an adapter declaring ``is_encoder_decoder = True`` defines beyond ``REQUIRED``: ``encode``, and an
``encoder`` keyword on both forwards (the states ``encode`` returned for the rows of ``ids``)."""


def is_encoder_decoder(adapter) -> bool:
    """Whether the adapter declares an encoder-decoder model (``is_encoder_decoder = True``)."""
    return getattr(adapter, "is_encoder_decoder", False) is True


def _takes_keyword(fn, name: str) -> bool:
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable: not inspectable, taken as it is
        return True
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def encoder_decoder_problem(adapter) -> str | None:
    """What is wrong with an adapter's encoder-decoder declaration, naming the fix, or None (a decoder-only adapter
    that defines no ``encode``, or a complete encoder-decoder one): ``is_encoder_decoder`` not a bool; declared but
    ``encode`` missing or a forward without the ``encoder`` keyword; ``encode`` defined without the declaration (a
    half-declared adapter would be checked as a decoder-only model whose cross-attention no item reaches)."""
    what = type(adapter).__name__
    declared = getattr(adapter, "is_encoder_decoder", False)
    if declared not in (True, False):
        return f"{what}.is_encoder_decoder must be True or False, got {declared!r}"
    has_encode = callable(getattr(adapter, "encode", None))
    if not declared:
        if has_encode:
            return (f"{what} defines encode() but does not declare is_encoder_decoder = True: kvconform would check "
                    f"it as a decoder-only model and never feed its encoder; declare is_encoder_decoder = True (and "
                    f"take encoder=states in forward and forward_uncached), or drop encode")
        return None
    missing = [] if has_encode else ["encode"]
    missing += [name for name in ("forward", "forward_uncached") if not _takes_keyword(getattr(adapter, name),
                                                                                        "encoder")]
    if not missing:
        return None
    return (f"{what} declares is_encoder_decoder = True, but " + "; ".join(
        f"{'has no encode method' if m == 'encode' else m + ' takes no encoder keyword'}" for m in missing)
        + "; an encoder-decoder adapter defines " + "; ".join(ENCODER_DECODER[m] for m in missing)
        + " (kvconform.scratch documents the protocol; kvconform.examples.tiny_encoder_decoder is a worked example)")


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


