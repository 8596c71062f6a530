"""The kinds of subject: what a subject promises about its logits, and so what a check compares it with, why an
item does not apply to it, and how messages describe it. The one place that reads a subject's declared ``kind``
and ``twin``; every other module asks the ``Kind`` object (``kind_of(subject)``, ``CheckContext.kind``).

Five kinds (``Kind.name``; a check names those it judges with ``@register(..., judges=...)``):

* ``exact`` (``Exact``): the logits of the uncached model within float noise; compared with the float64 oracle.
* ``lossy_twin`` (``LossyWithTwin``): a lossy (quantized) subject with a fake-quant ``twin``
  (``CacheSpec.twin``): the exact families compare it with the twin run on the same ops in float64, the quality
  family holds it to its budget against the oracle.
* ``lossy_fresh`` (``SelfConsistent``): a lossy subject without a twin (``kind="lossy"``, ``kvconform_lossy``):
  compared with a fresh instance of its own class fed the equivalent history (``checks/_consistency.py``).
* ``evicting`` (``Evicting``): drops tokens past ``Budget.tokens_max`` (or a share of them at every step past
  ``Budget.tokens_exact``: ``keep_ratio``): exact (against the oracle, or its twin when it has one) while it holds at
  most ``tokens_max`` tokens (has seen at most ``tokens_exact``); past that judged by the evicting contract, quality
  and its memory bound (``Budget.held_bound``).
* ``press`` (``Press``): compresses the prefill by keeping a subset of its tokens exactly, at any length, with no
  token bound (KV presses; ``kind="press"``, ``kvconform_press``): compared like ``lossy_fresh`` with a fresh
  instance fed the equivalent history, held to its quality budget and real compression, plus the press contract
  (``checks/contract/press.py``).

A check that does not name a kind in ``judges`` does not apply to its subjects, with the reason the check gives
for that kind (``@register(..., unjudged=...)``) or else the kind's own (``Kind.not_judged``); the default
(``DEFAULT_JUDGES``) is every kind but ``evicting``, which is then judged only on the cases that never make it hold
more than ``tokens_max`` tokens.

Each kind is a ``Kind`` subclass that owns its facts as class attributes (``name``, ``target``, ``declares``,
``precedence``, ``judged_by_default``, and what it promises: ``lossy``, ``needs_budget``, ``token_bound``,
``budget_keys``, ``compresses``, ``quantizes``, ``evicts``, ``presses``) and registers itself when it is defined
(``__init_subclass__``, as transformers' cache layers do): ``KINDS``, ``KIND_NAMES``, ``declared_kinds()``,
``DEFAULT_JUDGES``, ``ALL_KINDS``, ``LOSSY_KINDS`` and ``kind_of`` are derived from the registered classes when they
are asked, so a kind defined later is in them. The base class reads the facts (``Kind.budgeted`` asks the class the
subject declares, ``declaration_of``); no module compares kind names. Checks select kinds by these facts
(``@register(..., judges=LOSSY_KINDS)``, ``facts={"compresses": ...}``), so adding a kind is one subclass here: the
declaration's budget rules (``declare.validate_kind``) and every check that selects by a fact follow its attributes.
"""

from __future__ import annotations

from typing import Callable

EXACT, LOSSY_TWIN, LOSSY_FRESH, EVICTING, PRESS = "exact", "lossy_twin", "lossy_fresh", "evicting", "press"
"""The kinds' names (``Kind.name``), for ``@register(..., judges=...)``."""

KINDS: dict[str, type[Kind]] = {}
"""Every registered kind by name, in the order the classes were defined (``Kind.__init_subclass__``)."""

ORACLE, TWIN, FRESH = "oracle", "twin", "fresh"
"""``Kind.target``: what a check compares the subject's steps with — the float64 oracle, its fake-quant twin run on
the same ops, or a fresh instance of its own class fed the equivalent history."""


class Kind:
    """A subject's kind (see the module docstring). Built by ``kind_of``; ``subject`` is the ``CacheSpec``. A
    subclass that sets ``name`` registers itself in ``KINDS``.

    Attributes:
        name: one of ``KIND_NAMES`` (what ``judges=`` names).
        target: ``ORACLE``, ``TWIN`` or ``FRESH``.
        declares: the ``CacheSpec.kind`` a subject declares to be of this kind (``kind="..."``, or a
            ``kvconform_<declares>`` attribute); None: the kind is not declared by name (``lossy_twin``: a twin).
        precedence: ``kind_of`` asks the kinds in this order (lowest first) which one ``claims`` the subject.
        judged_by_default: whether a check that declares no ``judges`` judges this kind (``DEFAULT_JUDGES``).
        subject: the ``CacheSpec`` (or any object with its fields).
    """

    name = EXACT
    target = ORACLE
    declares: str | None = None
    precedence = 0
    judged_by_default = True
    lossy = False
    """Its logits differ from the exact model's by design (every kind but ``exact``): judged by quality, and by the
    exactness checks of ``checks/batch.py`` (``LOSSY_KINDS``)."""
    needs_budget = False
    """A subject declaring this kind (``declares``) declares a quality ``Budget`` in place of exactness (a subject of
    a kind without it may not have one); ``Kind.budgeted`` asks the declared kind's class."""
    token_bound = False
    """Its budget bounds the tokens it holds (``tokens_max``, or ``keep_ratio`` past ``tokens_exact``): one of them is
    required, and its memory is bounded by them (``saves_memory`` is not its to give)."""
    budget_keys: tuple = ()
    """The ``Budget`` keys a subject declaring this kind may give (``Budget.from_mapping`` lists them)."""
    compresses = False
    """Its held bytes must be fewer than an exact cache's (``check_compression_real``), unless its budget says
    ``saves_memory=False``."""
    quantizes = False
    """A declaration of this kind says the cache quantizes what it holds (``kind="lossy"``): judged as a quantized
    cache (``Kind.quantized``; the speed family's quantized budget)."""
    evicts = False
    """It drops tokens past its token bound (``token_bound``; judged by the evicting contract)."""
    presses = False
    """It keeps a subset of each prefill's tokens exactly (a KV press; judged by the press contract)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            KINDS[cls.name] = cls

    @classmethod
    def claims(cls, subject) -> bool:
        """Whether ``subject`` is of this kind, asked in ``precedence`` order: by default, it declares
        ``declares``."""
        return cls.declares is not None and getattr(subject, "kind", "exact") == cls.declares

    def __init__(self, subject):
        self.subject = subject

    def __repr__(self) -> str:
        return f"{type(self).__name__}({getattr(self.subject, 'name', '?')})"

    # ------------------------------------------------------------------------------------------------ what it is
    @property
    def declared(self) -> str:
        """The declared kind (``CacheSpec.kind``): ``"exact"``, ``"lossy"``, ``"evicting"`` or ``"press"``."""
        return getattr(self.subject, "kind", "exact")

    @property
    def has_twin(self) -> bool:
        """Whether the subject has a fake-quant twin (``CacheSpec.twin``)."""
        return getattr(self.subject, "twin", None) is not None

    @property
    def declaration(self) -> type[Kind]:
        """The kind class the subject declares (``declaration_of(self.declared)``): a subject with a twin is of kind
        ``lossy_twin`` whatever it declares, and its declaration's facts (``needs_budget``, ``quantizes``) still
        apply."""
        return declaration_of(self.declared)

    @property
    def declared_lossy(self) -> bool:
        """Whether its declaration says it quantizes (``kind="lossy"``, ``kvconform_lossy``: the declared class's
        ``quantizes``)."""
        return self.declaration.quantizes

    @property
    def quantized(self) -> bool:
        """Whether it is judged as a quantized cache: it declares so (``declared_lossy``) or has a fake-quant twin."""
        return self.declared_lossy or self.has_twin

    @property
    def budgeted(self) -> bool:
        """Whether it declares a quality budget in place of exactness (its declared class's ``needs_budget``: lossy,
        evicting or press)."""
        return self.declaration.needs_budget

    @property
    def saves_memory(self) -> bool:
        """False where the budget declares no memory promise (``Budget.saves_memory``), else True."""
        return bool(getattr(getattr(self.subject, "budget", None), "saves_memory", True))

    @property
    def exact(self) -> bool:
        """Whether it promises the exact logits (not ``lossy``: kind ``exact``, without a twin)."""
        return not self.lossy

    @property
    def tokens_max(self) -> int | None:
        """``Budget.tokens_max`` (evicting subjects), else None."""
        return getattr(getattr(self.subject, "budget", None), "tokens_max", None)

    @property
    def keep_ratio(self) -> float | None:
        """``Budget.keep_ratio`` (an evicting subject that evicts a share of its tokens at every step), else None."""
        return getattr(getattr(self.subject, "budget", None), "keep_ratio", None)

    @property
    def exact_limit(self) -> int | None:
        """The most tokens an evicting subject may be fed while it promises exactness (``Budget.exact_limit``:
        ``tokens_max``, or ``tokens_exact`` for a share), else None."""
        budget = getattr(self.subject, "budget", None)
        return getattr(budget, "exact_limit", None) if budget is not None else None

    def held_bound(self, seen: int) -> int | None:
        """The most tokens per row and attention layer it may hold after ``seen`` tokens (``Budget.held_bound``),
        or None."""
        held_bound = getattr(getattr(self.subject, "budget", None), "held_bound", None)
        return held_bound(seen) if held_bound is not None else None

    # ------------------------------------------------------------------------------------------------ its twin
    @property
    def quant_config(self):
        """The twin's ``quant_config`` (``kvconform.quant.QuantConfig``) where it has one, else None."""
        return getattr(getattr(self.subject, "twin", None), "quant_config", None)

    def twin_spec(self):
        """The ``CacheSpec`` of the subject's fake-quant twin (named ``<subject>.twin``, no twin of its own), or None
        without a twin."""
        import dataclasses

        twin = getattr(self.subject, "twin", None)
        if twin is None:
            return None
        return dataclasses.replace(self.subject, name=f"{self.subject.name}.twin", factory=twin, twin=None)

    # ------------------------------------------------------------------------------------------------ messages
    @property
    def versus(self) -> str:
        """What a failure line adds after ``max|Δlogit| = …`` when nothing more precise is known: ``" vs its
        fake-quant twin"`` for a subject judged against its twin, else ``""`` (the oracle is implied)."""
        return " vs its fake-quant twin" if self.target == TWIN else ""

    # ------------------------------------------------------------------------------------------------ applicability
    def not_judged(self, check, case, held: Callable[[], int]) -> str | None:
        """Why an item of ``check`` (a ``CheckInfo``) on ``case`` does not apply to this kind, or None. Consulted
        only for checks whose ``judges`` do not name this kind. ``held()``: the most tokens per row the case makes
        a cache hold (``plan.most_tokens_held``), asked only where the kind needs it. By default the reason the
        check gives for this kind (``CheckInfo.unjudged_reason``), else that the check does not judge the kind (a
        kind defined after the check, which the check's ``judges`` do not name)."""
        return self.check_reason(check) or (f"{self.subject.name} is of kind {self.name!r}, which this check does not "
                                            f"judge (its @register(judges=...) does not name it)")

    def check_reason(self, check, kind: str | None = None) -> str | None:
        """The reason ``check`` gives for not judging this kind (``@register(..., unjudged=...)``; ``kind``: look it
        up under another kind's name), the subject's name filled in, or None."""
        reason = getattr(check, "unjudged_reason", None)
        return reason(kind or self.name, self.subject.name) if reason is not None else None


def _generate_tokens_reason(subject_name: str, twin: bool) -> str:
    return (f"{subject_name} is lossy: its generate() tokens are not compared token for token with the exact model "
            f"(a near-tie would flip a greedy token); its cache operations are judged by self-consistency"
            f"{' and its fake-quant twin' if twin else ''}, its outputs by the quality family")


class Exact(Kind):
    """Exact: compared with the float64 oracle; every check applies. The kind of a subject no other kind claims."""

    name = EXACT
    declares = "exact"
    precedence = 3

    @classmethod
    def claims(cls, subject) -> bool:
        return True


class LossyWithTwin(Kind):
    """Lossy with a fake-quant twin: the exact families compare it with the twin on the same ops; generate-token
    comparisons with the exact model do not apply."""

    name = LOSSY_TWIN
    target = TWIN
    precedence = 1
    lossy = True
    compresses = True

    @classmethod
    def claims(cls, subject) -> bool:
        """A subject with a fake-quant twin (``CacheSpec.twin``) that declares neither evicting nor press."""
        return getattr(subject, "twin", None) is not None

    def not_judged(self, check, case, held) -> str | None:
        return self.check_reason(check) or _generate_tokens_reason(self.subject.name, twin=True)


class SelfConsistent(Kind):
    """Lossy without a twin: compared with a fresh instance of its own class fed the equivalent history; not held
    to generate-token comparisons with the exact model nor to an exact cache's byte formula."""

    name = LOSSY_FRESH
    target = FRESH
    declares = "lossy"
    precedence = 2
    lossy = True
    needs_budget = True
    budget_keys = ("kl_max", "top1_min", "bytes_ratio_max", "saves_memory")
    compresses = True
    quantizes = True

    def not_judged(self, check, case, held) -> str | None:
        return self.check_reason(check, LOSSY_FRESH) or _generate_tokens_reason(self.subject.name, twin=False)


class Evicting(Kind):
    """Evicting: exact (against the oracle, or its twin where it has one) while it holds at most ``tokens_max``
    tokens; a check that does not judge evicting subjects keeps only the cases that never make it hold more."""

    name = EVICTING
    declares = "evicting"
    judged_by_default = False
    lossy = True
    needs_budget = True
    token_bound = True
    budget_keys = ("kl_max", "top1_min", "bytes_ratio_max", "tokens_max", "keep_ratio", "tokens_exact")
    evicts = True

    @property
    def target(self) -> str:  # type: ignore[override]
        return TWIN if self.has_twin else ORACLE

    def not_judged(self, check, case, held) -> str | None:
        own = self.check_reason(check)  # a check that judges no evicting subject says why first
        if own:
            return own
        limit = self.exact_limit
        if getattr(self.subject, "budget", None) is not None and limit is not None:
            most = held()
            if most > limit and self.keep_ratio is not None:
                return (f"{self.subject.name} evicts a share of its tokens past {limit} tokens seen (keep_ratio "
                        f"{self.keep_ratio:g}) and case {case.id} feeds it up to {most}: judged by the evicting "
                        f"contract, quality and the memory bound, not against the exact oracle")
            if most > limit:
                return (f"{self.subject.name} evicts past {limit} tokens and case {case.id} makes it hold up to "
                        f"{most}: judged by quality and the memory bound, not against the exact oracle")
        if self.has_twin and not check.judges_kind(LossyWithTwin(self.subject)):
            return LossyWithTwin(self.subject).not_judged(check, case, held)
        return None


class Press(SelfConsistent):
    """A KV press: compresses each prefill by keeping a subset of its tokens exactly (no token bound, no eviction
    while decoding). Compared like ``SelfConsistent`` with a fresh instance fed the equivalent history (the press
    keeps the same tokens of the same chunks); its own contract (length = tokens seen, short prompts) is
    ``checks/contract/press.py``."""

    name = PRESS
    declares = "press"
    precedence = 0
    quantizes = False
    presses = True

    def not_judged(self, check, case, held) -> str | None:
        reason = super().not_judged(check, case, held)
        return None if reason is None else reason.replace("is lossy", "is a press (it compresses the prefill)")


KIND_NAMES = tuple(KINDS)
"""The package's kinds' names, in the order the kinds are defined (a kind defined later is in ``KINDS``; the checks
validate ``judges=`` names against ``KINDS``)."""


class KindSet:
    """The names of the registered kinds whose class has a fact (``pick(cls) -> bool``), read when asked: a kind
    defined after a check was registered is in the set when its class has the fact. Iterates like a set of names
    (definition order) and compares equal to a set with the same names.

    Attributes:
        doc: what the set is, in words (for messages).
        pick: ``pick(kind class) -> bool``.
    """

    def __init__(self, doc: str, pick: Callable[[type[Kind]], bool]):
        self.doc = doc
        self.pick = pick

    def __contains__(self, name) -> bool:
        cls = KINDS.get(name) if isinstance(name, str) else None
        return cls is not None and bool(self.pick(cls))

    def __iter__(self):
        return iter([name for name, cls in KINDS.items() if self.pick(cls)])

    def __len__(self) -> int:
        return len(list(iter(self)))

    def __eq__(self, other) -> bool:
        if isinstance(other, (KindSet, set, frozenset)):
            return frozenset(self) == frozenset(other)
        return NotImplemented

    def __hash__(self) -> int:
        return id(self)

    def __sub__(self, other) -> frozenset:
        return frozenset(self) - frozenset(other)

    def __repr__(self) -> str:
        return f"KindSet({self.doc}: {', '.join(self)})"


ALL_KINDS = KindSet("every kind", lambda cls: True)
"""``judges=ALL_KINDS``: the check judges every kind as such, at any length (quality, speed)."""

DEFAULT_JUDGES = KindSet("every kind judged by default", lambda cls: cls.judged_by_default)
"""What a check judges unless it declares ``judges``: every kind whose ``judged_by_default`` is set — every kind but
``evicting`` (an evicting subject then gets the check's cases that never make it hold more than ``tokens_max``
tokens, where it must be exact)."""

LOSSY_KINDS = KindSet("every lossy kind", lambda cls: cls.lossy)
"""``judges=LOSSY_KINDS``: the kinds whose ``lossy`` is set (every kind but ``exact``)."""

FRESH_KINDS = KindSet("every kind compared with a fresh instance", lambda cls: cls.target == FRESH)
"""``judges=FRESH_KINDS``: the kinds a check compares with a fresh instance of the subject's class (``target``
``FRESH``: lossy without a twin, press)."""

DECLARED_KINDS = tuple(cls.declares for cls in KINDS.values() if cls.declares is not None)
"""The package's declarable kinds (``declared_kinds()`` when the session is built: a kind defined later included)."""


def declared_kinds() -> tuple:
    """What a subject may declare as its ``CacheSpec.kind`` (``kind="..."``, or a ``kvconform_<kind> = {budget}``
    attribute on a Cache subclass or factory for every kind whose ``needs_budget`` is set): the registered kinds'
    ``declares``, in definition order. ``kind_of`` maps a declaration (with its twin, if any) to a ``Kind``."""
    return tuple(cls.declares for cls in KINDS.values() if cls.declares is not None)


def declaration_of(declared) -> type[Kind]:
    """The kind class whose ``declares`` is ``declared`` (a ``CacheSpec.kind``); ``Exact`` for anything else (an
    undeclared or not yet validated value)."""
    return next((cls for cls in KINDS.values() if cls.declares is not None and cls.declares == declared), Exact)


def exact_kind(name: str) -> bool:
    """Whether ``name`` (a ``Kind.name``, e.g. read back from a report) is a registered kind that is not ``lossy``;
    False for an unknown name."""
    cls = KINDS.get(name)
    return cls is not None and not cls.lossy


def kind_of(subject) -> Kind:
    """The ``Kind`` of ``subject`` (a ``CacheSpec``, or any object with its ``kind`` / ``twin`` / ``budget``
    fields; missing ones mean exact, no twin, no budget): the first registered kind, in ``precedence`` order, that
    ``claims`` it — ``Evicting`` when it declares ``kind="evicting"``, ``Press`` when it declares ``kind="press"``,
    ``LossyWithTwin`` when it has a twin, ``SelfConsistent`` when it declares ``kind="lossy"``, else ``Exact``."""
    ordered = sorted(KINDS.values(), key=lambda cls: cls.precedence)  # stable: definition order within a precedence
    return next(cls for cls in ordered if cls.claims(subject))(subject)


def check_judges(judges):
    """``judges`` of ``@register``: a ``KindSet`` as it is (read when asked), else a frozenset of ``KINDS`` names.

    Raises:
        TypeError: a name that is not a kind (naming the known ones), or a bare string.
    """
    if isinstance(judges, KindSet):
        return judges
    if isinstance(judges, str):
        raise TypeError(f"register(judges=...): give a collection of kind names, e.g. ({judges!r},)")
    out = frozenset(judges)
    unknown = sorted(n for n in out if n not in KINDS)
    if unknown:
        raise TypeError(f"register(judges=...): unknown kind(s) {', '.join(map(repr, unknown))}; known: "
                        f"{', '.join(KINDS)}")
    return out


def check_facts(facts) -> dict:
    """``facts`` of ``@register`` (``{fact: reason}``) as a dict, each fact a bool attribute of ``Kind`` and each
    reason a string (``{subject}``: the subject's name) or ``{kind name or "*": string}``.

    Raises:
        TypeError: a fact that is no attribute of ``Kind``, or a reason of another type.
    """
    out = dict(facts or {})
    for fact, reason in out.items():
        if not isinstance(fact, str) or not hasattr(Kind, fact):
            raise TypeError(f"register(facts=...): {fact!r} is not a fact of a kind (an attribute of "
                            f"kvconform.subjects.kinds.Kind, e.g. 'lossy', 'compresses', 'has_twin')")
        if not isinstance(reason, (str, dict)):
            raise TypeError(f"register(facts=...): the reason for {fact!r} must be a string or a dict of kind "
                            f"names to strings, got {reason!r}")
    return out


def lacks_fact(kind: Kind, facts: dict) -> str | None:
    """The reason (``facts``' of the check) why ``kind`` does not have a fact the check needs of the subject's kind
    (``@register(..., facts=...)``), the subject's name filled in; None when it has them all."""
    for fact, reason in facts.items():
        if not getattr(kind, fact):
            text = reason if isinstance(reason, str) else reason.get(kind.name, reason.get("*"))
            text = text or f"{{subject}}'s kind ({kind.name}) is not {fact.replace('_', ' ')}"
            return text.replace("{subject}", kind.subject.name)
    return None
