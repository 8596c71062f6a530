"""Conformance cases: load and validate ``conformance_cases/*.toml`` (the one source of truth for scenarios).

The built-in case files live in the repository's top-level ``conformance_cases/`` folder, one file per check family
(``<family>.toml``: every case in it runs a check of that family), shipped in the wheel as the package data
``kvconform/conformance_cases/`` (see ``builtin_cases_dir``).

A case file holds an optional ``[defaults]`` table and a list of ``[[case]]`` tables::

    [defaults]
    batch = 2

    [[case]]
    id = "chunk8"                       # [A-Za-z0-9_.-]+, unique across all files
    check = "check_chunked_continuation" # a registered check (kvconform.checks.CHECKS)
    ops = ["prefill 12", "chunk 8", "decode 2"]
    position_ids = "auto"                # "explicit" where the forward accepts them (default), or force
                                         # "explicit" / "implicit" (the model derives them from the cache)

Every key, its type and allowed values are listed in ``KEYS``; the keys of ``params`` are the check's own, declared
with it (``@register(..., params={key: Param})``): an unknown key (with a "did you mean" for a near miss), a wrong
type, a value out of range and a missing required key are errors, and the defaults of the keys a case omits are
filled in. ``models`` entries are zoo names, or checkpoint folders written as paths (``./my-model``, stored as the
checkpoint's name). Any problem raises ``CaseFileError`` naming the file, the case id, the key and what is allowed;
the plugin turns it into a pytest usage error (exit code 4).

A case valid key by key is then checked against its check (``CheckInfo.case_problem``: the ``OpRule`` and the
``validate`` rule declared with ``@register``) and against what no check can want: a ``crop N`` of more tokens than
the cache holds at that point (unless ``params.crop_beyond_held``, a key of the crop checks), a ``params.padding``
that is not one count per row, ``models`` of which none has every ``requires`` feature (the case would never run).
"""

from __future__ import annotations

import copy
import difflib
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvconform.memo import MEMO
from kvconform.outcomes import UsageError
# the op vocabulary is kvconform.ops (one table); cases.Op / cases.OP_NAMES / cases.OPS_WITH_COUNT stay importable
from kvconform.ops import OP_NAMES, OPS, OPS_WITH_COUNT, Op, tokens_held  # noqa: F401
from kvconform.oracle import DTYPES as DTYPE_TABLE

DTYPES = tuple(DTYPE_TABLE)
"""The dtype names a case may give (``oracle.DTYPES``, the one table of dtypes)."""
POSITION_MODES = ("auto", "explicit", "implicit")
TIERS = ("default", "full")
REQUIREMENTS = ("attention", "sliding", "linear_attention", "decoder_only", "encoder_decoder", "no_padding_mask")
_ID = re.compile(r"^[A-Za-z0-9_.]+$")


class CaseFileError(ValueError, UsageError):
    """A case file is malformed. ``str(err)`` names file, case id, key and the allowed values."""


class Params(Mapping):
    """A case's ``params``, built once when the case file loads, from its check's schema (``{key: Param}``,
    ``@register(..., params=...)``): the keys the case gives, each as its schema's type (``Param.value``: a number
    key given as an int is a float), and the schema's default of every key it omits (``Param.default``: each default
    in one place). A check reads ``case.params.<key>`` (the value, or None for a key of its schema without a
    default the case omits) with no re-cast; as a read-only mapping it holds the keys given or defaulted (``"key" in
    params``: given or defaulted; ``dict(params)``: the JSON of a record).

    Raises:
        AttributeError: ``params.<key>`` for a key outside the schema (a case built without one, e.g. in a test,
            answers only the keys it gives).
    """

    __slots__ = ("_values", "_keys")

    def __init__(self, values=None, keys=()):
        object.__setattr__(self, "_values", dict(values or {}))
        object.__setattr__(self, "_keys", frozenset(keys) | frozenset(self._values))

    def __getitem__(self, key):
        return self._values[key]

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __getattr__(self, key):
        if key.startswith("_"):
            raise AttributeError(key)
        if key not in self._keys:
            raise AttributeError(f"params has no key {key!r}; its check's schema has: "
                                 f"{', '.join(sorted(self._keys)) or 'none'}")
        return self._values.get(key)

    def __setattr__(self, key, value):
        raise AttributeError("a case's params are read-only")

    def __eq__(self, other):
        return dict(self._values) == (dict(other) if isinstance(other, Mapping) else other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Params({self._values!r})"

    def __reduce__(self):
        return (Params, (self._values, tuple(self._keys)))

    def __deepcopy__(self, memo):
        return Params(copy.deepcopy(self._values, memo), self._keys)


@dataclass(frozen=True)
class Case:
    """A validated case. ``ops`` is a tuple of ``Op``; ``source`` is the file it came from.

    ``models``: the model names the case is limited to (``()``: every model); ``models_full``: the wider scope it
    takes under ``--kvconform-full`` (``None``: the same as ``models``; ``()``: every model), see ``model_scope``."""

    id: str
    check: str
    source: str
    ops: tuple = ()
    position_ids: str = "auto"
    batch: int = 2
    dtype: str = "float32"
    models: tuple = ()
    models_full: tuple | None = None
    requires: tuple = ()
    max_new_tokens: int = 8
    prompt: int = 12
    encoder_len: int = 10
    tolerance_factor: float | None = None
    abs_min: float | None = None
    seed: int = 0
    description: str = ""
    tier: str = "default"
    params: Params = field(default_factory=Params, compare=False, hash=False)

    def __post_init__(self):
        if not isinstance(self.params, Params):  # a case built in code, not loaded: the keys it gives
            object.__setattr__(self, "params", Params(self.params))

    @property
    def total_tokens(self) -> int:
        """Upper bound of tokens ever held by the cache (sizes ``max_cache_len``)."""
        return sum(op.new_tokens for op in self.ops) + self.prompt + self.max_new_tokens

    def model_scope(self, full: bool) -> tuple:
        """Model names this case is limited to in a tier, ``()`` meaning every model.

        ``full``: whether the run is ``--kvconform-full``. There a default-tier case runs on ``models_full`` when the
        file gives it (``"all"`` → every model), so one case covers a few representative models by default and every
        model in the full tier, under the same id."""
        if full and self.models_full is not None:
            return self.models_full
        return self.models

    def ops_label(self, failed_at: int | None = None) -> str:
        text = " → ".join(op.label for op in self.ops)
        return text


# key: (python type(s), allowed values or None, description)
KEYS = {
    "id": (str, None, "case id, [A-Za-z0-9_.]+"),
    "check": (str, None, "name of a registered check"),
    "ops": (list, None, f"list of 'op N' strings, op in {OP_NAMES}"),
    "position_ids": (str, POSITION_MODES, "auto: explicit where accepted; explicit; implicit (from the cache)"),
    "batch": (int, None, "batch size ≥ 1"),
    "dtype": (str, DTYPES, "case dtype"),
    "models": (list, None, "zoo names / checkpoint folders (written as paths) this case is limited to (default: all)"),
    "models_full": ((list, str), None, "under --kvconform-full: a wider list of models, or \"all\", for a "
                    "default-tier case limited by models (default: models)"),
    "requires": (list, REQUIREMENTS, "model features the case needs"),
    "max_new_tokens": (int, None, "tokens to generate (generate checks)"),
    "prompt": (int, None, "prompt length (generate checks)"),
    "encoder_len": (int, None, "encoder input length for encoder-decoder models"),
    "tolerance_factor": ((int, float), None, "k in max(k·floor, abs_min)"),
    "abs_min": ((int, float), None, "abs_min in max(k·floor, abs_min)"),
    "seed": (int, None, "seed of the token generator"),
    "description": (str, None, "free text"),
    "tier": (str, TIERS, "default: runs in every run; full: only with --kvconform-full (heavier, run in CI)"),
    "params": (dict, None, "check-specific parameters (budgets, sizes): the keys its check declares (Param schema)"),
}


def _fail(path, case_id, key, problem):
    where = f"case {case_id!r}" if case_id else "[defaults]"
    raise CaseFileError(f"{path}: {where}: key {key!r}: {problem}")


def _parse_op(path, case_id, text) -> Op:
    parts = str(text).split()
    if not parts or parts[0] not in OP_NAMES:
        _fail(path, case_id, "ops", f"unknown op {text!r}; allowed ops: {', '.join(OP_NAMES)}")
    name = parts[0]
    spec = OPS[name]
    if spec.count == "required":
        if len(parts) != 2 or not parts[1].isdigit() or int(parts[1]) < spec.min_count:
            _fail(path, case_id, "ops", f"op {text!r} needs one positive count, e.g. '{name} 4'")
        return Op(name, int(parts[1]))
    if spec.count == "optional" and len(parts) == 2:  # reset B: the next sequence has batch size B
        if not parts[1].isdigit() or int(parts[1]) < spec.min_count:
            _fail(path, case_id, "ops", f"op {text!r}: {name!r} takes an optional count ≥ {spec.min_count}, "
                  f"e.g. '{name} 2'")
        return Op(name, int(parts[1]))
    if len(parts) != 1:
        _fail(path, case_id, "ops", f"op {name!r} takes no count (got {text!r})")
    return Op(name)


def _validate(path, case_id, key, value, known_checks):
    if key not in KEYS:
        _fail(path, case_id, key, f"unknown key; allowed keys: {', '.join(KEYS)}")
    typ, allowed, _ = KEYS[key]
    if isinstance(value, bool) or not isinstance(value, typ):
        names = typ.__name__ if isinstance(typ, type) else "/".join(t.__name__ for t in typ)
        _fail(path, case_id, key, f"expected {names}, got {type(value).__name__} {value!r}")
    if allowed is not None:
        for item in value if isinstance(value, list) else [value]:
            if item not in allowed:
                _fail(path, case_id, key, f"{item!r} is not allowed; allowed values: {', '.join(allowed)}")
    if key == "check" and known_checks is not None and value not in known_checks:
        _fail(path, case_id, key, f"unknown check {value!r}; allowed values: {', '.join(sorted(known_checks))}")
    if key == "id" and not _ID.match(value):
        _fail(path, case_id, key, "ids may contain only letters, digits, '_' and '.'")
    if key in ("batch", "max_new_tokens", "prompt", "encoder_len") and value < 1:
        _fail(path, case_id, key, f"must be ≥ 1, got {value}")
    if key == "models":
        for item in value:
            _model_entry(path, case_id, item)
    if key == "models_full" and (value == [] or (isinstance(value, str) and value != "all")):
        _fail(path, case_id, key, f"expected \"all\" or a non-empty list of model names, got {value!r}")


def _did_you_mean(word, candidates) -> str:
    """``"; did you mean 'x'?"`` for the nearest of ``candidates`` (a near miss), else ``";"``."""
    close = difflib.get_close_matches(str(word), list(candidates), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ";"


def _model_entry(path, case_id, item) -> str:
    """The model name a ``models`` entry stands for: a zoo name as is, a checkpoint folder written as a path
    (``./m``, ``/abs/m``, ``~/m``, ``ckpt/m``) as its checkpoint name (``zoo.checkpoint_name``). A bare word that is
    not a zoo name is an error (a typo such as ``"lama"``)."""
    from kvconform import zoo

    if not isinstance(item, str) or not item:
        _fail(path, case_id, "models", f"entries are strings (zoo names or checkpoint paths), got {item!r}")
    if item in zoo.ALL_NAMES:
        return item
    if "/" in item or "\\" in item or item.startswith(("~", ".")):
        return zoo.checkpoint_name(item)
    _fail(path, case_id, "models", f"{item!r} is not a zoo name{_did_you_mean(item, zoo.ALL_NAMES)} zoo names: "
          f"{', '.join(zoo.ALL_NAMES)}; write a checkpoint folder as a path (e.g. './{item}')")


def _schema(known_checks, check):
    """The ``params`` schema (``{key: Param}``) of ``check`` when ``known_checks`` is the registry, else None."""
    return getattr(_info(known_checks, check), "params", None)


def _info(known_checks, check):
    """The ``CheckInfo`` of ``check`` when ``known_checks`` is the registry, else None."""
    return known_checks.get(check) if isinstance(known_checks, dict) else None


def _validate_for_check(path, case, info, known_checks):
    """The check's own rules for ``case`` (``CheckInfo.case_problem``: its ``OpRule`` and ``validate``)."""
    found = info.case_problem(case) if hasattr(info, "case_problem") else None
    if found:
        key, problem = found
        _fail(path, case.id, key, problem)


def _ops_text(ops) -> str:
    return "[" + ", ".join(repr(f"{op.name} {op.n}" if op.n or op.name in OPS_WITH_COUNT else op.name)
                           for op in ops) + "]"


def _validate_held(path, case, known_checks):
    """Follow the tokens the cache holds through ``case.ops`` (prefill / chunk / decode add, crop removes, reset
    empties; fork, reorder, repeat and select keep the length) and reject a ``crop N`` of more tokens than are held —
    a crop that would silently remove less than it says. Cropping exactly everything (to zero) is allowed. A check
    whose cases may crop past the start on purpose (the edge case "empty the cache or refuse clearly"), or read
    ``crop N`` as a length to keep, says so in its ``OpRule`` (``crop_past_start``, ``crop_keeps``: the params that
    mark such a case); nothing is checked for a case that sets them. Without the registry (``known_checks`` not
    the ``{name: CheckInfo}`` dict) a check's rules are unknown and nothing is checked."""
    if not isinstance(known_checks, dict):
        return
    rule = getattr(_info(known_checks, case.check), "ops", None)
    if rule is not None and rule.crops_past_start(case):
        return
    for i, (op, held) in enumerate(zip(case.ops, [0, *tokens_held(case.ops)])):
        if op.name == "crop" and op.n > held:
            edges = {name: info.ops.crop_past_start for name, info in sorted(known_checks.items())
                     if getattr(info.ops, "crop_past_start", None)}
            declaring = list(edges)
            fix = (f"crop at most {held} (crop {held} empties the cache)" if held else
                   "prefill before the crop")
            mark = " or ".join(sorted({f"params.{key} = true" for key in edges.values()}))
            edge = (f"; to crop past the start on purpose (the edge case), set {mark} "
                    f"({', '.join(declaring)} take it)" if declaring else "")
            if case.check not in declaring and declaring:
                edge = f"; cropping past the start is the edge case of {', '.join(declaring)}, not of {case.check}"
            _fail(path, case.id, "ops", f"op {i + 1} 'crop {op.n}' removes {op.n} token{'s' * (op.n != 1)} "
                  f"from a cache holding {held} "
                  f"(ops {_ops_text(case.ops)}): {fix}{edge}")


def _validate_op_batch(path, case):
    """An op that needs more rows than the case's ``batch`` (``OpSpec.min_batch``: ``swap_rows`` exchanges two rows)
    is an error, while the batch is still the case's (before an op that resizes or renews the rows)."""
    for i, op in enumerate(case.ops):
        spec = OPS[op.name]
        if spec.rows in ("resize", "new"):
            return
        if case.batch < spec.min_batch:
            _fail(path, case.id, "batch", f"op {i + 1} {op.name!r} needs batch ≥ {spec.min_batch}; got batch = "
                  f"{case.batch}: raise batch or remove the op")


def _validate_padding(path, case):
    """``params.padding`` has one count per row of ``batch``, each leaving a real token in its row's prompt (the
    first ``prefill N``; the ``prompt`` length for a check without ops)."""
    padding = case.params.get("padding")
    if padding is None:
        return
    if len(padding) != case.batch:
        _fail(path, case.id, "params.padding", f"{len(padding)} pad count(s) {list(padding)} for batch = {case.batch}: "
              f"give one count per row (e.g. {([0] + [3] * (case.batch - 1))[:case.batch]}) or change batch")
    first = case.ops[0] if case.ops else None
    length = first.n if first is not None and first.name == "prefill" else case.prompt if first is None else None
    if length is not None:
        what = f"'prefill {length}'" if first is not None else f"prompt = {length}"
        for row, pad in enumerate(padding):
            if pad >= length:
                _fail(path, case.id, "params.padding", f"row {row} is padded by {pad} of its {length} prompt tokens "
                      f"({what}): every row needs a real token; pad at most {length - 1}")


_FEATURES: dict = MEMO.table("cases.features")


def _zoo_features(name) -> frozenset:
    """The model features (``REQUIREMENTS``) of zoo family ``name``, from its config (no weights built; memoised)."""
    if name not in _FEATURES:
        from kvconform import zoo

        config = zoo.zoo_config(name)
        types, _ = zoo._layer_types(config)
        probe = zoo.ZooModel(name, None, config, None, bool(getattr(config, "is_encoder_decoder", False)), types, None)
        feats = probe.features
        _FEATURES[name] = frozenset(feats)
    return _FEATURES[name]


def _validate_requirements(path, case):
    """``models`` and ``requires`` together: when every model is a zoo name and none has every requirement, the
    case would never run — an error naming both and the zoo models that qualify."""
    from kvconform import zoo

    if not case.models or not case.requires or any(m not in zoo.ZOO_NAMES for m in case.models):
        return
    if any(set(case.requires) <= _zoo_features(m) for m in case.models):
        return
    fits = [m for m in zoo.ZOO_NAMES if set(case.requires) <= _zoo_features(m)]
    _fail(path, case.id, "requires", f"no model of models = {list(case.models)} has every feature of requires = "
          f"{list(case.requires)}: the case would never run; zoo models that have them: "
          f"{', '.join(fits) or 'none'} — change 'models' or 'requires'")


def _validate_params(path, case_id, check, params, schema) -> Params:
    """``params`` checked against ``schema`` (unknown key, type, range, choices, required), as ``Params``: each
    value as its schema's type (``Param.value``), the defaults of the omitted keys filled in."""
    for key, value in params.items():
        if key not in schema:
            allowed = (f"allowed keys: {', '.join(sorted(schema))}" if schema else f"{check} takes no params")
            _fail(path, case_id, f"params.{key}", f"unknown key for {check}{_did_you_mean(key, schema)} {allowed}")
        problem = schema[key].problem(value)
        if problem:
            _fail(path, case_id, f"params.{key}", problem)
    out = {key: schema[key].value(value) for key, value in params.items()}
    for key, spec in schema.items():
        if key in out:
            continue
        if spec.required:
            _fail(path, case_id, f"params.{key}", f"missing (required by {check}): {spec.describe()}"
                  + (f" — {spec.doc}" if spec.doc else ""))
        if spec.default is not None:
            out[key] = copy.deepcopy(spec.default)
    return Params(out, schema)


def _validate_scope(path, case_id, merged):
    """``models_full`` widens a default-tier case that ``models`` limits; it must keep every model of ``models``."""
    if "models_full" not in merged:
        return
    if merged.get("tier", "default") == "full":
        _fail(path, case_id, "models_full", "only for default-tier cases; a full-tier case is limited by 'models'")
    models = merged.get("models", [])
    if not models:
        _fail(path, case_id, "models_full", "the case already runs on every model ('models' is not set)")
    if merged["models_full"] != "all":
        missing = [m for m in models if m not in merged["models_full"]]
        if missing:
            _fail(path, case_id, "models_full", f"must include every model of 'models'; missing {missing}")


def builtin_cases_dir() -> Path:
    """The folder of the built-in case files (``conformance_cases/*.toml``).

    Found from the imported package's own location (never through the import system, which in a checkout run with
    ``PYTHONPATH`` could hand out another copy's folder, e.g. through an editable install's finder), in this order:

    1. ``<checkout>/conformance_cases/`` beside the ``kvconform/`` package folder, where ``<checkout>`` holds a
       ``pyproject.toml`` — a source checkout, imported through ``PYTHONPATH=<checkout>`` or an editable install
       (whose import finder cannot serve the mapped folder: it has no ``__init__.py``);
    2. ``kvconform/conformance_cases/`` next to the package's modules — an installed wheel (setuptools maps the
       repository's top-level ``conformance_cases/`` onto the package data ``kvconform.conformance_cases``).

    Raises:
        CaseFileError: none of these holds a case folder (a broken install), naming the places looked in.
    """
    package = Path(__file__).resolve().parent
    candidates = [package / "conformance_cases"]
    if (package.parent / "pyproject.toml").is_file():
        candidates.insert(0, package.parent / "conformance_cases")
    for folder in candidates:
        if folder.is_dir():
            return folder
    raise CaseFileError(f"built-in case files not found (looked in {', '.join(map(str, candidates))}): "
                        f"reinstall kvconform")


def load_case_file(path, known_checks=None) -> list[Case]:
    """Load and validate one TOML case file.

    Args:
        path: the ``.toml`` file.
        known_checks: the check registry ``{name: CheckInfo}`` (validates ``check`` and ``params``), a set of
            check names (validates ``check`` only), or ``None`` (neither).

    Raises:
        CaseFileError: unreadable TOML, unknown key, wrong type, value not allowed, missing id/check, bad op, a
            ``params`` key its check does not declare or a bad value of one, an unknown model name; a case valid
            key by key but wrong for its check (its ``OpRule`` — ops it ignores, an op its driver refuses, a missing
            op —, or its own ``validate`` rule); a ``crop N`` of more tokens than the cache holds (unless its
            check's ``OpRule`` names a param the case sets to crop past the start on purpose); a ``padding`` list
            that is not one count per row; ``models`` of which none has every ``requires`` feature.
    """
    path = str(path)
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise CaseFileError(f"{path}: cannot read case file: {exc}") from None
    unknown = set(data) - {"defaults", "case"}
    if unknown:
        raise CaseFileError(f"{path}: unknown top-level table(s) {sorted(unknown)}; allowed: 'defaults', 'case'")
    defaults = data.get("defaults", {})
    for key, value in defaults.items():
        if key in ("id", "check"):
            _fail(path, None, key, "may not have a default")
        _validate(path, None, key, value, known_checks)
    cases = []
    raw_cases = data.get("case", [])
    if not isinstance(raw_cases, list):
        raise CaseFileError(f"{path}: 'case' must be an array of tables ([[case]])")
    errors: list[str] = []
    for index, raw in enumerate(raw_cases):
        try:
            cases.append(_load_case(path, index, raw, defaults, known_checks))
        except CaseFileError as exc:  # every case's first problem, all at once (one run to fix the file)
            errors.append(str(exc))
    if errors:
        more = f" ({len(errors)} cases with errors)" if len(errors) > 1 else ""
        raise CaseFileError(errors[0] if not more else errors[0] + more + "".join(f"\n  {e}" for e in errors[1:]))
    return cases


def _load_case(path: str, index: int, raw: dict, defaults: dict, known_checks) -> Case:
    """One ``[[case]]`` table of ``path`` validated (``load_case_file``), or ``CaseFileError`` at its first problem."""
    case_id = raw.get("id", f"#{index}")
    for required in ("id", "check"):
        if required not in raw:
            _fail(path, case_id, required, "missing (required)")
    merged = {**defaults, **raw}
    problems: list[str] = []  # every key's problem and every malformed op of the case, at once
    for key, value in merged.items():
        try:
            _validate(path, case_id, key, value, known_checks)
        except CaseFileError as exc:
            problems.append(str(exc))
    ops = []
    for op in merged.get("ops", ()) if isinstance(merged.get("ops", ()), list) else ():
        try:
            ops.append(_parse_op(path, case_id, op))
        except CaseFileError as exc:
            problems.append(str(exc))
    if problems:
        raise CaseFileError("\n  ".join(problems))
    _validate_scope(path, case_id, merged)
    merged["ops"] = tuple(ops)
    merged["models"] = tuple(_model_entry(path, case_id, m) for m in merged.get("models", ()))
    merged["requires"] = tuple(merged.get("requires", ()))
    if "models_full" in merged:
        merged["models_full"] = () if merged["models_full"] == "all" else tuple(
            _model_entry(path, case_id, m) for m in merged["models_full"])
    merged["params"] = dict(merged.get("params", {}))
    schema = _schema(known_checks, merged["check"])
    if schema is not None:
        merged["params"] = _validate_params(path, case_id, merged["check"], merged["params"], schema)
    case = Case(source=path, **merged)
    info = _info(known_checks, case.check)
    if info is not None:
        _validate_for_check(path, case, info, known_checks)
    _validate_held(path, case, known_checks)
    _validate_op_batch(path, case)
    _validate_padding(path, case)
    _validate_requirements(path, case)
    return case


def case_files(paths) -> list[Path]:
    """The case files ``paths`` name: each file, and each folder's ``*.toml`` in name order.

    Raises:
        CaseFileError: a path that is neither a file nor a folder.
    """
    files: list[Path] = []
    for extra in paths or ():
        p = Path(extra)
        if p.is_dir():
            files.extend(sorted(p.glob("*.toml")))
        elif p.is_file():
            files.append(p)
        else:
            raise CaseFileError(f"{extra}: no such case file or folder")
    return files


def load_cases(paths=None, known_checks=None) -> list[Case]:
    """All cases from the built-in folder plus ``paths`` (files or folders of ``*.toml``), sorted by id.
    ``known_checks``: as for ``load_case_file``.

    Raises:
        CaseFileError: a malformed file, a missing path, or a duplicated case id (names both files).
    """
    files = [*sorted(builtin_cases_dir().glob("*.toml")), *case_files(paths)]
    seen: dict[str, str] = {}
    cases = []
    for f in files:
        for case in load_case_file(f, known_checks):
            if case.id in seen:
                raise CaseFileError(f"{f}: case {case.id!r}: key 'id': duplicate, already defined in {seen[case.id]}")
            seen[case.id] = str(f)
            cases.append(case)
    return sorted(cases, key=lambda c: c.id)


def model_requirements_unmet(case: Case, features: set) -> str | None:
    """The reason ``case`` does not apply to a model with ``features``, or None."""
    missing = [r for r in case.requires if r not in features]
    if missing:
        return f"case {case.id} requires a model with {', '.join(missing)}"
    return None
