"""Subjects: the caches under test, as ``CacheSpec`` (a factory plus declared capabilities).

Built-in subjects are the reference cache kvconform ships and the transformers caches; ``--kvconform-cache SPEC``
adds user subjects, where SPEC is ``package.module:attr`` or ``path/to/file.py:attr`` and ``attr`` is a
``transformers.Cache`` subclass or a factory returning one.

Construction contract: a subject is built with keyword arguments drawn from
``{config, max_cache_len, batch_size, device, dtype}`` — only those its signature accepts, all of them if it takes
``**kwargs``. For encoder-decoder models it is built twice (self-attention with ``max_cache_len`` of the decoder
sequence, cross-attention with ``max_cache_len`` of the encoder input) and wrapped in ``EncoderDecoderCache``.

Model-aware subjects (caches that need the model itself: presses that hook its attention modules, ``for_model``
constructors, patchers) have two more shapes:

* a factory may take ``model``: the loaded ``transformers.PreTrainedModel`` the item runs, on the item's device and
  dtype. It is passed only to a factory that *names* it — a function parameter ``model``, or a parameter ``model``
  of some ``__init__`` along a class's MRO (``accepted_names``) — never through a bare ``**kwargs``: a factory that
  forwards ``**kwargs`` to ``DynamicCache``/``StaticCache`` must not be handed a model it would pass on.
* a factory may return a pair ``(cache, context)`` where ``context`` is a context manager (``press(model)``).
  kvconform enters it around every forward and every ``generate`` call made with that cache (and with its
  ``deepcopy``), and never around the oracle's, the reference's or a twin's calls on the same model. It is
  entered and exited per call, so that it is never active while another cache runs the model; an exception inside
  still exits it. A ``@contextlib.contextmanager`` object (single use) is recreated for each call; an object of your
  own class is entered again. After each exit kvconform checks that the model is as before the entry (module hooks,
  instance attributes such as a patched ``forward``, class ``forward`` methods, global module hooks): what is left
  over is removed and the call fails with ``ModelLeftChanged`` naming it. For encoder-decoder models the context of
  the self-attention call is used (the cross-attention call's only where the self-attention call returned none):
  one context per model call, never two presses on one model.

Example (a press-like subject)::

    @contextlib.contextmanager
    def scale_hooks(model):                      # registers hooks on enter, removes them on exit
        handles = [m.register_forward_hook(hook) for m in attention_modules(model)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def pressed(config, model):                  # names ``model``: it is passed
        return DynamicCache(config=config), scale_hooks(model)
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass, field
from typing import Callable, Mapping

from kvconform.outcomes import with_article
from kvconform.subjects.kinds import (ALL_KINDS, DEFAULT_JUDGES, EVICTING, EXACT, FRESH, KIND_NAMES,  # noqa: F401
                                      LOSSY_FRESH, LOSSY_TWIN, ORACLE, TWIN, Kind, kind_of)

CONSTRUCTION_KWARGS = ("config", "max_cache_len", "batch_size", "device", "dtype", "model")
"""What a factory may be called with; ``model`` only when its signature names it (see the module docstring)."""

MODEL_KWARG = "model"

CALL_CONTEXT_ATTR = "_kvconform_call_context"
"""Attribute of a built cache holding the per-call context of a ``(cache, context)`` factory (see ``call_context``)."""

CAPABILITIES = ("forward", "generate", "crop", "deepcopy", "reorder", "batch_repeat", "batch_select", "reset",
                "compile")
"""Capability vocabulary: what a subject declares it supports; a check needing an undeclared one is skipped."""

KINDS = ("exact", "lossy", "evicting", "press")
"""What a subject promises about the logits it gives:

* ``exact``: the logits of the uncached model, within float noise (the default);
* ``lossy``: it compresses what it holds (quantization, low rank, ...): judged by quality against the float64 oracle
  within its ``Budget``, by self-consistency (every cache operation gives what a fresh instance of the same class
  fed the equivalent history gives), and by holding fewer bytes than an exact cache;
* ``evicting``: it drops tokens past a bound (attention sinks + window): exact until it holds ``Budget.tokens_max``
  tokens, then judged by quality and by its memory bound;
* ``press``: it compresses the prefill by keeping a subset of its tokens exactly, at any length, with no token bound
  (KV presses: StreamingLLM, Knorm, SnapKV, ExpectedAttention ratios): judged like ``lossy`` (self-consistency,
  quality, real compression) plus the press contract (``checks/press.py``: ``get_seq_length()`` = tokens seen,
  short prompts handled or refused clearly, held tokens a subset of the fed ones).

The kinds as objects (what each is compared with, which checks judge it): ``kvconform.subjects.kinds``.
"""


@dataclass(frozen=True)
class Budget:
    """What a lossy, evicting or press subject promises, in place of exactness.

    Attributes:
        kl_max: mean KL(oracle ‖ subject) in nats per position, over every position that read the cache in the
            long-context quality cases (next-token distributions of the float64 oracle vs the subject's).
        top1_min: fraction of those positions whose top-1 token equals the oracle's, in [0, 1].
        bytes_ratio_max: lossy and press, optional: the subject's held bytes after the long context divided by an exact
            cache's (``ReferenceCache``, same model, dtype and ops) must be ≤ this; without it the ratio must be < 1
            (compression must be real).
        tokens_max: evicting only, required: the most tokens the cache holds per row and attention layer (e.g.
            sinks + window); the held bytes are bounded by this many tokens' keys and values.

    Declared as ``CacheSpec(..., kind="lossy", budget=Budget(...))`` (or a dict with these keys), or on a Cache
    subclass / factory as ``kvconform_lossy = {"kl_max": ..., "top1_min": ...}`` / ``kvconform_evicting = {...}``.
    """

    kl_max: float
    top1_min: float
    bytes_ratio_max: float | None = None
    tokens_max: int | None = None

    @classmethod
    def from_mapping(cls, value, where: str) -> "Budget":
        """A ``Budget`` from a ``Budget`` or a dict of its fields.

        Raises:
            SpecError: not a dict/Budget, unknown keys (with the closest known), missing ``kl_max``/``top1_min``, or
                a value of the wrong type or range.
        """
        import dataclasses

        if isinstance(value, Budget):
            value = dataclasses.asdict(value)
        if not isinstance(value, Mapping):
            raise SpecError(f"{where}: the budget must be a dict with keys {', '.join(BUDGET_KEYS)}; got {value!r}")
        _check_names(where, "budget keys", set(value), BUDGET_KEYS)
        missing = [k for k in ("kl_max", "top1_min") if k not in value]
        if missing:
            raise SpecError(f"{where}: the budget needs {' and '.join(missing)} (e.g. {{'kl_max': 0.05, "
                            f"'top1_min': 0.8}}: mean KL(oracle ‖ subject) in nats and top-1 agreement)")
        ranges = {"kl_max": (float, 0, None), "top1_min": (float, 0, 1), "bytes_ratio_max": (float, 0, None),
                  "tokens_max": (int, 1, None)}
        for key, v in value.items():
            kind, lo, hi = ranges[key]
            if v is None and key in ("bytes_ratio_max", "tokens_max"):
                continue
            ok = not isinstance(v, bool) and (isinstance(v, int) if kind is int else isinstance(v, (int, float)))
            if not ok or v < lo or (hi is not None and v > hi):
                want = "an int" if kind is int else "a number"
                bounds = f" in [{lo}, {hi}]" if hi is not None else f" ≥ {lo}"
                raise SpecError(f"{where}: budget {key} must be {want}{bounds}; got {v!r}")
        return cls(**{k: value[k] for k in value})


BUDGET_KEYS = ("kl_max", "top1_min", "bytes_ratio_max", "tokens_max")


class SpecError(ValueError):
    """A ``--kvconform-cache`` spec cannot be resolved. ``str(err)`` names the spec and the cause."""


@dataclass(frozen=True)
class CacheSpec:
    """A subject: how to build the cache and what it claims.

    Attributes:
        name: name in ids and reports (the attr name for user subjects); ``[A-Za-z0-9_.]+``.
        factory: a ``Cache`` subclass or a callable returning a ``Cache`` or a pair ``(Cache, context manager)``;
            called with the keyword arguments of ``CONSTRUCTION_KWARGS`` that its signature accepts (``model``, the
            ``PreTrainedModel`` of the item, only where it names it). The context manager is entered around every
            forward and ``generate`` call made with the cache (module docstring: model-aware subjects).
        capabilities: subset of ``CAPABILITIES``.
        expected_failures: ``{check name or "check:case": reason}`` — these items become xfail.
        tolerance_factor: multiplies the case tolerance factor ``k`` (lossy subjects declare > 1).
        applies_to: optional ``fn(model_info) -> reason or None`` excluding models the subject cannot serve.
        source: ``"builtin"`` or the spec string it was resolved from.
        tier: ``"default"``, or ``"full"`` for subjects that only run under ``--kvconform-full`` (keeps the default
            run within its time budget; e.g. the 2-bit quantized variants).
        twin: for a lossy (quantized) subject, the factory of its fake-quant reference (``kvconform.quant``,
            built with the same construction kwargs): the exact families compare the subject with the twin run on
            the same ops instead of the oracle, and the quality family holds it to a budget against the oracle.
        requires: ``{"module" or "module:attr": install hint}`` — items skip with "requires X (hint)" where one is
            not importable (optional backends such as hqq).
        needs_cuda: the skip reason when the run's device is not CUDA (e.g. "offloading needs CUDA"); None: any.
        same_as: name of the subject whose logits this one must equal exactly (offloaded → non-offloaded).
        notes: ``{capability: why it is not declared}`` — appended to the skip reason of items needing it (e.g. a
            method the installed transformers does not implement for this cache).
        kind: one of ``KINDS`` (``"exact"``, ``"lossy"``, ``"evicting"``).
        budget: a ``Budget`` (or a dict of its fields), required for a lossy or evicting subject, None for an exact
            one.
        page_size: the cache's allocation granularity in tokens (a paged / block cache that allocates K/V in pages
            of ``page_size`` tokens), or None (undeclared: the memory family infers it from the steps in which the
            held bytes grow). The memory budget of an exact, non-preallocated layer then allows at most one page per
            row of slack above the formula (``page_size · B · H_kv · (D_k + D_v) · b`` bytes per layer). A Cache
            subclass or factory declares it with a ``kvconform_page_size = N`` attribute (``declared_page_size``).
        allocation: how the cache allocates K/V when not token by token (``ALLOCATIONS``): ``"preallocated"`` (every
            bounded layer holds its capacity from the first token on: a fixed ring of a sliding layer's window, a
            capacity buffer), ``"doubling"`` (amortised doubling buffers: at most twice the tokens held), or None
            (undeclared: the memory family infers it from the held bytes). Declared with ``kvconform_allocation``.
    """

    name: str
    factory: Callable
    capabilities: frozenset = frozenset(CAPABILITIES)
    expected_failures: Mapping[str, str] = field(default_factory=dict)
    tolerance_factor: float = 1.0
    applies_to: Callable | None = None
    source: str = "builtin"
    tier: str = "default"
    kind: str = "exact"
    budget: Budget | None = None
    twin: Callable | None = None
    requires: Mapping[str, str] = field(default_factory=dict)
    needs_cuda: str | None = None
    same_as: str | None = None
    notes: Mapping[str, str] = field(default_factory=dict)
    page_size: int | None = None
    allocation: str | None = None

    def __post_init__(self):
        if isinstance(self.budget, Mapping):  # a dict is accepted for convenience; validate_spec checks it
            try:
                object.__setattr__(self, "budget", Budget.from_mapping(self.budget, repr(self.name)))
            except SpecError:
                pass  # kept as given: validate_spec reports it with where it came from

    def build_one(self, **available):
        """Call the factory with the accepted subset of ``available`` (keys of ``CONSTRUCTION_KWARGS``; ``model``
        only where the factory names it) and return the cache. A ``(cache, context)`` result is unpacked: the
        context is attached to the cache (``call_context``), to be entered around each call on ``available["model"]``.

        Raises:
            SubjectBuildError: the factory raised, or returned something that is neither a ``Cache`` nor a
                ``(Cache, context manager)`` pair (then ``cause`` is a ``FactoryResultError`` naming what it
                returned); the item fails with that cause, the session goes on.
        """
        kwargs = accepted_kwargs(self.factory, available)
        try:
            built = self.factory(**kwargs)
        except Exception as exc:  # noqa: BLE001 - any error of the user's constructor is reported on its items
            raise SubjectBuildError(self.name, sorted(kwargs), exc) from exc
        try:
            cache, context = unpack_factory_result(self.name, built)
            if context is not None:
                _attach(cache, CallContext(self.name, context, available.get(MODEL_KWARG)))
        except FactoryResultError as exc:
            raise SubjectBuildError(self.name, sorted(kwargs), exc) from None
        return cache

    def plan_build(self, config):
        """The cache built for ``config`` without running anything (``max_cache_len=64``, ``batch_size=2``, CPU,
        ``dtype=None``), to read what it declares (``is_compileable``) or check what the factory returns. A factory
        naming ``model`` gets a weightless model of ``config`` on the meta device (``meta_model``); its context, if
        any, is never entered.

        Raises:
            SubjectBuildError: as ``build_one``.
        """
        extra = {MODEL_KWARG: meta_model(config)} if names_model(self.factory) else {}
        return self.build_one(config=config, max_cache_len=64, batch_size=2, device="cpu", dtype=None, **extra)

    def build(self, model, max_cache_len: int, batch_size: int, encoder_len: int = 0):
        """A fresh cache for ``model`` (a ``ZooModel``); wrapped in ``EncoderDecoderCache`` for encoder-decoders.

        The factory gets ``model.model`` (the ``PreTrainedModel``) as ``model`` where it names it. For
        encoder-decoders the wrapper carries the self-attention call's context (else the cross-attention call's).
        """
        device = next(model.model.parameters()).device
        common = dict(config=model.config, batch_size=batch_size, device=device, dtype=model.dtype,
                      model=model.model)
        if not model.is_encoder_decoder:
            return self.build_one(max_cache_len=max_cache_len, **common)
        from transformers import EncoderDecoderCache

        self_attention = self.build_one(max_cache_len=max_cache_len, **common)
        cross_attention = self.build_one(max_cache_len=max(encoder_len, 1), **common)
        wrapper = EncoderDecoderCache(self_attention, cross_attention)
        context = call_context(self_attention) or call_context(cross_attention)
        if context is not None:
            _attach(wrapper, context)
        return wrapper


class FactoryResultError(TypeError):
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


class ModelLeftChanged(RuntimeError):
    """A subject's context left the model changed after its ``__exit__`` (a hook still registered, a patched
    ``forward``). kvconform has restored the model; ``str(err)`` names what was left and where, ``likely_cause`` is
    the failure message's diagnosis."""

    likely_cause = ("the context manager the factory returned does not undo on __exit__ what it did on __enter__ "
                    "(keep the hook handles and remove them in a finally:, put patched methods back); kvconform "
                    "entered it around one call and removed what was left, so the next call and the next subject run "
                    "an unchanged model")


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_forward_hooks_always_called",
                 "_global_forward_hooks_with_kwargs", "_global_backward_hooks", "_global_backward_pre_hooks")


_METHODS: dict = {}


def _methods(cls) -> frozenset:
    """The names of ``cls``'s callable attributes (memoised per class)."""
    if cls not in _METHODS:
        _METHODS[cls] = frozenset(n for n in dir(cls) if callable(getattr(cls, n, None)))
    return _METHODS[cls]


def _model_state(model, modules=None) -> dict:
    """What a context may change on ``model`` (an ``nn.Module``) and must restore: per module its hook ids, the
    instance attributes that shadow a method of its class (a patched ``forward``; not what transformers caches on the
    instance, such as ``generate``'s ``_compiled_call``) and its class's ``forward``; the global module hooks.
    ``modules``: ``list(model.named_modules())`` when the caller has it. Cost: one walk over the modules (0.5 ms for
    the 33-module zoo llama on a shared 2-core machine under load, where its decode step took 9 ms)."""
    import torch

    state: dict = {}
    for name, module in modules if modules is not None else model.named_modules():
        own = module.__dict__
        for attr in _HOOK_DICTS:
            hooks = own.get(attr)
            if hooks:
                state[("hook", name, attr)] = (module, hooks, frozenset(hooks))
        for key in own.keys() & _methods(type(module)):  # an instance attribute shadowing a method
            value = own[key]
            if callable(value) and not isinstance(value, torch.nn.Module):
                state[("attr", name, key)] = (module, key, value)
        state[("class", type(module))] = type(module).__dict__.get("forward")
    globals_ = torch.nn.modules.module
    for attr in _GLOBAL_HOOKS:
        hooks = getattr(globals_, attr, None)
        if hooks is not None:
            state[("global", attr)] = (hooks, frozenset(hooks))
    return state


def _restore(model, before: dict, modules=None) -> list[str]:
    """Put ``model`` back to ``before`` (``_model_state``): remove hooks added since, restore instance attributes
    and class ``forward`` methods. Returns what was changed, one phrase each (empty: nothing)."""
    changes = []
    after = _model_state(model, modules)
    for key, value in after.items():
        kind = key[0]
        if kind == "hook":
            _, name, attr = key
            module, hooks, ids = value
            extra = ids - (before[key][2] if key in before else frozenset())
            for hook_id in extra:
                hooks.pop(hook_id, None)
            if extra and "always_called" not in attr and "with_kwargs" not in attr:
                changes.append(f"{len(extra)} {attr.strip('_').replace('_', ' ')[:-1]} on {name or 'the model'}")
        elif kind == "attr":
            _, name, attr = key
            module, _, fn = value
            if key not in before:
                del module.__dict__[attr]
                changes.append(f"{name or 'the model'}.{attr} set on the instance")
            elif before[key][2] is not fn:
                module.__dict__[attr] = before[key][2]
                changes.append(f"{name or 'the model'}.{attr} replaced")
        elif kind == "class":
            if key in before and before[key] is not value:
                if before[key] is None:
                    delattr(key[1], "forward")
                else:
                    setattr(key[1], "forward", before[key])
                changes.append(f"{key[1].__name__}.forward replaced on the class")
        elif kind == "global":
            hooks, ids = value
            extra = ids - (before[key][1] if key in before else frozenset())
            for hook_id in extra:
                hooks.pop(hook_id, None)
            if extra and "always_called" not in key[1] and "with_kwargs" not in key[1]:
                changes.append(f"{len(extra)} {key[1].strip('_').replace('_', ' ')[:-1]}")
    for key, value in before.items():  # a callable attribute the context deleted
        if key[0] == "attr" and key not in after:
            module, attr, fn = value
            module.__dict__[attr] = fn
            changes.append(f"{key[1] or 'the model'}.{attr} deleted")
    return changes


class CallContext:
    """The context of a ``(cache, context)`` factory result, entered per call (``around``).

    Attributes:
        subject: the subject's name (for messages).
        context: the context manager the factory returned, entered for the first call; a
            ``@contextlib.contextmanager`` object (single use) is recreated for every later call from an unentered
            copy (``_recreate_cm``, the ``ContextDecorator`` protocol: the same function and arguments, so
            ``press(model)`` again), any other object is entered again.
        model: the ``nn.Module`` whose state is checked around each call (the factory's ``model``), or None (then
            the model of the call is used).

    ``copy.deepcopy`` and ``copy.copy`` return the object itself: a forked cache shares its original's context.
    """

    def __init__(self, subject: str, context, model=None):
        self.subject, self.context, self.model = subject, context, model
        self._used = False
        self._active = False
        # a @contextmanager object forgets its function once entered: keep an unentered copy to recreate from
        self._template = context._recreate_cm() if hasattr(context, "func") and hasattr(context, "_recreate_cm") \
            else None

    def __deepcopy__(self, memo):
        return self

    def __copy__(self):
        return self

    def _fresh(self):
        if not self._used:
            self._used = True
            return self.context
        return self._template._recreate_cm() if self._template is not None else self.context

    def around(self, model=None):
        """A context manager: enter the subject's context, run the body, exit it (also when the body raises),
        then restore ``model`` (default: ``self.model``) to its state before the entry.

        Raises:
            ModelLeftChanged: after the exit, the model still had hooks or patched methods the context added (they
                are removed first); not raised when the body or the context itself raised (that error wins).
        """
        import contextlib

        holder = self

        @contextlib.contextmanager
        def _around():
            if holder._active:  # nested (a generate inside a wrapped region): already entered
                yield
                return
            target = model if model is not None else holder.model
            modules = list(target.named_modules()) if target is not None else None
            before = _model_state(target, modules) if target is not None else None
            holder._active = True
            failed = False
            try:
                with holder._fresh():
                    yield
            except BaseException:
                failed = True
                raise
            finally:
                holder._active = False
                changes = _restore(target, before, modules) if before is not None else []
                if changes and not failed:
                    raise ModelLeftChanged(
                        f"{holder.subject}'s context ({type(holder.context).__name__}) left the model changed "
                        f"after __exit__: {'; '.join(changes[:2])}"
                        f"{f'; +{len(changes) - 2} more' if len(changes) > 2 else ''}")

        return _around()


def _attach(cache, context: CallContext) -> None:
    """Set ``cache``'s per-call context (``CALL_CONTEXT_ATTR``) to a function returning ``context``: a function is
    what ``copy.deepcopy`` and memory walks (``held_tensors``) leave alone."""
    def get():
        return context

    try:
        setattr(cache, CALL_CONTEXT_ATTR, get)
    except (AttributeError, TypeError) as exc:
        raise FactoryResultError(f"{context.subject}: cannot attach its context to the {type(cache).__name__} it "
                                 f"returned ({exc}); a cache with __slots__ needs a __dict__") from None


def call_context(cache) -> CallContext | None:
    """The ``CallContext`` of a cache built from a ``(cache, context)`` factory result, else None (any other
    object, None included)."""
    get = getattr(cache, CALL_CONTEXT_ATTR, None) if cache is not None else None
    return get() if callable(get) else None


class SubjectBuildError(Exception):
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
    encoder-decoders, else ``AutoModelForCausalLM``): what a model-aware factory gets where kvconform only needs to see
    what it builds (``CacheSpec.plan_build``). Its parameters have shapes and dtypes (float32) but no data."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    auto = AutoModelForSeq2SeqLM if getattr(config, "is_encoder_decoder", False) else AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(config)


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


# ---------------------------------------------------------------------------------------------------- built-ins
def _reference(**kwargs):
    from kvconform.reference import ReferenceCache

    return ReferenceCache(**kwargs)


def _dynamic(config):
    from transformers import DynamicCache

    return DynamicCache(config=config)


def _static(config, max_cache_len):
    from transformers import StaticCache

    return StaticCache(config=config, max_cache_len=max_cache_len)


def static_crop_note() -> dict:
    """``CacheSpec.notes`` for static subjects: ``{"crop": reason}`` where the installed static layers cannot crop
    (``compat.static_layers_crop``), else ``{}``."""
    from kvconform import compat

    if compat.static_layers_crop():
        return {}
    return {"crop": f"StaticLayer has no crop() on transformers {compat.transformers_version()} (added in 5.24)"}


# ---------------------------------------------------------------------------------------------------- lossy, offloaded
def full_attention_only(model) -> str | None:
    """``CacheSpec.applies_to`` of QuantizedCache subjects: decoder-only, every layer full attention."""
    if model.is_encoder_decoder:
        return ("QuantizedCache supports decoder-only full-attention models only (transformers' generate refuses "
                "it for encoder-decoder models)")
    other = sorted(set(model.layer_types) - {"full_attention"})
    if other:
        return f"QuantizedCache supports full-attention models only ({model.name} has {', '.join(other)} layers)"
    return None


_REQUIRES = {
    "quanto": {"optimum.quanto": "pip install kvconform[quanto]"},
    "hqq": {"hqq": "pip install kvconform[hqq]"},
    "fp8": {"transformers.cache_utils:Fp8QuantizedLayer":
            "the fp8 backend of QuantizedCache is not in the installed transformers"},
}


QUANTIZED_BUDGETS = {
    "QuantizedCache_quanto4": Budget(kl_max=5e-3, top1_min=0.75, bytes_ratio_max=0.25),
    "QuantizedCache_quanto2": Budget(kl_max=0.15, top1_min=0.4, bytes_ratio_max=0.16),
    "QuantizedCache_hqq4": Budget(kl_max=1.5e-2, top1_min=0.7, bytes_ratio_max=0.25),
    "QuantizedCache_hqq2": Budget(kl_max=0.4, top1_min=0.2, bytes_ratio_max=0.16),
    "QuantizedCache_fp8": Budget(kl_max=1e-3, top1_min=0.85, bytes_ratio_max=0.3),
}
"""Budgets of the built-in quantized subjects, by subject name, calibrated on the quality family's long cases
(``quality_long`` / ``compression_long``: 240 tokens, fp32, batch 2) on llama / gpt2 / phi3 with transformers 5.24,
optimum-quanto 0.2.7 and hqq 0.2.8 (the fake-quant twins measure the same, bit for bit). Measured, then budget:

* quanto 4-bit: KL 1.0e-3 / 1.4e-4 / 9.5e-4, top-1 0.930 / 0.984 / 0.859 → KL 5e-3, top-1 0.75;
* HQQ 4-bit: KL 2.9e-3 / 2.8e-4 / 2.2e-3, top-1 0.875 / 0.992 / 0.891 → KL 1.5e-2, top-1 0.70;
* quanto 2-bit: KL 3.3e-2 / 3.1e-3 / 3.0e-2, top-1 0.688 / 0.914 / 0.578 → KL 0.15, top-1 0.40;
* HQQ 2-bit: KL 6.0e-2 / 9.2e-3 / 5.7e-2, top-1 0.523 / 0.820 / 0.547 → KL 0.4, top-1 0.20 (a 272-token variant of
  the case measured up to KL 0.12, top-1 0.36);
* fp8: KL 2.7e-4 / 1.0e-5 / 2.7e-4, top-1 0.953 / 1.000 / 0.938 → KL 1e-3, top-1 0.85;
* bytes held / an exact cache's: 4-bit 0.1875 (llama, phi3: group 32) / 0.156 (gpt2: group 64), i.e. 4 bits plus a
  float32 scale and shift per group, for quanto and HQQ alike; 2-bit 0.125 / 0.094; fp8 0.250 (8 of 32 bits and one
  frozen scale per layer) → 0.25, 0.16 and 0.30.

Margins: about 4× on KL, 0.1–0.15 on top-1 (a tiny random model's margins are small: at 2 bits a third of the tokens
flip at a KL of 0.05, so KL is the sharp bound), and byte ratios that storage at the next larger width would exceed
(4-bit stored as 8-bit: 0.31 > 0.25; 2-bit stored as 4-bit: 0.19 > 0.16). The byte ratios are of float32 keys and
values. A subject declaring quanto 4-bit that stores its keys at 2 bits is over its budget (tests/test_quantized.py).
"""


def quantized_subjects() -> list:
    """The built-in ``QuantizedCache`` subjects (quanto 4/2-bit, HQQ 4/2-bit, fp8), each with its twin.

    Capabilities: forward, generate, reorder, reset, batch_repeat, batch_select (the Cache API offers them; on 5.24
    they are broken for quantized layers, a known fault); deepcopy except quanto (``copy.deepcopy`` of quanto's
    wrapper tensors raises). No crop (``is_croppable`` is False), no compile.
    """
    from kvconform.quant import QUANTIZED, quantized_factory, twin_factory

    out = []
    for name, qc in QUANTIZED:
        caps = {"forward", "generate", "reorder", "reset", "batch_repeat", "batch_select"}
        caps |= {"deepcopy"} if qc.backend != "quanto" else set()
        out.append(CacheSpec(name, quantized_factory(qc), capabilities=frozenset(caps), twin=twin_factory(qc),
                             kind="lossy", budget=QUANTIZED_BUDGETS[name],
                             applies_to=full_attention_only, requires=_REQUIRES[qc.backend],
                             tier="full" if qc.nbits == 2 else "default"))
    return out


def _offloaded_dynamic(config):
    from transformers import DynamicCache

    return DynamicCache(config=config, offloading=True)


def _offloaded_static(config, max_cache_len):
    from transformers import StaticCache

    return StaticCache(config=config, max_cache_len=max_cache_len, offloading=True)


OFFLOAD_REASON = "offloading needs CUDA"


def offloaded_subjects() -> list:
    """``DynamicCache(offloading=True)`` and ``StaticCache(offloading=True)``: CUDA only (skipped elsewhere), each
    declaring the non-offloaded subject it must equal (``same_as``)."""
    notes = static_crop_note()
    return [
        CacheSpec("DynamicCache_offloaded", _offloaded_dynamic, needs_cuda=OFFLOAD_REASON, same_as="DynamicCache"),
        CacheSpec("StaticCache_offloaded", _offloaded_static, needs_cuda=OFFLOAD_REASON, same_as="StaticCache",
                  capabilities=frozenset(CAPABILITIES) - {"batch_repeat", "batch_select"} - set(notes), notes=notes),
    ]


def builtin_subjects() -> list[CacheSpec]:
    """ReferenceCache, DynamicCache(config=…), StaticCache(config=…, max_cache_len=…), the QuantizedCache
    subjects and the offloaded caches (``quantized_subjects``, ``offloaded_subjects``)."""
    notes = static_crop_note()
    return [
        CacheSpec("ReferenceCache", _reference),
        CacheSpec("DynamicCache", _dynamic),
        # StaticCache inherits Cache.batch_repeat_interleave / batch_select_indices, so it claims them; its layers
        # lack them on transformers 5.24 (known_faults.toml), which the contract and batch families report. It
        # does not claim crop where its layers have none at all (before 5.24).
        CacheSpec("StaticCache", _static, capabilities=frozenset(CAPABILITIES) - set(notes), notes=notes),
        *quantized_subjects(),
        *offloaded_subjects(),
    ]


# ---------------------------------------------------------------------------------------------------- user specs
def _import_file(path: str):
    """Import ``path`` as a module, the way pytest imports a conftest.py (its "prepend" import mode): the file's
    folder goes first on ``sys.path``, so that the file can import its sibling modules (``from paged_layer import
    PagedLayer``)."""
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:
        sys.path.insert(0, folder)
    mod_name = "kvconform_user_" + os.path.splitext(os.path.basename(path))[0].replace("-", "_")
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    spec.loader.exec_module(module)
    return module


def _import_module(target: str):
    """``importlib.import_module(target)``; when its top-level package is not importable but sits in the current
    folder (``pytest`` does not put the folder it is started from on ``sys.path``), import it from there, as
    ``python -m`` would."""
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as exc:
        top = target.split(".")[0]
        here = os.getcwd()
        local = os.path.isfile(os.path.join(here, top + ".py")) or os.path.isdir(os.path.join(here, top))
        if exc.name != top or not local or here in sys.path:
            raise
        sys.path.insert(0, here)
        return importlib.import_module(target)


def declared_capabilities(obj, where: str) -> frozenset:
    """The ``kvconform_capabilities`` a Cache subclass or a factory function declares (default: all of
    ``CAPABILITIES``).

    Raises:
        SpecError: a name outside ``CAPABILITIES`` (with the closest known name), or not an iterable of names.
    """
    declared = getattr(obj, "kvconform_capabilities", None)
    if declared is None:
        return frozenset(CAPABILITIES)
    if isinstance(declared, str) or not all(isinstance(c, str) for c in declared):
        raise SpecError(f"{where}: kvconform_capabilities must be a set of names from {', '.join(CAPABILITIES)}; "
                        f"got {declared!r}")
    caps = frozenset(declared)
    _check_names(where, "capabilities", caps, CAPABILITIES)
    return caps


def validate_kind(kind, budget, where: str) -> None:
    """Check a subject's ``kind`` and ``budget`` (see ``KINDS`` and ``Budget``).

    Raises:
        SpecError: an unknown kind (closest known named), a lossy/evicting subject without a budget, an exact one
            with a budget, a budget that is not valid (``Budget.from_mapping``), ``tokens_max`` missing for an
            evicting subject or given for a lossy one.
    """
    if not isinstance(kind, str):
        raise SpecError(f"{where}: kind must be one of {', '.join(KINDS)}; got {kind!r}")
    _check_names(where, "kind", {kind}, KINDS)
    if kind == "exact":
        if budget is not None:
            raise SpecError(f"{where}: a budget is only for a lossy or evicting subject; declare kind='lossy' or "
                            f"kind='evicting', or drop the budget")
        return
    if budget is None:
        raise SpecError(f"{where}: a {kind} subject needs a budget, e.g. budget={{'kl_max': 0.05, 'top1_min': 0.8"
                        f"{', ' + repr('tokens_max') + ': 68' if kind == 'evicting' else ''}}} (mean KL(oracle ‖ "
                        f"subject) in nats, top-1 agreement{', most tokens held' if kind == 'evicting' else ''})")
    budget = Budget.from_mapping(budget, where)
    if kind == "evicting" and budget.tokens_max is None:
        raise SpecError(f"{where}: an evicting subject's budget needs tokens_max (the most tokens it holds per row "
                        f"and attention layer, e.g. sinks + window)")
    if kind in ("lossy", "press") and budget.tokens_max is not None:
        raise SpecError(f"{where}: tokens_max is for evicting subjects; a {kind} subject has no token bound "
                        f"(declare kind='evicting' if it never holds more than tokens_max tokens)")


def declared_kind(obj, where: str) -> tuple:
    """``(kind, budget)`` a Cache subclass or factory declares with ``kvconform_lossy = {budget}``,
    ``kvconform_evicting = {budget}`` or ``kvconform_press = {budget}`` (``Budget`` fields); ``("exact", None)`` when
    it declares none.

    Raises:
        SpecError: both attributes, or a budget that is not valid (see ``validate_kind``).
    """
    declared = {k: getattr(obj, f"kvconform_{k}", None) for k in ("lossy", "evicting", "press")}
    declared = {k: v for k, v in declared.items() if v is not None}
    if len(declared) > 1:
        raise SpecError(f"{where}: declares {' and '.join('kvconform_' + k for k in declared)}; a subject has one "
                        f"kind (an evicting cache that also quantizes declares kvconform_evicting; a press that "
                        f"also quantizes kvconform_press)")
    if not declared:
        return "exact", None
    [(kind, value)] = declared.items()
    validate_kind(kind, value, f"{where}: kvconform_{kind}")
    return kind, Budget.from_mapping(value, f"{where}: kvconform_{kind}")


def _declared(obj, where: str) -> dict:
    """The ``CacheSpec`` keyword arguments a Cache subclass or factory declares in ``kvconform_*`` attributes."""
    kind, budget = declared_kind(obj, where)
    return dict(capabilities=declared_capabilities(obj, where), kind=kind, budget=budget,
                page_size=declared_page_size(obj, where), allocation=declared_allocation(obj, where))


ALLOCATIONS = ("preallocated", "doubling")
"""Allocation policies a subject may declare besides token by token and pages (``CacheSpec.allocation``):
``preallocated`` — each bounded layer (``get_max_length() > 0``: a sliding window, a capacity) holds its whole
capacity from the first token on (a ring of ``sliding_window`` slots, a fixed buffer); ``doubling`` — amortised
doubling buffers, holding at most twice the tokens fed (and shrunk again by ``crop`` / ``reset``)."""


def declared_allocation(obj, where: str) -> str | None:
    """The ``kvconform_allocation`` a Cache subclass or factory declares (one of ``ALLOCATIONS``), or None.

    Raises:
        SpecError: a value not in ``ALLOCATIONS`` (closest named).
    """
    declared = getattr(obj, "kvconform_allocation", None)
    if declared is None:
        return None
    if not isinstance(declared, str):
        raise SpecError(f"{where}: kvconform_allocation must be one of {', '.join(ALLOCATIONS)}; got {declared!r}")
    _check_names(where, "kvconform_allocation", {declared}, ALLOCATIONS)
    return declared


def declared_page_size(obj, where: str) -> int | None:
    """The ``kvconform_page_size`` a Cache subclass or a factory function declares: its allocation granularity in
    tokens (a paged cache allocating K/V in pages of N tokens), or None when it declares none.

    Raises:
        SpecError: a value that is not a positive int (``bool`` is refused too), naming the attribute and the fix.
    """
    declared = getattr(obj, "kvconform_page_size", None)
    if declared is None:
        return None
    if isinstance(declared, bool) or not isinstance(declared, int) or declared < 1:
        raise SpecError(f"{where}: kvconform_page_size must be a positive int (tokens per page), got {declared!r}; "
                        f"e.g. kvconform_page_size = 16")
    return declared


def _check_names(where: str, what: str, names, known) -> None:
    import difflib

    unknown = sorted(set(names) - set(known))
    if unknown:
        hints = [f"{u!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(u, known, 1)) else repr(u)
                 for u in unknown]
        raise SpecError(f"{where}: unknown {what} {', '.join(hints)}; known: {', '.join(sorted(known))}")


NAME_PATTERN = r"[A-Za-z0-9_.]+"


def validate_spec(spec: "CacheSpec", where: str, known_checks=(), known_cases=()) -> None:
    """Check what a ``CacheSpec`` declares, whichever way it came in (``--kvconform-cache``, the
    ``pytest_kvconform_caches`` hook, ``check_cache``, ``parametrize_with_checks``).

    Args:
        where: how the user handed it over, for the message (e.g. ``"pytest_kvconform_caches"``).
        known_checks / known_cases: names that ``expected_failures`` keys (``check`` or ``check:case``) may use.

    Raises:
        SpecError: a name that is not ``[A-Za-z0-9_.]+`` (it would break ``-k`` selection and ids), unknown
            capabilities, ``expected_failures`` naming an unknown check or case (with the closest known name), or
            a ``page_size`` that is not a positive int.
    """
    import re

    if not isinstance(spec.name, str) or not re.fullmatch(NAME_PATTERN, spec.name):
        fixed = re.sub(r"[^A-Za-z0-9_.]+", "_", str(spec.name)).strip("_") or "MyCache"
        raise SpecError(f"{where}: the name {spec.name!r} may use only letters, digits, '_' and '.' (it is "
                        f"part of every item id and -k expression); e.g. name={fixed!r}")
    _check_names(where, "capabilities", spec.capabilities, CAPABILITIES)
    validate_kind(spec.kind, spec.budget, f"{where}: {spec.name}")
    page = spec.page_size
    if page is not None and (isinstance(page, bool) or not isinstance(page, int) or page < 1):
        raise SpecError(f"{where}: {spec.name}: page_size must be a positive int (tokens per page) or None, got "
                        f"{page!r}")
    if spec.allocation is not None:
        _check_names(f"{where}: {spec.name}", "allocation", {spec.allocation}, ALLOCATIONS)
    if known_checks:
        keys = list(spec.expected_failures)
        _check_names(f"{where}: expected_failures", "checks",
                     {k.split(":", 1)[0] for k in keys}, known_checks)
        if known_cases:
            _check_names(f"{where}: expected_failures", "cases",
                         {k.split(":", 1)[1] for k in keys if ":" in k}, known_cases)


def resolve_cache_spec(spec: str) -> CacheSpec:
    """``"pkg.mod:Attr"`` or ``"path/file.py:Attr"`` → ``CacheSpec``.

    ``Attr`` may also be a ``CacheSpec`` instance (returned as is). Capabilities of a class may be declared in a
    ``kvconform_capabilities`` attribute (iterable of names); default: all. Its allocation granularity may be
    declared in a ``kvconform_page_size`` attribute (tokens per page, ``declared_page_size``); default: none.

    Raises:
        SpecError: malformed spec, module/file that does not import (with the exception), missing attribute,
            or an attribute that is neither a Cache subclass, a CacheSpec nor a callable.
    """
    if not isinstance(spec, str) or spec.count(":") < 1:
        raise SpecError(f"{spec!r}: expected 'module:attr' or 'path/to/file.py:attr'")
    target, attr = spec.rsplit(":", 1)
    if not target or not attr.isidentifier():
        raise SpecError(f"{spec!r}: expected 'module:attr' or 'path/to/file.py:attr' (attr must be an identifier)")
    try:
        if target.endswith(".py") or os.sep in target:
            if not os.path.isfile(target):
                raise SpecError(f"{spec!r}: file {target!r} does not exist")
            module = _import_file(target)
        else:
            module = _import_module(target)
    except SpecError:
        raise
    except BaseException as exc:  # noqa: BLE001 - any import failure is the user's spec problem
        hint = ""
        if isinstance(exc, ModuleNotFoundError):
            hint = ("; give the file instead ('path/to/file.py:Attr' — its folder is put on sys.path, so it can "
                    "import its sibling modules) or make the module importable (pip install -e your package, "
                    "or PYTHONPATH)")
        raise SpecError(f"{spec!r}: importing {target!r} failed: {type(exc).__name__}: {exc}{hint}") from None
    if not hasattr(module, attr):
        raise SpecError(f"{spec!r}: module {target!r} has no attribute {attr!r}")
    obj = getattr(module, attr)
    if isinstance(obj, CacheSpec):
        return obj
    from transformers import Cache

    if inspect.isclass(obj):
        if not issubclass(obj, Cache):
            raise SpecError(f"{spec!r}: {attr} is a class but not a transformers.Cache subclass")
        return CacheSpec(attr, obj, source=spec, **_declared(obj, repr(spec)))
    if callable(obj):
        return CacheSpec(attr, obj, source=spec, **_declared(obj, repr(spec)))
    raise SpecError(f"{spec!r}: {attr} is {with_article(type(obj).__name__)}, not a Cache subclass or a factory")


def check_factory_builds_cache(spec: CacheSpec, config) -> None:
    """Build ``spec`` once for ``config`` (``CacheSpec.plan_build``: a factory naming ``model`` gets a weightless
    meta-device model) and make sure the result is a ``transformers.Cache`` or a ``(Cache, context manager)`` pair
    (``unpack_factory_result``). A factory that cannot be built this way (it computes with the model's weights) has
    its result checked when its items build it (a wrong one fails them).

    Raises:
        SpecError: the factory requires an argument kvconform never passes (``required_unknown_arguments``), or
            returned something else.
    (An exception raised by the factory itself is left to the items: it fails them, not the session.)
    """
    missing = required_unknown_arguments(spec.factory)
    if missing:
        raise SpecError(
            f"{spec.source if spec.source != 'python' else spec.name!r}: {spec.name} requires "
            f"{', '.join(repr(m) for m in missing)}, which kvconform cannot pass (it passes only those of "
            f"{', '.join(CONSTRUCTION_KWARGS)} that the signature accepts); hand kvconform a factory instead, e.g. "
            f"def make_{spec.name.lower()}(config): return {spec.name}(config=config, {missing[0]}=...)")
    try:
        spec.plan_build(config)
    except SubjectBuildError as exc:
        if isinstance(exc.cause, FactoryResultError):
            raise SpecError(f"{spec.source!r}: {exc.cause}") from None
    except Exception:  # noqa: BLE001 - reported per item
        return


def as_cache_spec(obj, source: str = "python") -> CacheSpec:
    """Turn what a user hands over into a ``CacheSpec``: a ``CacheSpec`` (as is), a ``"module:attr"`` string, a
    ``transformers.Cache`` subclass or a factory (named after ``__name__``).

    Raises:
        SpecError: anything else, or a string that does not resolve (see ``resolve_cache_spec``).
    """
    if isinstance(obj, CacheSpec):
        return obj
    if isinstance(obj, str):
        return resolve_cache_spec(obj)
    from transformers import Cache

    name = getattr(obj, "__name__", None)
    if inspect.isclass(obj) and not issubclass(obj, Cache):
        raise SpecError(f"{name}: a class but not a transformers.Cache subclass")
    if not callable(obj) or not name or not name.isidentifier():
        raise SpecError(f"{obj!r}: not a CacheSpec, a 'module:attr' string, a Cache subclass or a named factory")
    return CacheSpec(name, obj, source=source, **_declared(obj, name))
