"""Declaration validation: what a Cache subclass or factory declares in ``kvconform_*`` attributes
(``declared_capabilities``, ``declared_kind``, ``declared_page_size``) and the one check of a ``CacheSpec``, whichever
way it came in (``validate_spec``: name, capabilities, kind and budget — validated here, once —, page size,
expected failures)."""

from __future__ import annotations

from collections.abc import Mapping

from kvconform.subjects.kinds import declaration_of, declared_kinds
from kvconform.subjects.spec import (ALLOCATIONS, CAPABILITIES, REFUSALS, SUPPORTS, Budget, CacheSpec, SpecError,
                                     _check_names)


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
    """Check a subject's ``kind`` and ``budget`` by the facts of the declared kind's class
    (``kinds.declaration_of``: ``needs_budget``, ``token_bound``, ``budget_keys``, ``compresses``).

    Raises:
        SpecError: an unknown kind (closest known named), a lossy/evicting subject without a budget, an exact one
            with a budget, a budget that is not valid (``Budget.from_mapping``), ``tokens_max`` missing for an
            evicting subject or given for a lossy one.
    """
    known = declared_kinds()
    if not isinstance(kind, str):
        raise SpecError(f"{where}: kind must be one of {', '.join(known)}; got {kind!r}")
    _check_names(where, "kind", {kind}, known)
    declared = declaration_of(kind)
    bound = declared.token_bound
    if not declared.needs_budget:
        if budget is not None:
            raise SpecError(f"{where}: a budget is only for a lossy or evicting subject; declare kind='lossy' or "
                            f"kind='evicting', or drop the budget")
        return
    if budget is None:
        raise SpecError(f"{where}: a {kind} subject needs a budget, e.g. budget={{'kl_max': 0.05, 'top1_min': 0.8"
                        f"{', ' + repr('tokens_max') + ': 68' if bound else ''}}} (mean KL(oracle ‖ "
                        f"subject) in nats, top-1 agreement{', most tokens held' if bound else ''})")
    budget = Budget.from_mapping(budget, where, declared.budget_keys)
    if bound and budget.tokens_max is None and budget.keep_ratio is None:
        raise SpecError(f"{where}: an evicting subject's budget needs tokens_max (the most tokens it holds per row "
                        f"and attention layer, e.g. sinks + window) or keep_ratio (the share of the tokens past "
                        f"tokens_exact it keeps, for a cache that evicts a share at every step)")
    if bound and budget.tokens_exact is not None and budget.keep_ratio is None:
        raise SpecError(f"{where}: tokens_exact goes with keep_ratio (a cache evicting a share of its tokens); a "
                        f"cache with a fixed bound is exact up to tokens_max")
    if bound and not budget.saves_memory:
        raise SpecError(f"{where}: saves_memory is for lossy and press subjects; an evicting subject's memory is "
                        f"bounded by its token bound")
    extra = [k for k in ("tokens_max", "keep_ratio", "tokens_exact") if getattr(budget, k) is not None]
    if not bound and extra:
        raise SpecError(f"{where}: {', '.join(extra)} {'is' if len(extra) == 1 else 'are'} for evicting subjects; a "
                        f"{kind} subject has no token bound (declare kind='evicting' if it evicts tokens)")
    if declared.compresses and not budget.saves_memory and budget.bytes_ratio_max is not None:
        raise SpecError(f"{where}: saves_memory=False promises no memory saving, so bytes_ratio_max has nothing to "
                        f"bound; drop one of them")


def declared_kind(obj, where: str) -> tuple:
    """``(kind, budget)`` a Cache subclass or factory declares with ``kvconform_lossy = {budget}`` or
    ``kvconform_evicting = {budget}`` (``Budget`` fields, as given: ``CacheSpec`` turns a valid dict into a
    ``Budget``, ``validate_spec`` checks it — once, for every way a subject comes in); ``("exact", None)`` when it
    declares neither.

    Raises:
        SpecError: more than one ``kvconform_<kind>`` attribute.
    """
    declared = [(kind, value) for kind in declared_kinds() if declaration_of(kind).needs_budget
                if (value := getattr(obj, f"kvconform_{kind}", None)) is not None]
    if len(declared) > 1:
        raise SpecError(f"{where}: declares both {' and '.join(f'kvconform_{k}' for k, _ in declared)}; a subject "
                        f"has one kind (an evicting cache that also quantizes declares kvconform_evicting; a press "
                        f"that also quantizes kvconform_press)")
    return declared[0] if declared else ("exact", None)


DECLARATIONS = ("kvconform_capabilities", "kvconform_page_size", "kvconform_allocation", "kvconform_supports",
                "kvconform_refuses", "kvconform_held", "kvconform_poison")
"""The ``kvconform_*`` attributes kvconform reads on a Cache subclass or factory (and on the instances it builds:
``kvconform_held``, ``kvconform_poison``), besides one ``kvconform_<kind>`` per kind that takes a budget
(``declared_kinds``)."""


def check_declaration_names(obj, where: str) -> None:
    """Refuse a ``kvconform_*`` attribute kvconform does not read (``kvconform_lossey``, ``kvconform_budget``):
    ignored, it would leave the subject judged as something it did not declare.

    Raises:
        SpecError: naming each unknown attribute, the closest known one, and the known ones.
    """
    try:
        names = {n for n in dir(obj) if n.startswith("kvconform_")}
    except Exception:  # noqa: BLE001 - an object whose dir() raises: nothing to read
        return
    kinds = [f"kvconform_{k}" for k in declared_kinds() if declaration_of(k).needs_budget]
    known = (*DECLARATIONS, *kinds)
    unknown = sorted(names - set(known))
    if any("budget" in n for n in unknown):
        raise SpecError(f"{where}: unknown declaration {', '.join(map(repr, unknown))}; a budget is the value of the "
                        f"kind's declaration: {' or '.join(kinds)} = {{'kl_max': 0.05, 'top1_min': 0.8, ...}}")
    _check_names(where, "declaration", unknown, known)


def _declared(obj, where: str) -> dict:
    """The ``CacheSpec`` keyword arguments a Cache subclass or factory declares in ``kvconform_*`` attributes.

    Raises:
        SpecError: a declaration that is not valid, or a ``kvconform_*`` attribute kvconform does not read.
    """
    check_declaration_names(obj, where)
    kind, budget = declared_kind(obj, where)
    return dict(capabilities=declared_capabilities(obj, where), kind=kind, budget=budget,
                page_size=declared_page_size(obj, where), allocation=declared_allocation(obj, where),
                supports=declared_supports(obj, where), refuses=declared_refuses(obj, where))


def declared_refuses(obj, where: str) -> dict:
    """The ``kvconform_refuses`` a Cache subclass or factory declares: ``{refusal: why}`` with names of
    ``REFUSALS`` (what it refuses by design where kvconform's reference does not), ``{}`` when it declares none.

    Raises:
        SpecError: not a dict of names to non-empty reasons, or a name outside ``REFUSALS`` (closest named).
    """
    declared = getattr(obj, "kvconform_refuses", None)
    if declared is None:
        return {}
    return check_refuses(declared, f"{where}: kvconform_refuses")


def check_refuses(declared, where: str) -> dict:
    """``declared`` as ``{refusal: why}``.

    Raises:
        SpecError: not a dict, a reason that is not a non-empty string, or a name outside ``REFUSALS``.
    """
    example = '{"reset_batch": "buffers are sized for one batch at construction"}'
    if not isinstance(declared, Mapping) or not all(isinstance(v, str) and v.strip() for v in declared.values()):
        raise SpecError(f"{where} must be a dict of refusal names ({', '.join(REFUSALS)}) to the reason; got "
                        f"{declared!r} (e.g. {example})")
    _check_names(where, "refusals", set(declared), REFUSALS)
    return dict(declared)


def declared_supports(obj, where: str) -> frozenset | None:
    """The ``kvconform_supports`` a Cache subclass or factory declares (names of ``SUPPORTS``: the layer types and
    model kinds it supports), or None (every model).

    Raises:
        SpecError: not a non-empty collection of names, or a name outside ``SUPPORTS`` (closest named).
    """
    declared = getattr(obj, "kvconform_supports", None)
    if declared is None:
        return None
    return check_supports(declared, f"{where}: kvconform_supports")


def check_supports(declared, where: str) -> frozenset:
    """``declared`` as a frozenset of ``SUPPORTS`` names.

    Raises:
        SpecError: a bare string, an empty or non-iterable value, a non-string item, or an unknown name (closest
            named; the known names listed).
    """
    example = '{"full_attention", "sliding_attention"}'
    try:
        names = frozenset(declared) if not isinstance(declared, str) else None
    except TypeError:
        names = None
    if not names or not all(isinstance(n, str) for n in names):
        raise SpecError(f"{where} must be a non-empty set of layer types and model kinds from {', '.join(SUPPORTS)}; "
                        f"got {declared!r} (e.g. {example})")
    _check_names(where, "layer types / model kinds", names, SUPPORTS)
    return names


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
    attr = f"kvconform_{spec.kind}"
    declared = isinstance(spec.kind, str) and getattr(spec.factory, attr, None) is not None
    validate_kind(spec.kind, spec.budget, f"{where}: {spec.name}" + (f" ({attr})" if declared else ""))
    page = spec.page_size
    if page is not None and (isinstance(page, bool) or not isinstance(page, int) or page < 1):
        raise SpecError(f"{where}: {spec.name}: page_size must be a positive int (tokens per page) or None, got "
                        f"{page!r}")
    if spec.allocation is not None:
        _check_names(f"{where}: {spec.name}", "allocation", {spec.allocation}, ALLOCATIONS)
    if spec.supports is not None:
        check_supports(spec.supports, f"{where}: {spec.name}: supports")
    if spec.refuses:
        check_refuses(spec.refuses, f"{where}: {spec.name}: refuses")
    if known_checks:
        keys = list(spec.expected_failures)
        _check_names(f"{where}: expected_failures", "checks",
                     {k.split(":", 1)[0] for k in keys}, known_checks)
        if known_cases:
            _check_names(f"{where}: expected_failures", "cases",
                         {k.split(":", 1)[1] for k in keys if ":" in k}, known_cases)
