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

Modules by job: ``spec`` (the data model: ``CacheSpec``, ``Budget``), ``construction`` (the construction contract),
``context`` (model-aware call contexts), ``builtin`` (the built-in catalogue and its budgets), ``resolve`` (spec
resolution), ``declare`` (declaration validation), ``kinds`` (what a subject's kind means to the checks). Every
public name is importable from ``kvconform.subjects``.
"""

from __future__ import annotations

from kvconform.subjects.kinds import (ALL_KINDS, DEFAULT_JUDGES, EVICTING, EXACT, FRESH, KIND_NAMES, LOSSY_FRESH,
                                      LOSSY_KINDS, LOSSY_TWIN, ORACLE, PRESS, TWIN, Kind, kind_of)
from kvconform.subjects.construction import (CONSTRUCTION_KWARGS, MODEL_KWARG, FactoryResultError, SubjectBuildError,
                                             accepted_kwargs, accepted_names, meta_model, names_model,
                                             required_unknown_arguments, unpack_factory_result)
from kvconform.subjects.context import CALL_CONTEXT_ATTR, CallContext, ModelLeftChanged, call_context
from kvconform.subjects.spec import (ALLOCATIONS, BUDGET_KEYS, CAPABILITIES, KINDS, SUPPORT_LAYER_TYPES,
                                     REFUSALS, SUPPORT_MODEL_KINDS, SUPPORTS, Budget, CacheSpec, SpecError, unsupported)
from kvconform.subjects.builtin import (OFFLOAD_REASON, QUANTIZED_BUDGETS, _dynamic, _reference, _static,
                                        builtin_subjects, full_attention_only, offloaded_subjects, quantized_subjects,
                                        static_crop_note)
from kvconform.subjects.declare import (NAME_PATTERN, check_supports, declared_allocation, declared_capabilities,
                                        declared_kind, declared_page_size, declared_supports, validate_kind,
                                        validate_spec)
from kvconform.subjects.resolve import as_cache_spec, check_factory_builds_cache, resolve_cache_spec

__all__ = [
    "ALL_KINDS", "DEFAULT_JUDGES", "EVICTING", "EXACT", "FRESH", "KIND_NAMES", "LOSSY_FRESH", "LOSSY_KINDS",
    "LOSSY_TWIN", "ORACLE",
    "PRESS", "TWIN", "Kind", "kind_of",
    "CONSTRUCTION_KWARGS", "MODEL_KWARG", "FactoryResultError", "SubjectBuildError", "accepted_kwargs",
    "accepted_names", "meta_model", "names_model", "required_unknown_arguments", "unpack_factory_result",
    "CALL_CONTEXT_ATTR", "CallContext", "ModelLeftChanged", "call_context",
    "ALLOCATIONS", "BUDGET_KEYS", "CAPABILITIES", "KINDS", "REFUSALS", "SUPPORT_LAYER_TYPES", "SUPPORT_MODEL_KINDS",
    "SUPPORTS",
    "Budget", "CacheSpec", "SpecError", "unsupported",
    "OFFLOAD_REASON", "QUANTIZED_BUDGETS", "builtin_subjects", "full_attention_only", "offloaded_subjects",
    "quantized_subjects", "static_crop_note",
    "NAME_PATTERN", "check_supports", "declared_allocation", "declared_capabilities", "declared_kind",
    "declared_page_size", "declared_supports", "validate_kind", "validate_spec",
    "as_cache_spec", "check_factory_builds_cache", "resolve_cache_spec",
]
