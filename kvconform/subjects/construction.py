"""The construction contract: which keyword arguments a factory is called with (``accepted_names``,
``accepted_kwargs``, ``names_model``, ``required_unknown_arguments``), what it may return (``unpack_factory_result``)
and the errors of a build (``SubjectBuildError``, ``FactoryResultError``). See ``kvconform.subjects``."""

from __future__ import annotations

import inspect
from typing import Mapping

from kvconform.outcomes import KVConformError

CONSTRUCTION_KWARGS = ("config", "max_cache_len", "batch_size", "device", "dtype", "model")
"""What a factory may be called with; ``model`` only when its signature names it (see the module docstring)."""

MODEL_KWARG = "model"


class FactoryResultError(TypeError, KVConformError):
    """A factory returned something that is neither a ``transformers.Cache`` nor a ``(Cache, context manager)``
    pair. ``str(err)`` names the subject, what it returned and the two accepted shapes."""


def _describe(obj) -> str:
    if isinstance(obj, (tuple, list)):
        inner = ", ".join(type(x).__name__ for x in obj[:4]) + (", ..." if len(obj) > 4 else "")
        return f"a {type(obj).__name__} of {len(obj)} ({inner})"
    if inspect.isclass(obj):
        return f"the class {obj.__module__}.{obj.__qualname__} (not an instance: call it)"
    return "None" if obj is None else f"a {type(obj).__module__}.{type(obj).__qualname__}"


def _is_context_manager(obj) -> bool:
    return hasattr(type(obj), "__enter__") and hasattr(type(obj), "__exit__")


def unpack_factory_result(name: str, built):
    """``(cache, context or None)`` from what a factory returned: a ``transformers.Cache``, or a pair ``(Cache,
    context manager)`` (a list of two is accepted as a pair).

    Raises:
        FactoryResultError: anything else (a pair whose first item is no Cache or whose second has no
            ``__enter__``/``__exit__``, a tuple of another length, None, ...), naming what was returned.
    """
    from transformers import Cache

    if isinstance(built, Cache):
        return built, None
    pair = isinstance(built, (tuple, list)) and len(built) == 2
    if pair and isinstance(built[0], Cache) and _is_context_manager(built[1]):
        return built[0], built[1]
    what = _describe(built)
    if pair and isinstance(built[0], Cache):
        why = (f"; its second item, a {type(built[1]).__name__}, is not a context manager (no __enter__/__exit__: "
               f"return the context itself, e.g. press(model), not the press)")
    elif pair and _is_context_manager(built[1]):
        why = f"; its first item, a {type(built[0]).__name__}, is not a transformers.Cache"
    else:
        why = ""
    raise FactoryResultError(
        f"{name} returned {what}{why}; a factory returns a transformers.Cache, or a pair (cache, context manager) "
        f"whose context kvconform enters around every forward and generate call, e.g. "
        f"'return DynamicCache(config=config), press(model)'")


class SubjectBuildError(KVConformError):
    """Building a fresh cache of a subject raised. ``name``: the subject; ``kwargs``: the keyword names it was
    called with; ``cause``: the exception."""

    def __init__(self, name: str, kwargs: list, cause: BaseException):
        super().__init__(f"{name}({', '.join(f'{k}=...' for k in kwargs)}) raised {type(cause).__name__}: {cause}")
        self.name, self.kwargs, self.cause = name, kwargs, cause


def _named(params) -> set:
    return {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n != "self"}


def _takes_var_keyword(params) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def accepted_names(factory) -> set | None:
    """The keyword names ``factory`` accepts, or None when it accepts any (or its signature cannot be read).

    A class whose ``__init__`` takes ``**kwargs`` and forwards them to its base (``class MyCache(DynamicCache):
    def __init__(self, bits=4, **kwargs): super().__init__(**kwargs)``, the usual pattern of third-party caches)
    accepts its own names plus those of the ``__init__`` methods along its MRO, up to the first that takes no
    ``**kwargs`` (there ``DynamicCache.__init__``: ``config``, ... but not ``max_cache_len``).
    """
    try:
        if not inspect.isclass(factory):
            params = inspect.signature(factory).parameters
            return None if _takes_var_keyword(params) else _named(params)
        names: set = set()
        for klass in factory.__mro__:
            init = klass.__dict__.get("__init__")
            if init is None:
                continue
            if klass is object:
                return names
            params = inspect.signature(init).parameters
            names |= _named(params)
            if not _takes_var_keyword(params):
                return names
        return None
    except (TypeError, ValueError):
        return None


def meta_model(config):
    """A weightless transformers model of ``config`` on the meta device (``AutoModelForSeq2SeqLM`` for
    encoder-decoders, ``AutoModelForImageTextToText`` for a vision-language config it maps and the causal-LM mapping
    does not, else ``AutoModelForCausalLM``): what a model-aware factory gets where kvconform only needs to see what it
    builds (``CacheSpec.plan_build``). Its parameters have shapes and dtypes (float32) but no data."""
    import torch

    from kvconform.architectures import auto_model_class

    with torch.device("meta"):
        return auto_model_class(config).from_config(config)


def names_model(factory) -> bool:
    """Whether ``factory`` names the ``model`` keyword: a function parameter, or a parameter of an ``__init__``
    along a class's MRO up to the first without ``**kwargs`` (the chain ``accepted_names`` reads). A bare
    ``**kwargs`` does not count: ``model`` is only handed to a factory that asks for it."""
    try:
        if not inspect.isclass(factory):
            return MODEL_KWARG in _named(inspect.signature(factory).parameters)
    except (TypeError, ValueError):
        return False
    names = accepted_names(factory)
    return names is not None and MODEL_KWARG in names


def accepted_kwargs(factory, available: Mapping) -> dict:
    """The subset of ``available`` that ``factory`` accepts (see ``accepted_names``; all of it when any name is),
    except ``model``, given only where the factory names it (``names_model``)."""
    names = accepted_names(factory)
    out = dict(available) if names is None else {k: v for k, v in available.items() if k in names}
    if MODEL_KWARG in out and not names_model(factory):
        del out[MODEL_KWARG]
    return out


def required_unknown_arguments(factory) -> list[str]:
    """Required parameters of ``factory`` (of a class: of its ``__init__``) that kvconform never passes (not in
    ``CONSTRUCTION_KWARGS``): such a subject cannot be built at all."""
    try:
        target = factory.__init__ if inspect.isclass(factory) else factory
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return []
    return [n for n, p in params.items()
            if n != "self" and p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and n not in CONSTRUCTION_KWARGS]
