"""The check registry: ``register`` (the one place a check declares its family, the capabilities it needs, the kinds
it judges, its params schema and its ops rule), ``CHECKS`` and ``load_checks``; ``Param`` and ``OpRule``, the
schemas a case file is validated against at load; ``Measured``, the typed record of what an item measured.
``kvconform.checks`` re-exports every public name.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from kvconform.ops import FORWARD_OPS, OPS, OPS_WITH_COUNT
from kvconform.subjects.kinds import DEFAULT_JUDGES, KINDS, check_facts, check_judges, lacks_fact

_TYPE_NAMES = {bool: "bool", int: "int", float: "number", str: "string", list: "list", dict: "table"}


@dataclass(frozen=True)
class Param:
    """One key of a check's ``params`` schema (what a case may write in ``params = {...}``).

    Attributes:
        types: accepted TOML value types (``int``, ``float`` — which also accepts an int —, ``bool``, ``str``,
            ``list``, ``dict``); a single type or a tuple. A bool is never accepted as an int or a number.
        default: the value the check uses when the case omits the key (``None``: the key has no value then, e.g.
            no padding); ``kvconform.cases`` fills it into ``case.params`` at load.
        required: the case must give the key (then ``default`` is unused).
        choices: the allowed values (strings), or None.
        min / max: inclusive bounds of a number, or of every number in a list or table value.
        items: the types of a list's elements or a table's values (None: not checked).
        doc: one line for messages and the README.
    """

    types: Any
    default: object = None
    required: bool = False
    choices: tuple | None = None
    min: float | None = None
    max: float | None = None
    items: Any = None
    doc: str = ""

    def __post_init__(self):
        for name in ("types", "items"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, tuple):
                object.__setattr__(self, name, (value,))

    @staticmethod
    def _is(value, types) -> bool:
        if isinstance(value, bool):
            return bool in types
        if float in types and isinstance(value, int):
            return True
        return isinstance(value, tuple(t for t in types if t is not bool))

    def describe(self) -> str:
        """What the key accepts, e.g. ``"int ≥ 2"``, ``"'full_prompt' | 'suffix_only'"``, ``"list of int ≥ 0"``."""
        if self.choices is not None:
            return " | ".join(repr(c) for c in self.choices)
        kinds = []
        for t in self.types:
            if t in (list, dict) and self.items:
                what = "/".join(_TYPE_NAMES[i] for i in self.items)
                kinds.append(f"list of {what}" if t is list else f"table of {what}")
            else:
                kinds.append(_TYPE_NAMES[t])
        text = " or ".join(kinds)
        if self.min is not None and self.max is not None:
            return f"{text} in [{self.min:g}, {self.max:g}]"
        if self.min is not None:
            return f"{text} ≥ {self.min:g}"
        if self.max is not None:
            return f"{text} ≤ {self.max:g}"
        return text

    def value(self, value):
        """``value`` (valid: ``problem`` is None) as this key's type, once at load (``cases.Params``): a number key
        (``float``, not ``int``) given as an int is a float, and so is each element of a list or table of numbers;
        anything else as it is."""
        def number(v):
            return float(v) if isinstance(v, int) and not isinstance(v, bool) else v

        if float in self.types and int not in self.types:
            return number(value)
        if self.items is not None and float in self.items and int not in self.items:
            if isinstance(value, list):
                return [number(v) for v in value]
            if isinstance(value, dict):
                return {k: number(v) for k, v in value.items()}
        return value

    def problem(self, value) -> str | None:
        """Why ``value`` is not allowed for this key (names the value and what is allowed), or None."""
        if not self._is(value, self.types):
            return f"expected {self.describe()}, got {type(value).__name__} {value!r}"
        if self.choices is not None and value not in self.choices:
            return f"{value!r} is not allowed; allowed values: {self.describe()}"
        inner = list(value) if isinstance(value, list) else list(value.values()) if isinstance(value, dict) else None
        if inner is not None and self.items is not None:
            bad = [v for v in inner if not self._is(v, self.items)]
            if bad:
                return f"expected {self.describe()}, got {value!r} (element {bad[0]!r})"
        numbers = [v for v in (inner if inner is not None else [value])
                   if isinstance(v, (int, float)) and not isinstance(v, bool)]
        for v in numbers:
            if (self.min is not None and v < self.min) or (self.max is not None and v > self.max):
                return f"{v!r} is out of range; allowed: {self.describe()}"
        return None


OP_PARAMS = {
    "padding": Param(list, items=int, min=0, doc="left pad tokens per row, with an attention mask (e.g. [0, 3])"),
}
"""Keys every op-based check (one that drives ``case.ops`` through ``_interpreter.Runner``) accepts: merged into their
``params`` schemas."""


TOKEN_OPS = FORWARD_OPS
"""The ops that feed tokens (each makes forwards; ``kvconform.ops``)."""


def _names(names) -> str:
    return ", ".join(repr(n) for n in names)


@dataclass(frozen=True)
class OpRule:
    """What a check needs of a case's ``ops``, declared with it (``@register(..., ops=OpRule(...))``) and checked
    when case files load (``kvconform.cases``): a case that is valid key by key but wrong for its check is then a
    usage error (exit code 4) naming the file, the case, what the check needs and the fix — never a ``ValueError``
    counted against the cache at run time.

    Attributes:
        reads: the check reads ``ops``. False: it ignores them (it builds its own calls: generate, timing, random
            programs), and a case that gives ``ops`` is an error instead of a silent no-op.
        allowed: the op names its driver accepts (None: every op of ``kvconform.cases.OP_NAMES``).
        required: op names that must each appear at least once.
        first: the name the first op must have (e.g. ``"prefill"``).
        shape: the exact op names in order (e.g. ``("prefill", "decode")``); None: any order.
        optional: with ``shape``: ops may also be omitted (the check then uses its own default).
        min_forwards: forwards the ops must make at least (``prefill N`` and ``chunk N``: one each; ``decode N``: N).
        min_batch: the smallest case ``batch`` the check works with.
        why: what the check does with the ops, for the message (e.g. "it compares the steps after the first").
        crop_past_start: the name of a bool param with which a case of this check crops past the start on purpose
            (the edge case: empty the cache or refuse clearly); ``kvconform.cases`` then accepts a ``crop N`` of
            more tokens than the cache holds, otherwise an error in the case file. None: never on purpose.
        crop_keeps: the name of a bool param under which ``crop N`` keeps N tokens (``crop(+N)``): N is then a
            length, not a count of tokens removed, and the held tokens are not checked. None: no such param.
    """

    reads: bool = True
    allowed: tuple | None = None
    required: tuple = ()
    first: str | None = None
    shape: tuple | None = None
    optional: bool = False
    min_forwards: int = 0
    min_batch: int = 1
    why: str = ""
    crop_past_start: str | None = None
    crop_keeps: str | None = None

    def crops_past_start(self, case) -> bool:
        """The case (a ``cases.Case``) crops past the start on purpose, or its crop counts are lengths kept: the
        tokens held are then not checked against its crops."""
        return any(bool(case.params.get(name)) for name in (self.crop_past_start, self.crop_keeps) if name)

    def problem(self, case, check: str) -> tuple[str, str] | None:
        """``(key, why this case is wrong for ``check``, with the fix)`` or None. ``case``: a ``cases.Case``."""
        ops = [op.name for op in case.ops]
        given = "ops = [" + ", ".join(repr(f"{op.name} {op.n}" if op.n else op.name) for op in case.ops) + "]"
        why = f" ({self.why})" if self.why else ""
        if not self.reads:
            if ops:
                return "ops", (f"{check} does not read 'ops' (it makes its own calls){why}; got {given}: remove "
                               f"'ops' from the case (or from [defaults])")
            return None
        if self.shape is not None:
            if ops == list(self.shape) or (self.optional and not ops):
                pass
            else:
                want = "[" + ", ".join(f"'{n} N'" for n in self.shape) + "]"
                return "ops", (f"{check} needs ops = {want}" + (" (or no ops)" if self.optional else "")
                               + f"{why}; got {given}")
        if self.allowed is not None:
            bad = [n for n in ops if n not in self.allowed]
            if bad:
                return "ops", (f"{check} cannot run op {bad[0]!r}: its driver accepts only "
                               f"{_names(self.allowed)}; got {given}: remove the {bad[0]!r} op or use a check that "
                               f"takes it")
        if self.first is not None and (not ops or ops[0] != self.first):
            return "ops", f"{check} needs ops starting with '{self.first} N'{why}; got {given}"
        for name in self.required:
            if name not in ops:
                example = f"'{name} N'" if name in OPS_WITH_COUNT else repr(name)
                return "ops", f"{check} needs at least one {example} op{why}; got {given}: add one"
        forwards = sum(op.spec.forwards(op.n) for op in case.ops)
        if forwards < self.min_forwards:
            return "ops", (f"{check} needs at least {self.min_forwards} forward(s) (prefill N and chunk N: one each, "
                           f"decode N: N){why}; got {forwards} from {given}")
        if case.batch < self.min_batch:
            return "batch", f"{check} needs batch ≥ {self.min_batch}{why}; got batch = {case.batch}"
        return None


IGNORES_OPS = OpRule(reads=False)
"""The rule of a check that does not read ``ops``: a case giving them is an error."""


@dataclass(frozen=True)
class CheckInfo:
    """A registered check.

    Attributes:
        name: the function's name (``check_*``).
        fn: ``fn(ctx) -> None``, raises ``ConformanceError``.
        family: its matrix column (``FAMILIES``).
        needs: the subject capabilities it needs (else the item is skipped, naming the first missing one).
        doc: the function's docstring.
        applies: ``applies(subject, model, case, device="cpu") -> reason or None``: the check's own applicability
            rule (lossy subjects only, CUDA only, one subject's row, ...); ``plan.skip_reason`` calls it. None:
            no rule of its own.
        params: ``{key: Param}``: the keys a case of this check may give in ``params`` (validated at load).
        ops: the ``OpRule`` its cases' ``ops`` must follow (checked at load); None: not declared (any ops; every
            built-in check declares one).
        validate: ``validate(case) -> (key, problem) | None``: the check's own load-time rule for what ``OpRule`` and
            ``Param`` cannot say (a relation between params, a requirement); the problem names what the check needs
            and the fix. None: no rule of its own.
        judges: the subject kinds (names of ``kvconform.subjects.kinds.KINDS``, or a ``KindSet`` chosen by a fact of
            the kind classes and read when asked: ``ALL_KINDS``, ``LOSSY_KINDS``) the check judges as such; on a
            subject of another kind the item is skipped with the reason its kind gives (``Kind.not_judged``: an
            evicting subject keeps the cases that never make it hold more than ``tokens_max`` tokens). Default
            ``DEFAULT_JUDGES``: every kind whose ``judged_by_default`` is set (all but ``evicting``).
        facts: ``{fact: reason}``: facts of the subject's kind (bool attributes of ``Kind``: ``lossy``,
            ``compresses``, ``has_twin``, ``quantized``, ...) the check needs; a subject whose kind lacks one is
            skipped with the reason (``{subject}``: its name; or ``{kind name or "*": reason}``), asked where the
            ``applies`` rule is (``plan.skip_reason``). Empty: none.
        unjudged: why the check does not judge a kind, in the check's words (``{subject}`` is the subject's name):
            ``{kind name: reason}`` (``"*"``: every other kind), or one reason for every kind it does not judge;
            ``Kind.not_judged`` gives it as the skip reason (else the kind's own). None: the kinds' own reasons.
        tokens_held: ``tokens_held(case) -> int``: the most tokens per row a cache holds while the check runs
            ``case``, declared by a check that feeds tokens of its own beyond the case's ops (generate, random
            programs); ``plan.most_tokens_held`` asks it (the evicting skip rule). None: counted from the ops.
        cost: the estimated cost of one item that runs, relative to a ``logits`` item (measured order of magnitude
            on the zoo: compiling 8, timing 6, quality 4, random programs 2, generate and memory 1.5);
            ``merge.item_cost`` reads it to cut ``--kvconform-shard`` jobs of equal cost.
        timed: the check measures wall-clock time (a budget): the plugin gives it pytest-benchmark's fixture where
            that plugin is active and skips it under ``--benchmark-disable`` in an xdist worker.
        reads_position_ids: the check passes the case's ``position_ids`` to the model itself, so a case with
            ``position_ids = "explicit"`` is skipped on a model whose forward takes none (``plan.skip_reason``).
        transformers_only: why the check cannot apply to a model outside transformers (a model adapter,
            ``kvconform.scratch``: it judges transformers' own API — beam search, ``cache_implementation``, a cache
            class of transformers), or None: it applies to such a model too. The adapter's model source reads it
            (``kvconform.sources``) and skips the item with that reason.
        adapter_full_tier: why a model written from scratch (a model adapter) gets the check only under
            ``--kvconform-full`` (its default tier keeps to its time budget: ``plan.in_scope``), or None: its
            default tier has it.
    """

    name: str
    fn: Callable
    family: str
    needs: frozenset = frozenset()
    doc: str = ""
    applies: Callable | None = None
    params: dict = field(default_factory=dict)
    ops: OpRule | None = None
    validate: Callable | None = None
    judges: Any = DEFAULT_JUDGES
    unjudged: dict = field(default_factory=dict)
    tokens_held: Callable | None = None
    cost: float = 1.0
    timed: bool = False
    reads_position_ids: bool = False
    facts: dict = field(default_factory=dict)
    transformers_only: str | None = None
    adapter_full_tier: str | None = None

    def judges_kind(self, kind) -> bool:
        """Whether the check judges a subject of ``kind`` (a ``Kind``) as such (``judges`` names its kind)."""
        return kind.name in self.judges

    def lacks_fact(self, kind) -> str | None:
        """Why a subject of ``kind`` (a ``Kind``) lacks a fact the check needs (``facts``), or None."""
        return lacks_fact(kind, self.facts) if self.facts else None

    def unjudged_reason(self, kind: str, subject: str) -> str | None:
        """The check's reason for not judging a subject named ``subject`` of kind ``kind`` (``unjudged``), or
        None."""
        reason = self.unjudged.get(kind, self.unjudged.get("*"))
        return None if reason is None else reason.replace("{subject}", subject)

    def case_problem(self, case) -> tuple[str, str] | None:
        """``(key, problem)`` when ``case`` (a ``cases.Case`` with its params filled in) is wrong for this check,
        by its ``ops`` rule, then its ``validate``; None when it fits."""
        if self.ops is not None:
            found = self.ops.problem(case, self.name)
            if found:
                return found
        return self.validate(case) if self.validate is not None else None


CHECKS: dict[str, CheckInfo] = {}


def register(family: str, needs=(), applies: Callable | None = None, params: dict | None = None,
             ops: OpRule | None = None, validate: Callable | None = None, judges=DEFAULT_JUDGES,
             unjudged: dict | str | None = None, tokens_held: Callable | None = None, cost: float = 1.0,
             timed: bool = False, reads_position_ids: bool = False, facts: dict | None = None,
             transformers_only: str | None = None, adapter_full_tier: str | None = None):
    """Decorator registering a ``check_*`` function: the one place a check declares its family, the capabilities
    it ``needs``, the subject kinds it ``judges`` (``CheckInfo.judges``), its own applicability rule (``applies``,
    see ``CheckInfo``), its ``params`` schema
    (``{key: Param}``; merge ``OP_PARAMS`` in for an op-based check), what it needs of a case's ``ops``
    (``OpRule``; ``IGNORES_OPS`` for a check that does not read them), its own load-time case rule
    (``validate(case) -> (key, problem) | None``), why it skips the kinds it does not judge (``unjudged``) and, for
    a check that feeds tokens of its own, the most tokens it makes a cache hold (``tokens_held(case)``), the facts
    it needs of the subject's kind (``facts``, see ``CheckInfo``), its estimated ``cost``, whether it is ``timed``,
    whether it ``reads_position_ids``, why it cannot apply to a model outside transformers (``transformers_only``)
    and why a model written from scratch gets it only in the full tier (``adapter_full_tier``; see ``CheckInfo``).
    A case file breaking any of them is a usage error at load.

    Raises:
        TypeError: a ``params`` value that is not a ``Param``, an ``ops`` that is not an ``OpRule``, a ``judges``
            name that is not a kind, a ``facts`` name that is no fact of a kind.
    """
    judged = check_judges(judges)
    needed = check_facts(facts)
    reasons = {"*": unjudged} if isinstance(unjudged, str) else dict(unjudged or {})
    for kind in reasons:
        if kind != "*" and kind not in KINDS:
            raise TypeError(f"register(unjudged=...): unknown kind {kind!r}; known: {', '.join(sorted(KINDS))}")
    schema = dict(params or {})
    for key, value in schema.items():
        if not isinstance(value, Param):
            raise TypeError(f"register(params=...): {key!r} must be a Param, got {value!r}")
    if ops is not None and not isinstance(ops, OpRule):
        raise TypeError(f"register(ops=...): must be an OpRule, got {ops!r}")

    def deco(fn):
        CHECKS[fn.__name__] = CheckInfo(fn.__name__, fn, family, frozenset(needs), (fn.__doc__ or "").strip(),
                                        applies, schema, ops, validate, judged, reasons, tokens_held, float(cost),
                                        bool(timed), bool(reads_position_ids), needed, transformers_only,
                                        adapter_full_tier)
        return fn

    return deco


def load_checks() -> dict[str, CheckInfo]:
    """Import every public module of this package (each registers its checks) and return the registry."""
    import pkgutil

    package = importlib.import_module("kvconform.checks")
    for module in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if not module.name.startswith("_"):
            importlib.import_module(f"kvconform.checks.{module.name}")
    return CHECKS


# ------------------------------------------------------------------------------------------------ what was measured
BATCH_OPS = tuple(name for name, spec in OPS.items() if spec.rows in ("permute", "resize"))
"""The ops that edit the batch rows of a warm cache (reorder, select, repeat, beam fork, swap): an item whose case
has one measured nothing about it unless the op was applied to the cache (or refused by it)."""


@dataclass
class Measured:
    """What one item measured, as typed values (``CheckContext.measured``): the checks and the op interpreter fill
    it; ``run_check`` turns a pass whose measurement is empty or degenerate where the case says it cannot be into a
    failure (``blind``), and the item's metrics carry it (``as_metrics``, metric ``measured``).

    Attributes:
        bytes_held: bytes the cache owned when the check counted them (``_measure.cache_bytes``), or None.
        tokens_held: tokens per row the cache should hold then, or None.
        ops_applied: ``{op name: times}`` the op interpreter applied to a cache of the item's runs on the case's
            own ops (``Runner.run`` without a plan).
        ops_refused: ``{op name: times}`` a check's ``on_raise`` let a refused op pass on those runs.
        expects_ops: the batch ops (``BATCH_OPS``) of the case those runs were given: each must be applied or
            refused.
        timed_steps: timed samples of the target measured least (the speed family), or None.
        refusal: the refusal an item accepted as the contract's (``"ValueError: ..."``), or None.
        refused_by: who refused it and why that is allowed: ``"subject, declared"``, ``"subject and reference"``.
        rollbacks: the ``crop`` calls that removed tokens from the subject's cache in a run that exists to roll it
            back (the speculative family: transformers' candidate generators), or None where the item has no such
            run; 0 is blind.
        tokens_rolled_back: the tokens those rollbacks removed, or None.
    """

    bytes_held: int | None = None
    tokens_held: int | None = None
    ops_applied: dict = field(default_factory=dict)
    ops_refused: dict = field(default_factory=dict)
    expects_ops: tuple = ()
    timed_steps: int | None = None
    refusal: str | None = None
    refused_by: str | None = None
    rollbacks: int | None = None
    tokens_rolled_back: int | None = None

    def record(self, **values) -> None:
        """Set fields by name.

        Raises:
            TypeError: a name that is no field."""
        for name, value in values.items():
            if name not in self.__dataclass_fields__:
                raise TypeError(f"Measured has no field {name!r}")
            setattr(self, name, value)

    def applied(self, op_name: str, refused: bool = False) -> None:
        """Count one application (or an allowed refusal) of ``op_name``."""
        table = self.ops_refused if refused else self.ops_applied
        table[op_name] = table.get(op_name, 0) + 1

    def blind(self) -> str | None:
        """Why the measurement says nothing about the cache although the case says it must, or None:

        * 0 bytes counted while the cache holds tokens (its keys/values are somewhere kvconform cannot see);
        * a batch op of the case never applied to the cache nor refused by it;
        * a timed target with no timed sample;
        * a run that exists to roll the cache back (``rollbacks`` recorded) that never did.
        """
        if self.tokens_held and self.bytes_held == 0:
            return (f"0 bytes counted while the cache holds {self.tokens_held} tokens per row: its keys/values are "
                    f"nowhere kvconform can reach from the cache object (its attributes, its layers, what they "
                    f"refer to), so the bytes it holds were not measured")
        missing = [op for op in self.expects_ops if op not in self.ops_applied and op not in self.ops_refused]
        if missing:
            return (f"the case's {', '.join(missing)} op{'s were' if len(missing) > 1 else ' was'} never applied "
                    f"to the cache (applied: {', '.join(self.ops_applied) or 'none'}), so the item measured "
                    f"nothing about {'them' if len(missing) > 1 else 'it'}")
        if self.timed_steps == 0:
            return "no timed sample: the timed step never ran, so no time was measured"
        if self.rollbacks == 0:
            return ("no rollback: the candidate generator never cropped a token from the cache (every candidate "
                    "accepted, or no crop() call), so the item measured nothing about rollbacks")
        return None

    def as_metrics(self) -> dict:
        """The fields that were measured (JSON-serialisable; empty when nothing was recorded)."""
        out = {}
        for name in ("bytes_held", "tokens_held", "timed_steps", "refusal", "refused_by", "rollbacks",
                     "tokens_rolled_back"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        for name in ("ops_applied", "ops_refused"):
            if getattr(self, name):
                out[name] = dict(getattr(self, name))
        return out
