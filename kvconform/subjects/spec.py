"""The data model of a subject: ``CacheSpec`` (a factory plus what it declares), ``Budget`` (what a lossy or
evicting subject promises), the vocabularies ``CAPABILITIES`` and ``KINDS``, and ``SpecError``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

from kvconform.outcomes import UsageError
from kvconform.subjects.kinds import DECLARED_KINDS

from kvconform.subjects.construction import (MODEL_KWARG, FactoryResultError, SubjectBuildError, accepted_kwargs,
                                             meta_model, names_model, unpack_factory_result)
from kvconform.subjects.context import CallContext, _attach, call_context

CAPABILITIES = ("forward", "generate", "crop", "deepcopy", "reorder", "batch_repeat", "batch_select", "reset",
                "compile")
"""Capability vocabulary: what a subject declares it supports; a check needing an undeclared one is skipped."""

REFUSALS = ("reset_batch",)
"""What a subject may declare it refuses (``CacheSpec.refuses``), where kvconform's reference does it:
``reset_batch`` — reuse after ``reset()`` with a batch of another size (its first forward raises a clear error
naming the batch)."""

SUPPORT_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "indexed_attention",
                       "linear_attention", "conv", "hybrid", "hybrid_sliding")
"""The decoder layer types a subject may scope itself to (``CacheSpec.supports``): transformers' cache layer types
(``get_layer_types_and_kwargs``), as every model's decoder layers are named."""

SUPPORT_MODEL_KINDS = ("decoder_only", "encoder_decoder")
"""The model kinds a subject may scope itself to (``CacheSpec.supports``)."""

SUPPORT_POSITIONS = ("rotary_positions", "learned_positions", "alibi_positions", "relative_positions", "no_positions")
"""How the models a subject serves encode positions (``CacheSpec.supports``; ``architectures.position_kind``): a
cache for rotary models only declares ``{"rotary_positions"}``."""

SUPPORTS = SUPPORT_LAYER_TYPES + SUPPORT_MODEL_KINDS + SUPPORT_POSITIONS
"""Every name ``CacheSpec.supports`` / ``kvconform_supports`` may hold: layer types (``sliding_attention``,
``linear_attention``...), model kinds (``encoder_decoder``...) and position encodings (``rotary_positions``...);
each group declared narrows the models served, a group not declared does not."""

ALLOCATIONS = ("preallocated", "doubling")
"""Allocation policies a subject may declare besides token by token and pages (``CacheSpec.allocation``):
``preallocated`` — each bounded layer (``get_max_length() > 0``: a sliding window, a capacity) holds its whole
capacity from the first token on (a ring of ``sliding_window`` slots, a fixed buffer); ``doubling`` — amortised
doubling buffers, holding at most twice the tokens fed (and shrunk again by ``crop`` / ``reset``)."""

KINDS = DECLARED_KINDS
"""What a subject promises (``CacheSpec.kind``; ``kinds.DECLARED_KINDS``) about the logits it gives:

* ``exact``: the logits of the uncached model, within float noise (the default);
* ``lossy``: it compresses what it holds (quantization, low rank, ...): judged by quality against the float64 oracle
  within its ``Budget``, by self-consistency (every cache operation gives what a fresh instance of the same class
  fed the equivalent history gives), and by holding fewer bytes than an exact cache;
* ``evicting``: it drops tokens past a bound (attention sinks + window): exact until it holds ``Budget.tokens_max``
  tokens, then judged by quality and by its memory bound;
* ``press``: it compresses the prefill by keeping a subset of its tokens exactly, at any length, with no token bound
  (KV presses: StreamingLLM, Knorm, SnapKV, ExpectedAttention ratios): judged like ``lossy`` (self-consistency,
  quality, real compression) plus the press contract (``checks/contract/press.py``).
"""


@dataclass(frozen=True)
class Budget:
    """What a lossy or evicting subject promises, in place of exactness.

    Attributes:
        kl_max: mean KL(oracle ‖ subject) in nats per position, over every position that read the cache in the
            long-context quality cases (next-token distributions of the float64 oracle vs the subject's).
        top1_min: fraction of those positions whose top-1 token equals the oracle's, in [0, 1].
        bytes_ratio_max: lossy, evicting and press, optional: the subject's held bytes after the long context
            divided by an exact cache's (``ReferenceCache``, same model, dtype and ops) must be ≤ this; without it the
            ratio must be < 1 (compression must be real).
        tokens_max: evicting only: the most tokens the cache holds per row and attention layer (e.g. sinks +
            window); the held bytes are bounded by this many tokens' keys and values. Required unless
            ``keep_ratio`` is given (then optional: a cap on top of the share).
        keep_ratio: evicting only, in (0, 1]: a cache that evicts a *share* of its tokens at every step (H2O /
            adaptive budgets: ``keep_ratio`` of the tokens past ``tokens_exact``) holds, per row and attention layer,
            at most ``tokens_exact + ceil(keep_ratio · (seen − tokens_exact))`` tokens after ``seen`` tokens (every
            token while ``seen ≤ tokens_exact``), and at most ``tokens_max`` where that is given too.
        tokens_exact: evicting with ``keep_ratio`` only, default 0: the tokens seen before the cache evicts anything
            (its exactness promise: judged against the oracle on every case that never makes it see more).
        saves_memory: lossy and press, default True: whether the cache promises to hold fewer bytes than an exact
            cache. False for a cache that rounds keys/values through a codec and stores the decoded floats (a
            quality trade-off with no memory promise): its quality and self-consistency are judged, its held bytes
            are not (``check_compression_real`` skips, saying so).

    Declared as ``CacheSpec(..., kind="lossy", budget=Budget(...))`` (or a dict with these keys), or on a Cache
    subclass / factory as ``kvconform_lossy = {"kl_max": ..., "top1_min": ...}`` / ``kvconform_evicting = {...}``.
    """

    kl_max: float
    top1_min: float
    bytes_ratio_max: float | None = None
    tokens_max: int | None = None
    keep_ratio: float | None = None
    tokens_exact: int | None = None
    saves_memory: bool = True

    def held_bound(self, seen: int) -> int | None:
        """The most tokens per row and attention layer an evicting cache declaring this budget may hold after
        ``seen`` tokens (see ``tokens_max``, ``keep_ratio``), or None without a token bound."""
        import math

        if self.keep_ratio is None:
            return self.tokens_max
        exact = int(self.tokens_exact or 0)
        bound = seen if seen <= exact else exact + math.ceil(float(self.keep_ratio) * (seen - exact) - 1e-9)
        return bound if self.tokens_max is None else min(bound, int(self.tokens_max))

    @property
    def exact_limit(self) -> int | None:
        """The most tokens an evicting cache declaring this budget may be fed while still exact (it evicts
        nothing before): ``tokens_exact`` for a share (``keep_ratio``), else ``tokens_max``."""
        return int(self.tokens_exact or 0) if self.keep_ratio is not None else self.tokens_max

    def describe_bound(self) -> str:
        """``"tokens_max = 64"`` / ``"16 + ceil(0.5 · (seen − 16)) (keep_ratio 0.5 past tokens_exact 16), at
        most 32 (tokens_max)"`` for messages."""
        if self.keep_ratio is None:
            return f"tokens_max = {self.tokens_max}"
        exact = int(self.tokens_exact or 0)
        text = (f"{exact} + ceil({self.keep_ratio:g} · (seen − {exact})) (keep_ratio {self.keep_ratio:g} past "
                f"tokens_exact {exact})")
        return text + (f", at most {self.tokens_max} (tokens_max)" if self.tokens_max is not None else "")

    @classmethod
    def from_mapping(cls, value, where: str, keys: tuple | None = None) -> "Budget":
        """A ``Budget`` from a ``Budget`` or a dict of its fields. ``keys``: the keys the subject's declared kind
        takes (``Kind.budget_keys``; None: every key) only narrows the keys a message lists (``tokens_max`` belongs
        to a kind with a token bound).

        Raises:
            SpecError: not a dict/Budget, unknown keys (with the closest known), missing ``kl_max``/``top1_min``, or
                a value of the wrong type or range.
        """
        import dataclasses

        if isinstance(value, Budget):
            value = dataclasses.asdict(value)
        listed = [k for k in BUDGET_KEYS if keys is None or k in keys]
        if not isinstance(value, Mapping):
            bound = keys is not None and "tokens_max" in keys
            example = "{'kl_max': 0.05, 'top1_min': 0.8" + (", 'tokens_max': 68" if bound else "") + "}"
            only = " (tokens_max: evicting subjects only)" if keys is None else ""
            raise SpecError(f"{where}: the budget must be a dict with keys {', '.join(listed)}{only}, e.g. {example}; "
                            f"got {value!r}")
        _check_names(where, "budget keys", set(value), BUDGET_KEYS, listed=listed)
        missing = [k for k in ("kl_max", "top1_min") if k not in value]
        if missing:
            raise SpecError(f"{where}: the budget needs {' and '.join(missing)} (e.g. {{'kl_max': 0.05, "
                            f"'top1_min': 0.8}}: mean KL(oracle ‖ subject) in nats and top-1 agreement)")
        ranges = {"kl_max": (float, 0, None), "top1_min": (float, 0, 1), "bytes_ratio_max": (float, 0, None),
                  "tokens_max": (int, 1, None), "keep_ratio": (float, 0, 1), "tokens_exact": (int, 0, None)}
        for key, v in value.items():
            if key == "saves_memory":
                if not isinstance(v, bool):
                    raise SpecError(f"{where}: budget saves_memory must be True or False; got {v!r}")
                continue
            kind, lo, hi = ranges[key]
            if v is None and key in ("bytes_ratio_max", "tokens_max", "keep_ratio", "tokens_exact"):
                continue
            if key == "keep_ratio" and not isinstance(v, bool) and isinstance(v, (int, float)) and v <= 0:
                raise SpecError(f"{where}: budget keep_ratio must be a number in (0, 1]; got {v!r}")
            ok = not isinstance(v, bool) and (isinstance(v, int) if kind is int else isinstance(v, (int, float)))
            if not ok or v < lo or (hi is not None and v > hi):
                want = "an int" if kind is int else "a number"
                bounds = f" in [{lo}, {hi}]" if hi is not None else f" ≥ {lo}"
                raise SpecError(f"{where}: budget {key} must be {want}{bounds}; got {v!r}")
        return cls(**{k: value[k] for k in value})


BUDGET_KEYS = ("kl_max", "top1_min", "bytes_ratio_max", "tokens_max", "keep_ratio", "tokens_exact", "saves_memory")
EVICTING_KEYS = ("tokens_max", "keep_ratio", "tokens_exact")
"""The budget keys of evicting subjects only."""


class SpecError(ValueError, UsageError):
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
        cuda_requires: ``{"tool": why}`` — programs a run on CUDA needs (``compat.missing_tool``; e.g. optimum-quanto
            builds its CUDA kernels with ``nvcc`` on first use): on CUDA, items skip with "requires TOOL on CUDA
            (why)" where one is missing; no effect elsewhere.
        same_as: name of the subject whose logits this one must equal exactly (offloaded → non-offloaded).
        notes: ``{capability: why it is not declared}`` — appended to the skip reason of items needing it (e.g. a
            method the installed transformers does not implement for this cache).
        kind: one of ``KINDS`` (``"exact"``, ``"lossy"``, ``"evicting"``, ``"press"``).
        budget: a ``Budget`` (or a dict of its fields), required for a lossy or evicting subject, None for an exact
            one.
        page_size: the cache's allocation granularity in tokens (a paged / block cache that allocates K/V in pages
            of ``page_size`` tokens), or None (undeclared: the memory family infers it from the steps in which the
            held bytes grow). The memory budget of an exact, non-preallocated layer then allows at most one page per
            row of slack above the formula (``page_size · B · H_kv · (D_k + D_v) · b`` bytes per layer). A Cache
            subclass or factory declares it with a ``kvconform_page_size = N`` attribute (``declared_page_size``).
        supports: the layer types and model kinds the cache supports (names of ``SUPPORTS``: layer types of
            ``SUPPORT_LAYER_TYPES``, model kinds of ``SUPPORT_MODEL_KINDS``), or None (every model). A model with a
            decoder layer type outside the named layer types (when it names any), or of a model kind outside the
            named kinds (when it names any), has its items skipped with that reason (``unsupported``). Declared with
            ``kvconform_supports = {"full_attention", "sliding_attention"}``.
        allocation: how the cache allocates K/V when not token by token (``ALLOCATIONS``): ``"preallocated"`` (every
            bounded layer holds its capacity from the first token on: a fixed ring of a sliding layer's window, a
            capacity buffer), ``"doubling"`` (amortised doubling buffers: at most twice the tokens held), or None
            (undeclared: the memory family infers it from the held bytes). Declared with ``kvconform_allocation``.
        refuses: ``{refusal: why}`` (names of ``REFUSALS``): what the cache refuses, clearly, by design although
            kvconform's reference does it. Such a refusal passes its item (recorded in the metrics: ``refused_by``);
            an undeclared one passes only where the reference refuses the same case too. Declared with
            ``kvconform_refuses = {"reset_batch": "pages are sized for one batch at construction"}``.
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
    cuda_requires: Mapping[str, str] = field(default_factory=dict)
    same_as: str | None = None
    notes: Mapping[str, str] = field(default_factory=dict)
    page_size: int | None = None
    allocation: str | None = None
    supports: frozenset | None = None
    refuses: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self):
        budget = self.budget
        if isinstance(budget, Mapping) and set(budget) <= set(BUDGET_KEYS) and {"kl_max", "top1_min"} <= set(budget):
            # a dict is accepted for convenience: converted here, validated in validate_spec (once, with where it
            # came from); a dict that is not even shaped like a Budget is kept as given for validate_spec to report
            object.__setattr__(self, "budget", Budget(**budget))
        supports = self.supports
        if isinstance(supports, (set, list, tuple)) and all(isinstance(n, str) for n in supports):
            object.__setattr__(self, "supports", frozenset(supports))  # validated in validate_spec

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
        A factory that returns an ``EncoderDecoderCache`` itself (a user's own subclass of the wrapper, with its own
        halves) is used as it is, not wrapped again: it is built once, with ``max_cache_len`` (the decoder's
        length; its cross-attention half must hold the encoder's states: ``encoder_len`` tokens, the case's encoder
        input, or the number the model fixes, ``ZooModel.encoder_states``).
        """
        device = next(model.model.parameters()).device
        common = dict(config=model.config, batch_size=batch_size, device=device, dtype=model.dtype,
                      model=model.model)
        if not model.is_encoder_decoder:
            return self.build_one(max_cache_len=max_cache_len, **common)
        from transformers import EncoderDecoderCache

        self_attention = self.build_one(max_cache_len=max_cache_len, **common)
        if isinstance(self_attention, EncoderDecoderCache):
            return self_attention  # the subject is the wrapper: judged as it is (docs/own-cache.md)
        cross_attention = self.build_one(max_cache_len=max(model.encoder_states(encoder_len), 1), **common)
        wrapper = EncoderDecoderCache(self_attention, cross_attention)
        context = call_context(self_attention) or call_context(cross_attention)
        if context is not None:
            _attach(wrapper, context)
        return wrapper


def unsupported(subject, model) -> str | None:
    """Why ``subject`` (a ``CacheSpec``) does not serve ``model`` (a ``plan.ModelInfo`` or ``ZooModel``: its
    ``layer_types`` and ``is_encoder_decoder``) by its ``supports`` declaration, or None (supported, or nothing
    declared)."""
    supports = subject.supports
    if not supports:
        return None
    declared = ", ".join(sorted(supports))
    kinds = set(supports) & set(SUPPORT_MODEL_KINDS)
    kind = "encoder_decoder" if getattr(model, "is_encoder_decoder", False) else "decoder_only"
    if kinds and kind not in kinds:
        return (f"{subject.name} supports {declared} (kvconform_supports): {model.name} is {kind.replace('_', '-')}, "
                f"not judged")
    types = set(supports) & set(SUPPORT_LAYER_TYPES)
    other = sorted(set(getattr(model, "layer_types", ()) or ()) - types) if types else []
    if other:
        return (f"{subject.name} supports {declared} (kvconform_supports): {model.name} has "
                f"{', '.join(other)} layers, not judged")
    positions = set(supports) & set(SUPPORT_POSITIONS)
    encoding = model_positions(model) if positions else None
    if encoding and encoding not in positions:
        return (f"{subject.name} supports {declared} (kvconform_supports): {model.name} has "
                f"{encoding.replace('_', ' ')}, not judged")
    return None


def model_positions(model) -> str | None:
    """How ``model`` (a ``ZooModel`` or ``plan.ModelInfo``) encodes positions (``architectures.position_kind`` of
    its config), or None when that cannot be told (the model then counts as served)."""
    from kvconform.architectures import position_kind

    config = getattr(model, "config", None)
    if config is None and callable(getattr(model, "model_config", None)):
        try:
            config = model.model_config()  # its source reads it (plan.ModelInfo)
        except Exception:  # noqa: BLE001 - a spec without a config (a model adapter): not scoped out
            return None
    try:
        return position_kind(config)
    except Exception:  # noqa: BLE001
        return None


def closest_name(name, known) -> str | None:
    """The known name closest to a mistyped ``name`` (``difflib`` ratio ≥ 0.5, else a known name that starts with
    ``name``: ``"kl"`` → ``"kl_max"``), or None."""
    import difflib

    if not isinstance(name, str):
        return None
    known = [k for k in known if isinstance(k, str)]
    match = difflib.get_close_matches(name, known, 1, cutoff=0.5)
    if match:
        return match[0]
    return next((k for k in sorted(known) if name and k.startswith(name)), None)


def _check_names(where: str, what: str, names, known, listed=None) -> None:
    """Raise ``SpecError`` naming each of ``names`` not in ``known`` (with the closest known one); the message lists
    ``listed`` (default: ``known``) as the known names."""
    unknown = sorted(set(names) - set(known))
    if unknown:
        listed = known if listed is None else listed
        hints = [f"{u!r} (did you mean {m!r}?)" if (m := closest_name(u, listed)) else repr(u) for u in unknown]
        raise SpecError(f"{where}: unknown {what} {', '.join(hints)}; known: {', '.join(sorted(listed))}")
