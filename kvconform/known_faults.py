"""Known upstream (transformers) faults: which items fail because of a bug in transformers, on which versions.

Data lives in ``known_faults.toml`` next to this module (extra files: ``--kvconform-known-faults``). A file holds
``[[fault]]`` tables only, with exactly the keys of ``KEYS``::

    [[fault]]
    id = "mamba-jamba-chunk-zero-state"   # letters, digits, '_' and '-'; unique over all files
    transformers = ">=5.5,<5.20"          # PEP 440 specifier of the affected versions
    subject = "QuantizedCache_*"          # fnmatch pattern or list of patterns; default "*"
    model = ["mamba", "jamba"]            # zoo names (or the run's checkpoint names)
    check = "check_chunked_continuation"  # registered check names
    family = "crop"                       # check families (kvconform.checks.FAMILIES)
    case = "chunk*"                       # case ids
    evidence = "only defined for dynamic" # optional: a regular expression the failure message must contain
    reason = "..."                        # shown in the xfail, or in the failure under --kvconform-strict

With ``evidence``, an entry excuses a failure only when the failure shows the fault (the message contains a match:
the exception transformers raises, a measured quantity): the entry can then name every subject (``subject = "*"``)
— a fault of transformers' wrapper applies to every cache inside it — without excusing a subject's own, different
failure on the same item, which fails with a note naming the entry.

Every problem — an unknown key (a typo such as ``checks = ...`` would otherwise widen the entry to every check), a
missing or duplicate id, a bad specifier, a check / family / model pattern that names nothing known — raises
``KnownFaultsError`` naming the file, the entry id and the key; the plugin turns it into a usage error (exit 4),
as for case files.

``match(...)`` gives an item's reason (first matching entry); ``live(...)`` the entries a run can judge stale, and
the session (``KVSession.stale_faults``) and the plugin's terminal summary list entries that matched no item and
xfailed items that passed.
"""

from __future__ import annotations

import fnmatch
import functools
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from kvconform.outcomes import UsageError

FAULTS_FILE = Path(__file__).with_name("known_faults.toml")
PATTERN_KEYS = ("subject", "model", "check", "family", "case")
KEYS = {
    "id": "short unique id: letters, digits, '_' and '-'",
    "transformers": "PEP 440 specifier of the affected transformers versions, e.g. '>=5.5,<5.19'",
    "reason": "what is wrong, in transformers' code (shown in the xfail)",
    "subject": "fnmatch pattern(s) of subject names (default '*')",
    "model": "fnmatch pattern(s) of model names: zoo names or the run's checkpoint names (default '*')",
    "check": "fnmatch pattern(s) of registered check names (default '*')",
    "family": "fnmatch pattern(s) of check families (default '*')",
    "case": "fnmatch pattern(s) of case ids (default '*')",
    "evidence": "regular expression a failure message must contain for the entry to excuse it (default: any)",
    "cause": "id of the likely cause the failure must name (its record's failure.cause.id, e.g. 'kv_length'; "
             "default: any): matched as a name, so rewording the cause's sentence changes nothing",
    "envelope": "table {metric = bound}: what the fault does on the built-in subjects (a number bounds the failure's "
                "metric from above — max_abs in logits units, bytes_ratio = layer bytes / formula bound —, a string "
                "is a regular expression its value must contain — raised; failed_at, the step the failure arises "
                "at, e.g. '^chunk\\(' or '^decode'); a failure outside it (another step included) fails",
    "inherits": "transformers methods ('Class.method', Class in transformers.cache_utils) the fault lives in: a "
                "subject whose cache (or a layer of it) is such a class and resolves the method to transformers' "
                "own gets the entry by that evidence, named 'inherited from transformers' Class.method'",
}
DERIVED = {"bytes_ratio": ("layer_bytes", "layer_bound")}
STEP = "failed_at"
"""The envelope metric naming the step a failure arises at: the label of the op (or forward) the check reports it
at — ``prefill(12)``, ``chunk(4)``, ``decode 3``, ``crop(-2)``, ``reorder``... (``Runner`` labels, ``SubjectRaised.
where``). A regular expression; a failure reporting another step lies outside the envelope."""


def step_examples() -> tuple[str, ...]:
    """One label per form a run reports as ``failed_at``: each feeding op as a forward (``prefill(8)``, ``chunk(8)``,
    ``decode 1``: a per-token op's step number), each other op with a count and by its name (``crop(-2)``,
    ``reorder``, ``reset(then batch 2)``), and ``construction``. An envelope's ``failed_at`` must match one of them
    (else it names no step: a typo)."""
    from kvconform.ops import OPS

    out = ["construction"]
    for name, spec in OPS.items():
        if spec.feeds:
            out.append(f"{name} 1" if spec.per_token else f"{name}(8)")
        else:
            out += [spec.label_of(2), name]
    return tuple(dict.fromkeys(out))
"""Metrics an envelope may bound that the checks do not report themselves: name → (numerator, denominator)."""
_MISSING = object()
_ID = re.compile(r"^[A-Za-z0-9_-]+$")


class KnownFaultsError(ValueError, UsageError):
    """A known-faults file is malformed. ``str(err)`` names the file, the entry id (or ``#index`` when it has
    none), the key and what is allowed."""


@dataclass(frozen=True)
class KnownFault:
    """One entry: its ``id``, the affected ``transformers`` versions (PEP 440 specifier string) and a tuple of
    fnmatch patterns per item field (``PATTERN_KEYS``); ``source`` is the file it came from."""

    id: str
    transformers: str
    reason: str
    subject: tuple = ("*",)
    model: tuple = ("*",)
    check: tuple = ("*",)
    family: tuple = ("*",)
    case: tuple = ("*",)
    source: str = ""
    evidence: str | None = None
    cause: str | None = None
    """The likely cause's id (``kvconform.failure.Cause.id``) a failure must name, or None (any)."""
    envelope: tuple = ()
    """``((metric, bound), ...)``: a number bounds ``abs(metric)`` from above, a string is a regex its value must
    contain (``within``)."""
    inherits: tuple = ()
    """``("Class.method", ...)``: transformers methods the fault lives in (``inherited_by``)."""
    _specifier: object = field(default=None, compare=False, hash=False, repr=False)

    def applies_to(self, version) -> bool:
        """Whether ``version`` (a ``packaging.version.Version``) is among the affected versions."""
        spec = self._specifier
        if spec is None:
            from packaging.specifiers import SpecifierSet

            spec = SpecifierSet(self.transformers)
        return version in spec

    def matches_fields(self, **fields) -> bool:
        """Whether every given field (``subject=``, ``model=``, ``check=``, ``family=``, ``case=``: names) matches
        one of this entry's patterns for it; fields not given are not looked at."""
        return all(_any_matches(tuple(getattr(self, key)), value) for key, value in fields.items())

    def shown_by(self, message: str, cause_id: str | None = None) -> bool:
        """Whether a failure shows this fault: its ``message`` matches ``evidence`` (a user's regular expression;
        always, without evidence) and its likely cause's id (``cause_id``: ``Failure.cause.id``, None when it has
        none) is this entry's ``cause`` (always, without one)."""
        if self.cause is not None and cause_id != self.cause:
            return False
        return self.evidence is None or re.search(self.evidence, message) is not None

    @property
    def judged_at_run_time(self) -> bool:
        """Whether the entry excuses a failure only after seeing it (``evidence``, ``cause`` or ``envelope``): such
        entries do not mark items before they run."""
        return self.evidence is not None or self.cause is not None or bool(self.envelope)

    def within(self, metrics: dict) -> bool:
        """Whether a failure's ``metrics`` (``ConformanceError.metrics``) lie inside the envelope (a list-valued
        metric: each element must match a string bound): the failure reports at least one of the envelope's metrics
        (a failure of another kind — an exception where the fault
        gives a Δ, a Δ where it raises — shares none) and every one it reports is within its bound. True without
        an envelope."""
        if not self.envelope:
            return True
        seen = False
        for name, bound in self.envelope:
            value = metric(metrics, name)
            if value is None:
                continue
            seen = True
            if isinstance(bound, str):  # a list (e.g. the methods a contract item found missing): every element
                values = value if isinstance(value, list) else [value]
                if any(re.search(bound, str(v)) is None for v in values):
                    return False
            else:
                try:
                    number = abs(float(value))
                except (TypeError, ValueError):
                    return False
                if not number <= bound:  # nan and inf are outside
                    return False
        return seen

    def outside(self, metrics: dict) -> str:
        """Why ``metrics`` lie outside the envelope, in words ("" when inside)."""
        if self.within(metrics):
            return ""
        parts = []
        for name, bound in self.envelope:
            value = metric(metrics, name)
            shown = "not reported" if value is None else (f"{value:.3g}" if isinstance(value, float) else repr(value))
            parts.append(f"{name} {shown} "
                         f"(envelope: {'~ ' + repr(bound) if isinstance(bound, str) else '≤ ' + format(bound, 'g')})")
        return "; ".join(parts)

    def inherited_by(self, cache, raised: BaseException | None = None) -> str | None:
        """The ``"Class.method"`` of ``inherits`` that ``cache`` uses unchanged, or None: ``cache`` (or one of its
        layers; both halves of an encoder-decoder cache) is an instance of transformers' ``Class`` and its class
        resolves ``method`` to the very function ``Class.method`` resolves to (not overridden) — or lacks it
        where transformers' class lacks it. Classes the installed transformers lacks are skipped.

        ``raised``: the exception the subject raised, if any. A subclass that overrides ``method`` but calls
        transformers' own (``super().update(...)``) inherits it too when ``raised`` was raised inside that very
        function (its code object is on the traceback): the fault's code ran, unchanged, and raised."""
        from transformers import cache_utils

        objects = [cache]
        for part in (cache, getattr(cache, "self_attention_cache", None),
                     getattr(cache, "cross_attention_cache", None)):
            try:  # a cache's layers as a list, tuple or dict (its values); any other shape holds no layer here
                layers = getattr(part, "layers", None) if part is not None else None
                objects += list(layers.values() if isinstance(layers, dict) else layers) \
                    if isinstance(layers, (list, tuple, dict)) else []
            except Exception:  # noqa: BLE001 - a layers property that raises: the cache itself is still judged
                continue
        for name in self.inherits:
            cls_name, _, method = name.partition(".")
            cls = getattr(cache_utils, cls_name, None)
            if not isinstance(cls, type):
                continue
            # inherited: the subject's class finds the name where transformers' class finds it (the same defining
            # class, or both lack it) — compared by owner, not value: a class attribute `is_croppable = True` of the
            # subject's own is not transformers' `True`
            upstream = _defining_class(cls, method)
            for obj in objects:
                if isinstance(obj, cls) and _defining_class(type(obj), method) is upstream:
                    return name
            code = getattr(getattr(cls, method, None), "__code__", None)
            if code is not None and any(isinstance(obj, cls) for obj in objects) and _ran(raised, code):
                return name
        return None

    def matches(self, version, **fields) -> bool:
        """``matches_fields(**fields)`` and ``applies_to(version)`` (the names first: an fnmatch is cheap and most
        entries fail on them, a version specifier test is not: looked up for every planned item)."""
        return self.matches_fields(**fields) and self.applies_to(version)


@functools.lru_cache(maxsize=65536)
def _any_matches(patterns: tuple, value: str) -> bool:
    """Whether ``value`` matches one of the fnmatch ``patterns``. Memoised: a run plans ~2,000 items against every
    entry, and the same (patterns, name) pairs recur (~96,000 look-ups, 0.6 s per planning process without it)."""
    return any(fnmatch.fnmatchcase(value, p) for p in patterns)


ABSENT = None
"""What ``metric`` returns for a metric the failure does not report."""


def metric(metrics: dict, name: str):
    """A failure's metric ``name`` (or a ``DERIVED`` one), or ``ABSENT`` (None) when the failure does not report
    it; a metric reported as None (e.g. ``is_croppable`` of a cache without the flag) comes back as the string
    ``"None"``."""
    if name in DERIVED:
        top, bottom = (metrics.get(k) for k in DERIVED[name])
        try:
            return float(top) / float(bottom) if float(bottom) else ABSENT
        except (TypeError, ValueError):
            return ABSENT
    if name not in metrics:
        return ABSENT
    value = metrics[name]
    return "None" if value is None else value


def _fail(path, fault_id, key, problem):
    where = f"fault {fault_id!r}" if not str(fault_id).startswith("#") else f"fault {fault_id}"
    raise KnownFaultsError(f"{path}: {where}: key {key!r}: {problem}")


def _patterns(path, fault_id, key, value) -> tuple:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        _fail(path, fault_id, key, f"expected a non-empty pattern or list of patterns, got {value!r}")
    return tuple(value)


def _check_names(path, fault_id, key, patterns, known, what):
    """Every pattern of ``key`` must match at least one of ``known`` (a pattern matching nothing is a typo)."""
    if known is None:
        return
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in known):
            _fail(path, fault_id, key, f"{pattern!r} matches no {what}; known: {', '.join(sorted(known))}")


def load_known_faults(path=FAULTS_FILE, checks=None, families=None, models=None) -> list[KnownFault]:
    """Load and validate one known-faults file.

    Args:
        path: the ``.toml`` file (default: the bundled ``known_faults.toml``).
        checks: registered check names each ``check`` pattern must match one of (None: not validated).
        families: check families each ``family`` pattern must match one of (None: not validated).
        models: model names each ``model`` pattern must match one of (None: not validated); an architecture name
            (``tf_<type>``) is not validated, since the architectures differ by transformers release.

    Returns:
        The entries, in file order.

    Raises:
        KnownFaultsError: unreadable TOML, a top-level table other than ``fault``, an unknown or missing key, a
            wrong type, a bad id or specifier, a duplicate id, a pattern matching no known name.
    """
    from packaging.specifiers import InvalidSpecifier, SpecifierSet

    path = str(path)
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise KnownFaultsError(f"{path}: cannot read known-faults file: {exc}") from None
    unknown = set(data) - {"fault"}
    if unknown:
        raise KnownFaultsError(f"{path}: unknown top-level key(s) {sorted(unknown)}; allowed: 'fault' ([[fault]])")
    raw_faults = data.get("fault", [])
    if not isinstance(raw_faults, list):
        raise KnownFaultsError(f"{path}: 'fault' must be an array of tables ([[fault]])")
    faults, seen = [], set()
    for index, raw in enumerate(raw_faults):
        fault_id = raw.get("id") if isinstance(raw.get("id"), str) and raw.get("id") else f"#{index}"
        for key in raw:
            if key not in KEYS:
                _fail(path, fault_id, key, f"unknown key; allowed keys: {', '.join(KEYS)}")
        for key in ("id", "transformers", "reason"):
            if key not in raw:
                _fail(path, fault_id, key, "missing (required)")
            if not isinstance(raw[key], str) or not raw[key].strip():
                _fail(path, fault_id, key, f"expected a non-empty string, got {raw[key]!r}")
        if not _ID.match(raw["id"]):
            _fail(path, fault_id, "id", "ids may contain only letters, digits, '_' and '-'")
        if raw["id"] in seen:
            _fail(path, fault_id, "id", "duplicate id")
        seen.add(raw["id"])
        try:
            specifier = SpecifierSet(raw["transformers"])
        except InvalidSpecifier as exc:
            _fail(path, fault_id, "transformers", f"not a PEP 440 version specifier ({exc}); e.g. '>=5.5,<5.19'")
        patterns = {k: _patterns(path, fault_id, k, raw[k]) for k in PATTERN_KEYS if k in raw}
        evidence = raw.get("evidence")
        if evidence is not None:
            if not isinstance(evidence, str) or not evidence:
                _fail(path, fault_id, "evidence", f"expected a non-empty regular expression, got {evidence!r}")
            try:
                re.compile(evidence)
            except re.error as exc:
                _fail(path, fault_id, "evidence", f"not a regular expression ({exc})")
        cause = raw.get("cause")
        if cause is not None and (not isinstance(cause, str) or not _ID.match(cause)):
            _fail(path, fault_id, "cause", f"expected a cause id (letters, digits, '_' and '-'), e.g. 'kv_length'; "
                                           f"got {cause!r}")
        envelope = raw.get("envelope", {})
        if not isinstance(envelope, dict) or not all(
                isinstance(v, str) or (isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0)
                for v in envelope.values()):
            _fail(path, fault_id, "envelope", f"expected a table of metric = number (upper bound) or string (regular "
                                              f"expression), e.g. {{ max_abs = 5.0, raised = 'IndexError' }}; "
                                              f"got {envelope!r}")
        for name, bound in envelope.items():
            if isinstance(bound, str):
                try:
                    re.compile(bound)
                except re.error as exc:
                    _fail(path, fault_id, "envelope", f"{name}: not a regular expression ({exc})")
            if name == STEP and (not isinstance(bound, str)
                                 or not any(re.search(bound, label) for label in step_examples())):
                _fail(path, fault_id, "envelope", f"{STEP}: {bound!r} names no step a run reports; it is a regular "
                                                  f"expression of the step's label, e.g. "
                                                  f"{', '.join(step_examples()[1:7])}")
        inherits = _patterns(path, fault_id, "inherits", raw["inherits"]) if "inherits" in raw else ()
        for name in inherits:
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*\.[A-Za-z_][A-Za-z0-9_]*$", name):
                _fail(path, fault_id, "inherits", f"{name!r}: expected 'Class.method' (a class of "
                                                  f"transformers.cache_utils), e.g. 'QuantizedLayer.crop'")
        if inherits and not envelope and evidence is None and cause is None:
            _fail(path, fault_id, "inherits", "needs an 'envelope' (or 'evidence'): an inherited fault is "
                                              "recognised by "
                                              "what it does, never by the method alone")
        _check_names(path, fault_id, "check", patterns.get("check", ()), checks, "registered check")
        _check_names(path, fault_id, "family", patterns.get("family", ()), families, "check family")
        # an architecture of transformers:* (tf_<type>) exists only from the release that added it (tf_dory,
        # tf_dots3_note_text are not in 5.5): such names are not validated against the installed release's list
        _check_names(path, fault_id, "model", [p for p in patterns.get("model", ()) if not p.startswith("tf_")],
                     models, "model")
        faults.append(KnownFault(id=raw["id"], transformers=raw["transformers"],
                                 reason=" ".join(raw["reason"].split()), source=path, _specifier=specifier,
                                 evidence=evidence, cause=cause, envelope=tuple(envelope.items()),
                                 inherits=inherits,
                                 **patterns))
    return faults


def load_all(paths=(), checks=None, families=None, models=None) -> list[KnownFault]:
    """The bundled file followed by ``paths`` (extra files), validated as in ``load_known_faults``.

    Raises:
        KnownFaultsError: as ``load_known_faults``, or an id defined in two files (names both).
    """
    faults, where = [], {}
    for path in [FAULTS_FILE, *(paths or ())]:
        for fault in load_known_faults(path, checks=checks, families=families, models=models):
            if fault.id in where:
                _fail(path, fault.id, "id", f"duplicate, already defined in {where[fault.id]}")
            where[fault.id] = str(path)
            faults.append(fault)
    return faults


def find(faults, version, subject: str, model: str, check: str, case: str, family: str | None = None):
    """The first ``KnownFault`` matching this item on ``version``, or None."""
    fields = dict(subject=subject, model=model, check=check, case=case)
    if family is not None:
        fields["family"] = family
    for fault in faults:
        if fault.matches(version, **fields):
            return fault
    return None


def _ran(raised: BaseException | None, code) -> bool:
    """Whether ``raised`` (an exception, or None) was raised inside the function whose code object is ``code``:
    ``code`` is one of the frames of its traceback."""
    tb = raised.__traceback__ if raised is not None else None
    while tb is not None:
        if tb.tb_frame.f_code is code:
            return True
        tb = tb.tb_next
    return False


def _defining_class(cls: type, name: str):
    """The first class of ``cls``'s MRO whose own namespace defines ``name``, or None."""
    return next((k for k in cls.__mro__ if name in vars(k)), None)


class FaultIndex:
    """``find`` over a fixed list of entries and one transformers version, by set look-ups: which entries match a
    field's value (``subject="DynamicCache"``) is worked out once per (field, value) and memoised, so planning
    ~2,000 items costs a few hundred pattern matches instead of ~96,000 (0.6 s per planning process before). Same
    answers as ``find``."""

    def __init__(self, faults, version):
        self.faults = list(faults)
        self.version = version
        self._matching: dict = {}
        self._applies: dict = {}

    def _entries(self, key: str, value: str) -> frozenset:
        if (key, value) not in self._matching:
            self._matching[key, value] = frozenset(
                i for i, fault in enumerate(self.faults) if _any_matches(tuple(getattr(fault, key)), value))
        return self._matching[key, value]

    def find(self, subject: str, model: str, check: str, case: str, family: str | None = None):
        """The first entry (in file order) matching this item on the index's version, or None."""
        return next(iter(self.find_all(subject, model, check, case, family)), None)

    def find_all(self, subject: str, model: str, check: str, case: str, family: str | None = None) -> list:
        """Every entry matching this item on the index's version, in file order (several faults of one release
        can name the same item: the first gives the item its reason, a failure is excused by any whose envelope
        holds it)."""
        fields = dict(subject=subject, model=model, check=check, case=case)
        if family is not None:
            fields["family"] = family
        candidates = None
        for key, value in fields.items():
            entries = self._entries(key, value)
            candidates = entries if candidates is None else candidates & entries
            if not candidates:
                return []
        found = []
        for i in sorted(candidates):
            if i not in self._applies:
                self._applies[i] = self.faults[i].applies_to(self.version)
            if self._applies[i]:
                found.append(self.faults[i])
        return found


def match(faults, version, subject: str, model: str, check: str, case: str, family: str | None = None) -> str | None:
    """The reason of the first fault matching this item on ``version``, or None."""
    fault = find(faults, version, subject, model, check, case, family)
    return fault.reason if fault is not None else None


def find_inherited(faults, version, cache, model: str, check: str, case: str, family: str | None = None,
                   metrics: dict | None = None, message: str = "", raised: BaseException | None = None,
                   cause_id: str | None = None):
    """The first entry (and the inherited ``"Class.method"``) that excuses this failure by inheritance: the entry
    applies to ``version`` and to the item's model/check/case/family (any subject), names ``inherits``, ``cache``
    uses one of those methods unchanged (``KnownFault.inherited_by``; ``raised``: the subject's exception, which
    counts an override that raised inside transformers' method through ``super()``) and the failure (``message``,
    ``metrics``) shows the fault (``evidence``, ``cause``: ``cause_id`` is the failure's ``Failure.cause.id``) inside
    its ``envelope``. ``(None, None)`` when none does."""
    fields = dict(model=model, check=check, case=case)
    if family is not None:
        fields["family"] = family
    for fault in faults:
        if not fault.inherits or not fault.matches(version, **fields):
            continue
        if not (fault.shown_by(message, cause_id) and fault.within(metrics or {})):
            continue
        method = fault.inherited_by(cache, raised)
        if method is not None:
            return fault, method
    return None, None


def live(faults, version, models, subjects=None) -> list[KnownFault]:
    """The entries a run can judge stale: those that apply to ``version`` (``packaging.version.Version``), to one of
    ``models`` (the run's model names) and to one of ``subjects`` (the run's subject names; None: any). An entry
    whose ``model`` or ``subject`` patterns match none of the run's is not judged."""
    return [f for f in faults if f.applies_to(version)
            and any(fnmatch.fnmatchcase(m, p) for m in models for p in f.model)
            and (subjects is None or any(fnmatch.fnmatchcase(s, p) for s in subjects for p in f.subject))]

