"""Model-aware call contexts: the context manager of a ``(cache, context)`` factory result, attached to the
cache (``call_context``) and entered around each call on the model (``CallContext.around``), with the check that the
model is left as it was (``ModelLeftChanged``). See ``kvconform.subjects``, "Model-aware subjects"."""

from __future__ import annotations

from kvconform.memo import MEMO
from kvconform.outcomes import KVConformError
from kvconform.subjects.construction import FactoryResultError

CALL_CONTEXT_ATTR = "_kvconform_call_context"
"""Attribute of a built cache holding the per-call context of a ``(cache, context)`` factory (see ``call_context``)."""


class ModelLeftChanged(RuntimeError, KVConformError):
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


_METHODS: dict = MEMO.table("subjects.methods")


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
