"""kvconform's command-line and ini options: one table (``OPTIONS``, an ``Option`` each), read at parse time, and
the readers and usage checks of their values.

A flag is one ``Option(...)`` entry here: its flag (its ``dest`` is derived: ``--kvconform-json`` →
``kvconform_json``), its ``pytest --help`` text, its ini twin (type, help, default), whether an ini value is a path
relative to the ini file, and whether the ``reproduce:`` line of a failure repeats it. ``add_options`` registers the
table with pytest; ``refuse_flags_without_kvconform``, ``reproduce_args`` and the ini path rule read the table, so
none of them names a flag again. Torch-free at the top level (the plugin imports it in every pytest run).
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from typing import Any, Callable

import pytest

from kvconform.outcomes import UsageError, with_article
from kvconform.run_options import POWER_MODES, RunOptions

OPTIONS: list[Option] = []
"""Every option, in ``pytest --help`` order (each ``Option`` appends itself)."""


@dataclass(frozen=True)
class Option:
    """One kvconform option: a command-line flag and, where it has one, its ini twin.

    Attributes:
        flag: the command-line flag (``--kvconform-...``); ``dest`` (the option and ini name) is derived from it.
        help: its ``pytest --help`` text.
        action: ``"store_true"`` (a switch), ``"append"`` (repeatable), None (one value).
        metavar: the value's placeholder in ``--help``.
        type: converts the value (command line and ini string), e.g. ``float``; None: a string.
        ini: the ini twin's type (``"bool"``, ``"linelist"``, ``"string"``); None: no ini twin (the flag only).
        ini_help: the ini twin's help text.
        ini_default: the ini twin's default (also the value when neither is given).
        paths: how an ini value is a path relative to the ini file's folder: ``"path"``, ``"cache"`` (a
            ``path/file.py:Attr`` spec; module specs stay), ``"model"`` (a zoo name stays); None: not a path.
        reproduce: whether a failure's ``reproduce:`` line repeats it: ``"paths"`` (each, made absolute),
            ``"switch"`` (when set), ``"value"`` (when not ``ini_default``); None: not repeated.
        shown: how ``reproduce`` writes a value.
    """

    flag: str
    help: str
    action: str | None = None
    metavar: str | None = None
    type: Callable | None = None
    ini: str | None = None
    ini_help: str = ""
    ini_default: Any = None
    paths: str | None = None
    reproduce: str | None = None
    shown: Callable[[Any], str] = str

    def __post_init__(self):
        OPTIONS.append(self)

    @property
    def dest(self) -> str:
        """The option's name for ``config.getoption`` and its ini name (``--kvconform-json`` → ``kvconform_json``)."""
        return self.flag.removeprefix("--").replace("-", "_")


# ------------------------------------------------------------------------------------------------------ the table
ACTIVE = Option("--kvconform", action="store_true",
                help="run the kvconform conformance suite (injected; works in an empty folder)",
                ini="bool", ini_help="run the kvconform suite (same as --kvconform)", ini_default=False)
CACHE = Option("--kvconform-cache", action="append", metavar="SPEC",
               help="add a subject: 'pkg.module:Attr' or 'path/file.py:Attr' (a Cache subclass or factory); "
                    "repeatable",
               ini="linelist", ini_help="extra subjects (same as --kvconform-cache)", ini_default=[], paths="cache")
SUBJECT = Option("--kvconform-subject", action="append", metavar="NAME",
                 help="run only these subjects (by name, e.g. your own cache's); kvconform's ReferenceCache still "
                      "gives every failure its oracle line; repeatable",
                 ini="linelist", ini_help="subjects to run (same as --kvconform-subject)", ini_default=[])
MODEL = Option("--kvconform-model", action="append", metavar="SPEC",
               help="limit the run to these models: a zoo name, a local checkpoint folder or the adapter of a model "
                    "written from scratch (MODULE:ATTR or FILE.py:ATTR); repeatable",
               ini="linelist", ini_help="models to run (same as --kvconform-model)", ini_default=[], paths="model")
CASES = Option("--kvconform-cases", action="append", metavar="PATH",
               help="extra case files or folders of *.toml (added to the built-in cases); repeatable",
               ini="linelist", ini_help="extra case files (same as --kvconform-cases)", ini_default=[], paths="path",
               reproduce="paths")
FAULTS = Option("--kvconform-known-faults", action="append", metavar="PATH",
                help="extra known-faults files (same format as kvconform/known_faults.toml), read after the "
                     "bundled one; repeatable",
                ini="linelist", ini_help="extra known-faults files (same as --kvconform-known-faults)", ini_default=[],
                paths="path", reproduce="paths")
JSON = Option("--kvconform-json", metavar="PATH", help="write the JSON report (schema 1) to PATH",
              ini="string", ini_help="JSON report path (same as --kvconform-json)", ini_default="", paths="path")
HTML = Option("--kvconform-html", metavar="PATH",
              help="write the conformance page to PATH: one self-contained HTML file (colour matrices, "
                   "filters, every item's message and reproduce line)",
              ini="string", ini_help="HTML page path (same as --kvconform-html)", ini_default="", paths="path")
STRICT = Option("--kvconform-strict", action="store_true",
                help="ignore the bundled list of known upstream faults: they fail instead of xfail",
                ini="bool", ini_help="known upstream faults fail (same as --kvconform-strict)", ini_default=False,
                reproduce="switch")
FULL = Option("--kvconform-full", action="store_true",
              help="also run the heavier tier (cases with tier = \"full\", default cases on their models_full: "
                   "compile on every model, long fuzzing, long contexts); meant for CI",
              ini="bool", ini_help="run the heavier tier (same as --kvconform-full)", ini_default=False,
              reproduce="switch")
SELFTEST = Option("--kvconform-selftest", action="store_true",
                  help="run kvconform's bundled faulty caches through the suite instead of the subjects, and "
                       "print the share caught per check family",
                  ini="bool", ini_help="run the selftest (same as --kvconform-selftest)", ini_default=False)
TIMEOUT = Option("--kvconform-timeout", type=float, metavar="SECONDS",
                 help="fail an item whose subject runs longer than this (default 300; 0 disables)",
                 ini="string", ini_help="per-item timeout in seconds (same as --kvconform-timeout)", ini_default="300",
                 reproduce="value", shown="{:g}".format)
DEVICE = Option("--kvconform-device", metavar="DEVICE", help="torch device for the models under test (default: cpu)",
                ini="string", ini_help="torch device (same as --kvconform-device)", ini_default="cpu",
                reproduce="value", shown=shlex.quote)
TRUST = Option("--kvconform-trust-remote-code", action="store_true",
               help="run the own code of model repositories given with --kvconform-model (config.json auto_map, "
                    "*.py files): your explicit consent; their own cache classes become subjects",
               ini="bool", ini_help="run model repositories' own code (same as --kvconform-trust-remote-code)",
               ini_default=False, reproduce="switch")
SEED = Option("--kvconform-fuzz-seed", metavar="N|random",
              help="draw other random op programs in the fuzz family (default: fixed seeds, the same programs "
                   "every run); 'random' picks N and prints it in the header to replay",
              reproduce="value")
SHARD = Option("--kvconform-shard", metavar="I/N|auto",
               help="run only share I of N (1 ≤ I ≤ N) of the items: deterministic and balanced, for CI jobs "
                    "on several machines; 'auto' reads the share from GitLab's CI_NODE_INDEX/CI_NODE_TOTAL or "
                    "Buildkite's BUILDKITE_PARALLEL_JOB/_COUNT, 'auto/N' from a Kubernetes indexed Job's "
                    "JOB_COMPLETION_INDEX; merge their JSON reports with kvconform-merge")
DURATIONS = Option("--kvconform-durations", metavar="REPORT",
                   help="balance --kvconform-shard by the items' measured durations in an earlier JSON report "
                        "(its duration_s per item); items it lacks fall back to the static cost estimate",
                   ini="string", ini_help="JSON report whose durations balance the shards (same as "
                                          "--kvconform-durations)", ini_default="", paths="path")
POWER = Option("--kvconform-power", metavar="off|sampled|full",
               help="power on the subject's own cache: after an item passes, re-run its check on mutants of the "
                    "subject made at its interface (a stale or dropped token, batch ops ignoring their indices, "
                    "reset / crop doing nothing, a hidden leak) and print a power table per subject (killed / "
                    "blind / n/a). 'sampled' (default): subjects that are not kvconform's own, a few items per "
                    "family and mutant; 'full': every candidate item of every subject, built-in ones too; 'off'",
               ini="string", ini_help="power pass: off, sampled or full (same as --kvconform-power)",
               ini_default="sampled")


# ------------------------------------------------------------------------------------------------------ reading
def add_options(parser) -> None:
    """Register every ``Option`` of the table with pytest (``pytest_addoption``): its flag in the ``kvconform``
    group and its ini twin."""
    group = parser.getgroup("kvconform", "KV-cache conformance (kvconform)")
    for option in OPTIONS:
        kwargs: dict[str, Any] = {"dest": option.dest, "default": None, "help": option.help}
        if option.action is not None:
            kwargs["action"] = option.action
        if option.metavar is not None:
            kwargs["metavar"] = option.metavar
        if option.type is not None:
            kwargs["type"] = option.type
        group.addoption(option.flag, **kwargs)
    for option in OPTIONS:
        if option.ini is not None:
            parser.addini(option.dest, option.ini_help, type=None if option.ini == "string" else option.ini,
                          default=option.ini_default)


def opt(config, option: Option):
    """Command-line value if given, else the ini twin (paths in it relative to the ini file's folder)."""
    value = config.getoption(option.dest)
    if value is not None or option.ini is None:
        return value
    try:
        value = config.getini(option.dest)
    except (ValueError, pytest.UsageError) as exc:  # pytest read the value as its type and could not: name the key
        where = f" in {config.inipath}" if config.inipath is not None else ""
        fix = f"; write {option.dest} = true (or false)" if option.ini == "bool" else ""
        raise pytest.UsageError(f"kvconform: ini setting {option.dest}{where}: {exc}{fix}") from None
    if option.paths and value and config.inipath is not None:
        base = config.inipath.parent
        value = ([_from_ini(base, option, v) for v in value] if isinstance(value, list)
                 else _from_ini(base, option, value))
    return value


def _from_ini(base, option: Option, value: str) -> str:
    """A path given in an ini file is relative to that file's folder (pytest's convention for ini paths), so the
    run does not depend on the folder pytest is started from. Module specs (``pkg.mod:Attr``) and zoo names stay."""
    if option.paths == "cache":
        path, sep, attr = value.rpartition(":")
        if sep and path.endswith(".py") and not os.path.isabs(os.path.expanduser(path)):
            return f"{base / path}:{attr}"
        return value
    if os.path.isabs(os.path.expanduser(value)):
        return value
    if option.paths == "model" and "/" not in value and not value.startswith(".") and not (base / value).is_dir():
        return value  # a zoo family
    return str(base / value)


def is_active(config) -> bool:
    return bool(opt(config, ACTIVE))


def refuse_flags_without_kvconform(config) -> None:
    """A ``--kvconform-*`` flag on the command line without ``--kvconform`` would check nothing and exit 0 with the
    project's own tests: a usage error (exit 4) instead. Ini settings (``kvconform_cache = ...``) stay allowed — a
    project may keep them in its ini file for the runs that add ``--kvconform``.

    Raises:
        pytest.UsageError: naming the flags given and the fix.
    """
    given = [option.flag for option in OPTIONS if option is not ACTIVE and config.getoption(option.dest) is not None]
    if given:
        raise pytest.UsageError(
            f"kvconform: {', '.join(given)} given without --kvconform, so nothing would be checked; add --kvconform "
            f"to run the conformance suite (or set kvconform = true in the ini file)")


def timeout_s(config) -> float:
    """``--kvconform-timeout`` (or its ini twin) in seconds.

    Raises:
        ValueError: the ini value is not a number.
    """
    value = config.getoption(TIMEOUT.dest)
    return float(config.getini(TIMEOUT.dest) if value is None else value)


def reproduce_args(config, fuzz_seed: int | None) -> tuple:
    """The flags of this run that change what an item does (the table's ``reproduce`` entries), shell-quoted, for
    its ``reproduce:`` line (paths made absolute, so that the line works from any folder). ``fuzz_seed``: the
    run's resolved seed (``random`` drawn)."""
    resolved = {TIMEOUT.dest: timeout_s(config), DEVICE.dest: opt(config, DEVICE) or DEVICE.ini_default,
                SEED.dest: fuzz_seed}
    args: list[str] = []
    for option in OPTIONS:
        if option.reproduce == "paths":
            for path in opt(config, option) or ():
                args += [option.flag, shlex.quote(os.path.abspath(path))]
        elif option.reproduce == "switch":
            if opt(config, option):
                args.append(option.flag)
        elif option.reproduce == "value":
            value = resolved[option.dest] if option.dest in resolved else opt(config, option)
            default = option.type(option.ini_default) if option.type and option.ini_default is not None \
                else option.ini_default
            if value is not None and value != default:
                args += [option.flag, option.shown(value)]
    return tuple(args)


# ------------------------------------------------------------------------------------------------------ usage

def check_usage(config) -> None:
    """Usage errors (exit 4, one line) for the option values that would otherwise fail every item or the end of
    the run: the JSON report path, the durations report (``--kvconform-durations``: readable, a schema-1 report, and
    only with ``--kvconform-shard``), the per-item timeout, the torch device.

    Raises:
        pytest.UsageError: naming the option, the value and the cause.
    """
    from kvconform.report import json_path_problem

    for option in (JSON, HTML):
        path = opt(config, option)
        if path and (problem := json_path_problem(path)):
            raise pytest.UsageError(f"kvconform: {option.flag} {path!r}: {problem}")
    durations = opt(config, DURATIONS)
    if durations:
        from kvconform.merge import read_durations

        try:
            read_durations(durations)
        except UsageError as exc:
            raise pytest.UsageError(f"kvconform: {DURATIONS.flag} {durations!r}: {exc}") from None
        if not opt(config, SHARD):
            raise pytest.UsageError(f"kvconform: {DURATIONS.flag} {durations!r} balances shards, but no "
                                    f"--kvconform-shard is given: add --kvconform-shard I/N (or auto)")
    try:
        timeout = timeout_s(config)
    except ValueError:
        raise pytest.UsageError(f"kvconform: kvconform_timeout {config.getini(TIMEOUT.dest)!r}: not a number") \
            from None
    if timeout < 0:
        raise pytest.UsageError(f"kvconform: --kvconform-timeout {timeout:g}: must be ≥ 0 (0 disables the timeout)")
    power_mode(config)
    device = opt(config, DEVICE) or "cpu"
    if device == "cpu":
        return  # the default; torch is not imported for it here, so that usage errors found later come at once
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise pytest.UsageError(f"kvconform: --kvconform-device {device!r}: not a torch device ({exc})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"kvconform: --kvconform-device {device!r}: CUDA is not available in this torch "
                                f"({torch.__version__})")
    if dev.type not in ("cpu", "cuda"):
        raise pytest.UsageError(f"kvconform: --kvconform-device {device!r}: kvconform runs on cpu or cuda")


def power_mode(config) -> str:
    """``--kvconform-power`` (or its ini twin): ``"off"``, ``"sampled"`` (the default) or ``"full"``
    (``run_options.POWER_MODES``).

    Raises:
        pytest.UsageError: another value, naming it and the allowed ones.
    """
    value = str(opt(config, POWER) or "sampled").strip().lower()
    if value not in POWER_MODES:
        raise pytest.UsageError(f"kvconform: --kvconform-power {value!r}: must be one of {', '.join(POWER_MODES)} "
                                f"(sampled: the default; full: every candidate item, built-in subjects too)")
    return value


def run_options(config) -> RunOptions:
    """This pytest run's ``RunOptions``: every option of the table read once (command line, else its ini twin;
    ``check_usage`` has judged them), the fuzz seed and the shard resolved, the reproduce line's flags; every option
    also by its short name in ``flags``, so that code below the plugin reads a new flag as
    ``options.get("foo_bar")`` with nothing but its ``Option`` entry added. ``--kvconform-selftest`` runs no power
    pass.

    Raises:
        pytest.UsageError: a bad value (exit 4).
    """
    seed = read_fuzz_seed(config)
    try:
        return RunOptions(
            strict=bool(opt(config, STRICT)), full=bool(opt(config, FULL)), device=opt(config, DEVICE) or "cpu",
            timeout=timeout_s(config), fuzz_seed=seed, power="off" if opt(config, SELFTEST) else power_mode(config),
            trust_remote_code=bool(opt(config, TRUST)), shard=read_shard(config),
            reproduce_args=reproduce_args(config, seed),
            flags=tuple((o.dest.removeprefix("kvconform_"), opt(config, o)) for o in OPTIONS))
    except UsageError as exc:
        raise pytest.UsageError(f"kvconform: {exc}") from None


def refuse_mistyped_specs(config) -> None:
    """The controller (or a run without workers), at configure time: the ``--kvconform-model`` specs the file system
    rules out (``plan.spec_problem``, with a "did you mean" for a zoo name) and the ``--kvconform-cache`` specs whose
    source rules them out (``spec_problem_before_import``: a class-name typo, a missing file or module, a syntax
    error) are usage errors before any worker starts, and without importing torch. A spec that needs its import to be
    judged is judged where the session is built, first of all (``session.build_session``). Measured on a loaded
    2-core machine (load 3.6-3.9) with the default two workers: a class-name typo 27.0 s to the error before, a
    model-name typo 7.4 s before.

    Raises:
        pytest.UsageError: the first spec refused, with the message the session would give.
    """
    from kvconform.plan import spec_problem

    trust = bool(opt(config, TRUST))
    for spec in opt(config, MODEL) or ():
        if problem := spec_problem(spec, trust):
            raise pytest.UsageError(f"kvconform: {problem}")
    caches = opt(config, CACHE) or ()
    if caches:
        from kvconform.subjects.resolve import spec_problem_before_import

        for spec in caches:
            if problem := spec_problem_before_import(spec):
                raise pytest.UsageError(f"kvconform: {problem}")
    refuse_malformed_files(config)


def refuse_malformed_files(config) -> None:
    """The controller (or a run without workers), at configure time: the user's case files (``--kvconform-cases``)
    and known-faults files (``--kvconform-known-faults``) read with the checks' registry left out — a missing path,
    TOML syntax, an unknown key, a malformed op or value, a duplicate id within them. Torch is not imported for it
    (transformers' configuration classes are, for a case that scopes ``requires`` to zoo models). What needs the
    registry or the built-in cases (a check name, a check's own params, a name that matches no check, an id that a
    built-in case has) is judged where the session is built (``session.build_session``), with the same message
    form. Measured on a quiet 2-core machine: a malformed
    case file 5.7 s to its error through the workers before, under 1 s now.

    Raises:
        pytest.UsageError: the first problem, as the session would word it.
    """
    case_paths, fault_paths = opt(config, CASES) or (), opt(config, FAULTS) or ()
    if not case_paths and not fault_paths:
        return
    from kvconform.cases import case_files, load_case_file
    from kvconform.known_faults import load_all

    try:
        for path in case_files(case_paths):  # the user's own files: the built-in ones are checked by the tests
            load_case_file(path)
        if fault_paths:
            load_all(fault_paths)
    except UsageError as exc:  # CaseFileError, KnownFaultsError
        raise pytest.UsageError(f"kvconform: {exc}") from None


def refuse_bad_subjects(config) -> None:
    """An xdist controller, before its workers start: each ``--kvconform-subject`` against the built-in names
    (``session._select_subjects``' message), where nothing else can add a subject (a ``--kvconform-cache`` spec, a
    ``pytest_kvconform_caches`` hook, a model adapter, a checkpoint's own code). Torch is not imported.

    A ``--kvconform-cache`` spec is not imported here: what its source rules out is refused before
    (``refuse_mistyped_specs``), and what needs its import (a class that is not a cache, a constructor that needs
    arguments kvconform cannot pass, a declaration or budget-key typo, a name already taken, a subject-name typo
    beside it) is judged first of all where the session is built (``session.build_session``), in the workers.
    Importing it here meant importing transformers (its module does) in the controller before the workers start and
    import it again: measured on a 2-core machine, a cache author's run (``--kvconform-cache mine.py:MyCache
    --kvconform-subject MyCache``, 397 items) took 17.6 s wall with that import, 12.7 s without; a constructor that
    needs an argument reaches its error in 5.3 s through the workers, 4.2 s through the controller.

    Raises:
        pytest.UsageError: a subject name that is neither built in nor added, with the closest name.
    """
    from kvconform.subjects.builtin import BUILTIN_NAMES

    only = opt(config, SUBJECT) or ()
    if (not only or opt(config, CACHE) or opt(config, TRUST)
            or config.pluginmanager.hook.pytest_kvconform_caches.get_hookimpls()):
        return
    from kvconform.sources import source_of

    if any(source_of(m).brings_subjects for m in opt(config, MODEL) or ()):  # a model adapter's own caches
        return
    import difflib

    names = list(BUILTIN_NAMES)
    for name in only:
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise pytest.UsageError(f"kvconform: --kvconform-subject {name!r}: no such subject{hint} (subjects of "
                                    f"this run: {', '.join(names)}; add yours with --kvconform-cache)")


def read_fuzz_seed(config) -> int | None:
    """``--kvconform-fuzz-seed``: None (fixed seeds), an int, or a random int for ``random`` (the header prints it).
    Under xdist the controller draws it and the workers read it back from their ``workerinput``.

    Raises:
        pytest.UsageError: neither an integer ≥ 0 nor ``random``.
    """
    value = config.getoption(SEED.dest)
    worker = getattr(config, "workerinput", None)
    if worker is not None and "kvconform_fuzz_seed" in worker:
        return worker["kvconform_fuzz_seed"]
    if value is None:
        return None
    if value == "random":
        import random

        seed = random.SystemRandom().randrange(2 ** 31)
    elif value.isdigit():
        seed = int(value)
    else:
        raise pytest.UsageError(f"kvconform: --kvconform-fuzz-seed {value!r}: an integer ≥ 0 or 'random'")
    config._kvconform_fuzz_seed = seed
    return seed


def read_shard(config) -> str | None:
    """``--kvconform-shard I/N`` validated, or ``auto`` / ``auto/N`` read from the CI's own variables
    (``merge.resolve_shard``): ``"I/N"``, or None. Where an ``auto`` share came from is kept for the shard line.

    Raises:
        pytest.UsageError: not I/N with 1 ≤ I ≤ N, or ``auto`` where no CI variable gives the share (naming the
            variables read).
    """
    value = config.getoption(SHARD.dest)
    if value is None:
        return None
    from kvconform.merge import resolve_shard

    try:
        index, count, where = resolve_shard(value)
    except UsageError as exc:
        raise pytest.UsageError(f"kvconform: {exc}") from None
    config._kvconform_shard_source = where
    return f"{index}/{count}"


def hooked_specs(config) -> list:
    """The subjects every ``pytest_kvconform_caches`` implementation returned, flattened.

    Raises:
        pytest.UsageError: an implementation returned something else than a list (or tuple) — e.g. one CacheSpec
            instead of ``[CacheSpec(...)]`` — naming the plugin (the conftest.py) that did.
    """
    out: list = []
    impls = config.pluginmanager.hook.pytest_kvconform_caches.get_hookimpls()
    for impl in reversed(impls):  # pluggy's call order
        specs = impl.function(**({"config": config} if "config" in impl.argnames else {}))
        if specs is None:
            continue
        if not isinstance(specs, (list, tuple)):
            where = getattr(impl.plugin, "__file__", None) or impl.plugin_name
            raise pytest.UsageError(
                f"kvconform: pytest_kvconform_caches in {where} returned {with_article(type(specs).__name__)}; it "
                f"must return a list of subjects, e.g. return [kvconform.CacheSpec(...)]")
        out.extend(specs)
    return out
