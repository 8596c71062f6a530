"""kvconform's pytest plugin: hooks only.

Loaded in every pytest run of an environment where kvconform is installed (``pytest11`` entry point), so the top
level imports only pytest and the standard library; torch and transformers are imported inside hooks, and only
when ``--kvconform`` (or the ``kvconform = true`` ini option) is set. Without it every hook returns at once.
"""

from __future__ import annotations

import fnmatch
import functools
import os
import tempfile
from pathlib import Path

import pytest

from kvconform.families import FAMILIES
from kvconform.outcomes import with_article

SUITE_DIR = Path(__file__).parent / "suite"
SUITE_FILE = SUITE_DIR / "test_conformance.py"
PROPERTY = "kvconform"

OPT_ACTIVE, OPT_CACHE, OPT_MODEL = "kvconform", "kvconform_cache", "kvconform_model"
OPT_JSON, OPT_STRICT, OPT_CASES, OPT_DEVICE = ("kvconform_json", "kvconform_strict", "kvconform_cases",
                                              "kvconform_device")
OPT_FULL, OPT_SELFTEST, OPT_TIMEOUT = "kvconform_full", "kvconform_selftest", "kvconform_timeout"
OPT_FAULTS, OPT_SUBJECT, OPT_SEED = "kvconform_known_faults", "kvconform_subject", "kvconform_fuzz_seed"
OPT_TRUST, OPT_SHARD = "kvconform_trust_remote_code", "kvconform_shard"
OPT_HTML = "kvconform_html"
SELFTEST_FILE = SUITE_DIR / "test_selftest.py"

SESSION_KEY = pytest.StashKey["object"]()
"""The process's ``KVSession`` (not in the controller of a run whose workers write the digest)."""
DIGEST_KEY = pytest.StashKey["object"]()
"""The ``digest.RunDigest`` the reports read, in the process that reports (the controller, or a run without
workers)."""
RESULTS_KEY = pytest.StashKey["dict"]()
"""Item records (``report.record_report``), in the process that reports."""


# ------------------------------------------------------------------------------------------------------ options
def pytest_addoption(parser):
    group = parser.getgroup("kvconform", "KV-cache conformance (kvconform)")
    group.addoption("--kvconform", action="store_true", dest=OPT_ACTIVE, default=None,
                    help="run the kvconform conformance suite (injected; works in an empty folder)")
    group.addoption("--kvconform-cache", action="append", dest=OPT_CACHE, default=None, metavar="SPEC",
                    help="add a subject: 'pkg.module:Attr' or 'path/file.py:Attr' (a Cache subclass or factory); "
                         "repeatable")
    group.addoption("--kvconform-subject", action="append", dest=OPT_SUBJECT, default=None, metavar="NAME",
                    help="run only these subjects (by name, e.g. your own cache's); kvconform's ReferenceCache still "
                         "gives every failure its oracle line; repeatable")
    group.addoption("--kvconform-model", action="append", dest=OPT_MODEL, default=None, metavar="SPEC",
                    help="limit the run to these models: a zoo name or a local checkpoint folder; repeatable")
    group.addoption("--kvconform-cases", action="append", dest=OPT_CASES, default=None, metavar="PATH",
                    help="extra case files or folders of *.toml (added to the built-in cases); repeatable")
    group.addoption("--kvconform-known-faults", action="append", dest=OPT_FAULTS, default=None, metavar="PATH",
                    help="extra known-faults files (same format as kvconform/known_faults.toml), read after the "
                         "bundled one; repeatable")
    group.addoption("--kvconform-json", dest=OPT_JSON, default=None, metavar="PATH",
                    help="write the JSON report (schema 1) to PATH")
    group.addoption("--kvconform-html", dest=OPT_HTML, default=None, metavar="PATH",
                    help="write the conformance page to PATH: one self-contained HTML file (colour matrices, "
                         "filters, every item's message and reproduce line)")
    group.addoption("--kvconform-strict", action="store_true", dest=OPT_STRICT, default=None,
                    help="ignore the bundled list of known upstream faults: they fail instead of xfail")
    group.addoption("--kvconform-full", action="store_true", dest=OPT_FULL, default=None,
                    help="also run the heavier tier (cases with tier = \"full\", default cases on their models_full: "
                         "compile on every model, long fuzzing, long contexts); meant for CI")
    group.addoption("--kvconform-selftest", action="store_true", dest=OPT_SELFTEST, default=None,
                    help="run kvconform's bundled faulty caches through the suite instead of the subjects, and "
                         "print the share caught per check family")
    group.addoption("--kvconform-timeout", dest=OPT_TIMEOUT, default=None, type=float, metavar="SECONDS",
                    help="fail an item whose subject runs longer than this (default 300; 0 disables)")
    group.addoption("--kvconform-fuzz-seed", dest=OPT_SEED, default=None, metavar="N|random",
                    help="draw other random op programs in the fuzz family (default: fixed seeds, the same programs "
                         "every run); 'random' picks N and prints it in the header to replay")
    group.addoption("--kvconform-device", dest=OPT_DEVICE, default=None, metavar="DEVICE",
                    help="torch device for the models under test (default: cpu)")
    group.addoption("--kvconform-trust-remote-code", action="store_true", dest=OPT_TRUST, default=None,
                    help="run the own code of model repositories given with --kvconform-model (config.json auto_map, "
                         "*.py files): your explicit consent; their own cache classes become subjects")
    group.addoption("--kvconform-shard", dest=OPT_SHARD, default=None, metavar="I/N|auto",
                    help="run only share I of N (1 ≤ I ≤ N) of the items: deterministic and balanced, for CI jobs "
                         "on several machines; 'auto' reads the share from GitLab's CI_NODE_INDEX/CI_NODE_TOTAL or "
                         "Buildkite's BUILDKITE_PARALLEL_JOB/_COUNT, 'auto/N' from a Kubernetes indexed Job's "
                         "JOB_COMPLETION_INDEX; merge their JSON reports with kvconform-merge")
    parser.addini(OPT_ACTIVE, "run the kvconform suite (same as --kvconform)", type="bool", default=False)
    parser.addini(OPT_CACHE, "extra subjects (same as --kvconform-cache)", type="linelist", default=[])
    parser.addini(OPT_MODEL, "models to run (same as --kvconform-model)", type="linelist", default=[])
    parser.addini(OPT_SUBJECT, "subjects to run (same as --kvconform-subject)", type="linelist", default=[])
    parser.addini(OPT_CASES, "extra case files (same as --kvconform-cases)", type="linelist", default=[])
    parser.addini(OPT_FAULTS, "extra known-faults files (same as --kvconform-known-faults)", type="linelist",
                  default=[])
    parser.addini(OPT_JSON, "JSON report path (same as --kvconform-json)", default="")
    parser.addini(OPT_HTML, "HTML page path (same as --kvconform-html)", default="")
    parser.addini(OPT_STRICT, "known upstream faults fail (same as --kvconform-strict)", type="bool", default=False)
    parser.addini(OPT_FULL, "run the heavier tier (same as --kvconform-full)", type="bool", default=False)
    parser.addini(OPT_SELFTEST, "run the selftest (same as --kvconform-selftest)", type="bool", default=False)
    parser.addini(OPT_TIMEOUT, "per-item timeout in seconds (same as --kvconform-timeout)", default="300")
    parser.addini(OPT_DEVICE, "torch device (same as --kvconform-device)", default="cpu")
    parser.addini(OPT_TRUST, "run model repositories' own code (same as --kvconform-trust-remote-code)", type="bool",
                  default=False)


def _opt(config, name):
    """Command-line value if given, else the ini twin (paths in it relative to the ini file's folder)."""
    value = config.getoption(name)
    if value is not None:
        return value
    value = config.getini(name)
    if name in _INI_PATHS and value and config.inipath is not None:
        base = config.inipath.parent
        value = [_from_ini(base, name, v) for v in value] if isinstance(value, list) else _from_ini(base, name, value)
    return value


_INI_PATHS = (OPT_CACHE, OPT_MODEL, OPT_CASES, OPT_JSON, OPT_FAULTS, OPT_HTML)


def _from_ini(base, name: str, value: str) -> str:
    """A path given in an ini file is relative to that file's folder (pytest's convention for ini paths), so the
    run does not depend on the folder pytest is started from. Module specs (``pkg.mod:Attr``) and zoo names stay."""
    if name == OPT_CACHE:
        path, sep, attr = value.rpartition(":")
        if sep and path.endswith(".py") and not os.path.isabs(os.path.expanduser(path)):
            return f"{base / path}:{attr}"
        return value
    if os.path.isabs(os.path.expanduser(value)):
        return value
    if name == OPT_MODEL and "/" not in value and not value.startswith(".") and not (base / value).is_dir():
        return value  # a zoo family
    return str(base / value)


def is_active(config) -> bool:
    return bool(_opt(config, OPT_ACTIVE))


_FLAGS = {OPT_CACHE: "--kvconform-cache", OPT_SUBJECT: "--kvconform-subject", OPT_MODEL: "--kvconform-model",
          OPT_CASES: "--kvconform-cases",
          OPT_JSON: "--kvconform-json", OPT_STRICT: "--kvconform-strict", OPT_FULL: "--kvconform-full",
          OPT_SELFTEST: "--kvconform-selftest", OPT_TIMEOUT: "--kvconform-timeout", OPT_DEVICE: "--kvconform-device",
          OPT_SEED: "--kvconform-fuzz-seed", OPT_TRUST: "--kvconform-trust-remote-code",
          OPT_SHARD: "--kvconform-shard", OPT_HTML: "--kvconform-html"}


def _refuse_flags_without_kvconform(config) -> None:
    """A ``--kvconform-*`` flag on the command line without ``--kvconform`` would check nothing and exit 0 with the
    project's own tests: a usage error (exit 4) instead. Ini settings (``kvconform_cache = ...``) stay allowed — a
    project may keep them in its ini file for the runs that add ``--kvconform``.

    Raises:
        pytest.UsageError: naming the flags given and the fix.
    """
    given = [flag for dest, flag in _FLAGS.items() if config.getoption(dest) is not None]
    if given:
        raise pytest.UsageError(
            f"kvconform: {', '.join(given)} given without --kvconform, so nothing would be checked; add --kvconform "
            f"to run the conformance suite (or set kvconform = true in the ini file)")


_BENCHMARK_DEFAULT_STORAGE = "file://./.benchmarks"
_BENCHMARK_SAVING = ("benchmark_save", "benchmark_autosave", "benchmark_compare", "benchmark_compare_fail")


def _keep_benchmarks_out_of_the_folder(config) -> None:
    """pytest-benchmark creates its storage folder (``./.benchmarks``) at configure time, in every run, even when
    nothing is saved. Under ``--kvconform`` in a folder that has none, and unless the user chose a storage or asked
    to save or compare runs, point it at a folder under the system temp dir so that a run leaves nothing behind."""
    storage = getattr(config.option, "benchmark_storage", None)
    if storage != _BENCHMARK_DEFAULT_STORAGE or Path(".benchmarks").exists():
        return
    if any(getattr(config.option, name, None) for name in _BENCHMARK_SAVING):
        return
    config.option.benchmark_storage = "file://" + os.path.join(tempfile.gettempdir(), "kvconform-benchmarks")


# ------------------------------------------------------------------------------------------------------ configure
# One marker per check family (kvconform.families: torch-free, unlike kvconform.checks).
FAMILY_MARKERS = FAMILIES
MARKERS = {"kvconform": "an item of the kvconform conformance suite",
           **{f"kvconform_{f}": f"kvconform check family '{f}'" for f in FAMILY_MARKERS}}


def pytest_addhooks(pluginmanager):
    from kvconform import hookspecs

    pluginmanager.add_hookspecs(hookspecs)


@functools.cache  # once per process
def _freeze_heap_at_exit() -> None:
    """Register (once per process) an ``atexit`` handler that moves every object to the collector's permanent
    generation (``gc.freeze``) before the interpreter finalizes.

    A kvconform process holds the heap of torch and transformers (~500,000 tracked objects), and Python's
    finalization runs full collections over it: measured 1.2 s per process at the end of a default run, paid in
    every xdist worker (the controller waits for them) and again in the controller. Frozen objects are skipped, so
    the process ends in ~0.1 s. The handler runs after pytest's own end-of-session collection (pytest_unconfigure),
    which still reports unraisable exceptions, and after every ``atexit`` handler registered later (LIFO)."""
    import atexit
    import gc

    atexit.register(gc.freeze)


# tryfirst: runs before pytest-benchmark's pytest_configure, which creates its storage folder.
@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    if not is_active(config):
        _refuse_flags_without_kvconform(config)
        return
    _keep_benchmarks_out_of_the_folder(config)
    _freeze_heap_at_exit()
    worker_rundir = getattr(config, "workerinput", {}).get(_RUNDIR_KEY)
    try:
        _check_usage(config)
        if not hasattr(config, "workerinput"):
            _refuse_mistyped_specs(config)
        seed = _fuzz_seed(config)
        build = functools.partial(_build_session, config, seed, _shard(config), _reproduce_args(config, seed))
        if not hasattr(config, "workerinput"):
            _lock_report(config)
        if _starts_workers(config):
            # the workers build the session and run the items; the controller reads the digest one of them writes,
            # or builds the session itself (pytest_collection_build)
            config._kvconform_pending_build = functools.partial(build, runs_items=False)
        else:
            build()
            if worker_rundir:
                _write_digest(config.stash[SESSION_KEY], worker_rundir)
            else:
                _set_digest(config, config.stash[SESSION_KEY].digest())
    except pytest.UsageError as exc:
        if worker_rundir:  # the controller raises it (exit 4) while it waits for the digest
            from kvconform.digest import USAGE_ERROR_FILE, write_atomically

            write_atomically(os.path.join(worker_rundir, USAGE_ERROR_FILE), str(exc))
        raise
    suite_ids = _point_suite_node_ids_at_the_suite(config)
    if not suite_ids and str(SUITE_DIR) not in config.args:
        config.args.append(str(SUITE_DIR))
    _crash_setup(config)


def _refuse_mistyped_specs(config) -> None:
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

    trust = bool(_opt(config, OPT_TRUST))
    for spec in _opt(config, OPT_MODEL) or ():
        if problem := spec_problem(spec, trust):
            raise pytest.UsageError(f"kvconform: {problem}")
    caches = _opt(config, OPT_CACHE) or ()
    if caches:
        from kvconform.subjects.resolve import spec_problem_before_import

        for spec in caches:
            if problem := spec_problem_before_import(spec):
                raise pytest.UsageError(f"kvconform: {problem}")


def _lock_report(config) -> None:
    """Hold ``--kvconform-json PATH`` for this run (``report.ReportLock``, released at unconfigure): a second run
    writing the same report is a usage error naming the first, instead of the later run's results replacing the
    earlier's without a word. A run killed with SIGTERM (a CI job cancelled or out of time) ends as an interrupted
    one, so that its report says so.

    Raises:
        pytest.UsageError: another run holds the report.
    """
    path = _opt(config, OPT_JSON)
    if not path:
        return
    import shlex

    from kvconform.report import ReportLock, ReportLocked

    lock = ReportLock(path)
    try:
        lock.acquire(command=shlex.join(["pytest", *map(str, config.invocation_params.args)]))
    except ReportLocked as exc:
        raise pytest.UsageError(f"kvconform: --kvconform-json {path!r}: {exc}") from None
    config._kvconform_lock = lock
    _terminate_as_interrupt(config)


def _terminate_as_interrupt(config) -> None:
    """SIGTERM (what a CI runner sends a job it cancels or that ran out of time, before SIGKILL) raises
    KeyboardInterrupt in this process, as Ctrl-C does, so that pytest ends the session and the JSON report is
    written saying it was interrupted. Only where SIGTERM has its default action (ending the process at once) and in
    the main thread; the default is put back at unconfigure."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def interrupt(signum, frame):
        config._kvconform_signal = "SIGTERM"
        raise KeyboardInterrupt("SIGTERM")

    signal.signal(signal.SIGTERM, interrupt)
    config._kvconform_sigterm = True


def _starts_workers(config) -> bool:
    """True in the controller of a pytest-xdist run (pytest-xdist's own condition for starting workers: a
    distribution mode and not ``--collect-only``)."""
    return (not hasattr(config, "workerinput") and config.getoption("dist", "no") != "no"
            and not config.getoption("collectonly", False))


def _build_session(config, fuzz_seed, shard, reproduce_args, runs_items=True) -> None:
    """Resolve the run's subjects (``--kvconform-cache`` and the ``pytest_kvconform_caches`` hook), models, cases and
    known faults (``session.build_session``) into the config's stash.

    Raises:
        pytest.UsageError: a bad cache spec, case file, known-faults file or model (exit 4, naming it).
    """
    from kvconform.session import build_session

    hooked = _hooked_specs(config)
    try:
        session = build_session(
            caches=[*_opt(config, OPT_CACHE), *hooked], models=_opt(config, OPT_MODEL),
            case_paths=_opt(config, OPT_CASES),
            strict=bool(_opt(config, OPT_STRICT)), device=_opt(config, OPT_DEVICE) or "cpu",
            full=bool(_opt(config, OPT_FULL)), known_faults=_opt(config, OPT_FAULTS),
            only_subjects=_opt(config, OPT_SUBJECT), trust_remote_code=bool(_opt(config, OPT_TRUST)),
            runs_items=runs_items,
        )
    except ValueError as exc:  # SpecError, CaseFileError, KnownFaultsError, bad model spec
        raise pytest.UsageError(f"kvconform: {exc}") from None
    session.fuzz_seed, session.shard, session.reproduce_args = fuzz_seed, shard, reproduce_args
    config.stash[SESSION_KEY] = session


def _set_digest(config, digest) -> None:
    """The reporting process's digest (``DIGEST_KEY``) and its empty results."""
    config.stash[DIGEST_KEY] = digest
    config.stash[RESULTS_KEY] = {}


def _write_digest(session, rundir: str) -> None:
    """xdist worker: write the session's digest for the controller, unless another worker already has (every
    worker builds the same session)."""
    from kvconform.digest import DIGEST_FILE

    if not os.path.exists(os.path.join(rundir, DIGEST_FILE)):
        session.digest().write(rundir)


_DIGEST_POLL_S = 0.02


def _await_digest(config):
    """xdist controller: the ``RunDigest`` the first worker to build its session writes to the run's folder (~5 s
    after the start, while the controller has nothing else to do: the workers run no item before it returns).
    Returns None when it cannot come: every worker process has ended without writing it, or the workers' processes
    cannot be watched (then the controller builds the session itself).

    Raises:
        pytest.UsageError: the usage error a worker found building its session (exit 4, its message).
    """
    import time

    from kvconform.digest import USAGE_ERROR_FILE, RunDigest

    rundir = getattr(config, "_kvconform_rundir", None)
    if not rundir:
        return None

    def arrived():
        try:
            with open(os.path.join(rundir, USAGE_ERROR_FILE), encoding="utf-8") as fh:
                message = fh.read()
        except FileNotFoundError:
            return RunDigest.read(rundir)
        raise pytest.UsageError(message) from None

    while True:
        digest = arrived()
        if digest is not None:
            return digest
        gateways = _worker_gateways(config)
        if gateways is None:
            return None  # they cannot be watched: the controller builds the session itself
        if not any(gateway._io.popen.poll() is None for gateway in gateways):
            digest = arrived()  # what a worker wrote just before it ended
            if digest is None:
                raise pytest.UsageError(_died_building(config, gateways))
            return digest
        time.sleep(_DIGEST_POLL_S)


def _worker_gateways(config) -> list | None:
    """The execnet gateways of the xdist workers, or None when they are not all local processes that can be watched
    (``gateway._io.popen``)."""
    dsession = config.pluginmanager.getplugin("dsession")
    group = getattr(getattr(dsession, "nodemanager", None), "group", None)
    gateways = list(group) if group is not None else []
    if not gateways or any(getattr(getattr(g, "_io", None), "popen", None) is None for g in gateways):
        return None
    return gateways


def _died_building(config, gateways) -> str:
    """The usage error of a run whose every worker process ended while building the session, before any item
    existed: how each ended, what the session imports there, how to see the crash itself."""
    ends = ", ".join(f"{g.id}: {_exit_text(g)[1]}" for g in gateways)
    caches = _opt(config, OPT_CACHE) or []
    imported = (f"the subjects' modules ({', '.join(f'--kvconform-cache {c}' for c in caches)}), " if caches else "")
    return (f"kvconform: every worker process ended while building the session, before any item ran ({ends}). "
            f"Building it imports {imported}the conftest.py hooks, torch, transformers and the models; a crash "
            f"there would end any process that runs the items. Run with -n 0 (in one process) to see where it "
            f"crashes.")


# A wrapper of pytest_collection: the first hook after pytest_sessionstart, where pytest-xdist's DSession has started
# the workers and the terminal has written its header (DSession's own pytest_collection returns at once in the
# controller, before non-wrapper implementations would run).
@pytest.hookimpl(wrapper=True, specname="pytest_collection")
def pytest_collection_build(session):
    """xdist controller: read the digest a worker writes once it has built its session (``_await_digest``; the
    controller builds none itself, ARCHITECTURE.md "Crashes and workers"), and write the kvconform header lines from
    it here instead of in ``pytest_report_header``. Building a session in the controller (importing torch and
    transformers) took ~5 s of CPU on the two cores the workers start on.

    Raises:
        pytest.UsageError: a usage error a worker found, or every worker ended while building (pytest ends the
            session with exit 4 and stops the workers).
    """
    config = session.config
    build = getattr(config, "_kvconform_pending_build", None)
    if build is not None:
        del config._kvconform_pending_build
        digest = _await_digest(config)
        if digest is None:
            build()
            digest = config.stash[SESSION_KEY].digest()
        _set_digest(config, digest)
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None and reporter.showheader and not reporter.no_header:
            for line in digest.header:
                reporter.write_line(line)
    return (yield)


def pytest_ignore_collect(collection_path, config):
    # The suite only makes sense with --kvconform (it needs the generated parameters); the selftest module runs
    # instead of the conformance module under --kvconform-selftest.
    if SUITE_DIR not in (collection_path, *collection_path.parents):
        return None
    if not is_active(config):
        return True
    selftest = bool(_opt(config, OPT_SELFTEST))
    if collection_path == (SUITE_FILE if selftest else SELFTEST_FILE):
        return True
    return None


def pytest_collect_file(file_path, parent):
    # A user python_files setting (e.g. check_*.py) would drop the suite: collect it ourselves then.
    config = parent.config
    if not is_active(config) or file_path not in (SUITE_FILE, SELFTEST_FILE):
        return None
    if any(fnmatch.fnmatch(file_path.name, pat) for pat in config.getini("python_files")):
        return None
    return pytest.Module.from_parent(parent, path=file_path)


def _shard(config) -> str | None:
    """``--kvconform-shard I/N`` validated, or ``auto`` / ``auto/N`` read from the CI's own variables
    (``merge.resolve_shard``): ``"I/N"``, or None. Where an ``auto`` share came from is kept for the shard line.

    Raises:
        pytest.UsageError: not I/N with 1 ≤ I ≤ N, or ``auto`` where no CI variable gives the share (naming the
            variables read).
    """
    value = config.getoption(OPT_SHARD)
    if value is None:
        return None
    from kvconform.merge import resolve_shard

    try:
        index, count, where = resolve_shard(value)
    except ValueError as exc:
        raise pytest.UsageError(f"kvconform: {exc}") from None
    config._kvconform_shard_source = where
    return f"{index}/{count}"


# after -k / -m deselection (trylast), so that the shares stay balanced
@pytest.hookimpl(trylast=True, specname="pytest_collection_modifyitems")
def pytest_collection_modifyitems_shard(session, config, items):
    """``--kvconform-shard I/N``: keep share I of the items (``merge.select_shard``), deselect the others."""
    shard = getattr(config.stash.get(SESSION_KEY, None), "shard", None) if is_active(config) else None
    if not shard:
        return
    from kvconform.merge import select_shard

    index, count = (int(x) for x in shard.split("/"))
    kept, dropped = select_shard(items, index, count)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept
    source = getattr(config, "_kvconform_shard_source", "")
    config._kvconform_shard_line = (f"kvconform shard {shard}{f' ({source})' if source else ''}: {len(kept)} of "
                                    f"{len(kept) + len(dropped)} items (merge the shards' --kvconform-json reports "
                                    f"with kvconform-merge)")


def pytest_report_collectionfinish(config, start_path, items):
    return getattr(config, "_kvconform_shard_line", None)


def pytest_collection_finish(session):
    """A run without workers: the items it will run are known (after ``-k`` / ``-m`` / ``--kvconform-shard``), the
    report's ``planned`` count; the JSON report is written now saying so (and that it is not complete)."""
    config = session.config
    if not is_active(config) or hasattr(config, "workerinput"):
        return
    config._kvconform_planned = sum(1 for it in _suite_items(session.items)
                                    if "kv_item" in getattr(getattr(it, "callspec", None), "params", {}))
    _write_json_progress(config, now=True)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """xdist controller: a worker has collected (every worker collects the same items, after ``-k`` / ``-m`` /
    ``--kvconform-shard``): the report's ``planned`` count, from the first."""
    config = node.config
    if not is_active(config) or getattr(config, "_kvconform_planned", None) is not None:
        return
    config._kvconform_planned = sum(1 for nodeid in ids if _is_suite_item(nodeid))
    _write_json_progress(config, now=True)


def _is_suite_item(nodeid: str) -> bool:
    """Whether a node id (as a worker reports it) is an item of kvconform's conformance module."""
    path, _, name = nodeid.partition("::")
    return os.path.basename(path) == SUITE_FILE.name and name.startswith("test_conformance[")


def pytest_report_header(config):
    if not is_active(config) or DIGEST_KEY not in config.stash:
        return None  # an xdist controller writes them once the digest arrives (pytest_collection_build)
    return config.stash[DIGEST_KEY].header


# ------------------------------------------------------------------------------------------------------ collection
def pytest_generate_tests(metafunc):
    if not is_active(metafunc.config):
        return
    session = metafunc.config.stash[SESSION_KEY]
    if "kv_selftest" in metafunc.fixturenames:
        from kvconform.testing import faulty_caches

        metafunc.parametrize("kv_selftest", [pytest.param(f, id=f.name) for f in faulty_caches()])
    if "kv_item" not in metafunc.fixturenames:
        return
    if any(m.args and m.args[0] == "kv_item" for m in metafunc.definition.iter_markers("parametrize")):
        return  # a user test decorated with kvconform.parametrize_with_checks
    params = [pytest.param(item, id=item.id, marks=item.marks(pytest)) for item in session.items()]
    metafunc.parametrize("kv_item", params)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    if not is_active(config):
        return
    from kvconform.report import encode_property

    ours = [it for it in items if PROPERTY in it.keywords and hasattr(it, "callspec")]
    if not ours:
        raise pytest.UsageError(
            "kvconform: --kvconform is set but no conformance items were collected "
            "(was the packaged suite excluded by a collection setting?)")
    for it in _suite_items(ours):
        if "kv_item" in it.callspec.params:
            # JSON, so that --junitxml properties are machine-readable (report.py decodes them)
            it.user_properties.append((PROPERTY, encode_property(it.callspec.params["kv_item"].record())))


# ------------------------------------------------------------------------------------------------------ running
@pytest.fixture(scope="session")
def kv_session(request):
    """The per-process kvconform session (models, oracles, plan). Without --kvconform (a user test decorated
    with ``kvconform.parametrize_with_checks``) a bare session is built: no subjects of its own."""
    if is_active(request.config):
        return request.config.stash[SESSION_KEY]
    from kvconform.session import build_session

    return build_session(builtin=False)


def _point_suite_node_ids_at_the_suite(config) -> bool:
    """Let a node id printed by a run (``test_conformance.py::test_conformance[...]`` in a FAILED line, which is
    relative to the installed suite's folder) be pasted back: such arguments are rewritten to the suite file's
    path. Returns True when the command line names suite items, so that the whole suite is not added as well."""
    named = False
    for i, arg in enumerate(config.args):
        path, sep, rest = str(arg).partition("::")
        base = os.path.basename(path)
        if base not in (SUITE_FILE.name, SELFTEST_FILE.name):
            continue
        if os.path.exists(os.path.join(config.invocation_params.dir, path)) and \
                os.path.abspath(os.path.join(config.invocation_params.dir, path)) not in (str(SUITE_FILE),
                                                                                            str(SELFTEST_FILE)):
            continue  # the user's own file of that name
        config.args[i] = str(SUITE_DIR / base) + sep + rest
        named = True
    return named


def _fuzz_seed(config) -> int | None:
    """``--kvconform-fuzz-seed``: None (fixed seeds), an int, or a random int for ``random`` (the header prints it).
    Under xdist the controller draws it and the workers read it back from their ``workerinput``.

    Raises:
        pytest.UsageError: neither an integer ≥ 0 nor ``random``.
    """
    value = config.getoption(OPT_SEED)
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


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist controller → worker: the same fuzz seed in every worker (``random`` is drawn once)."""
    seed = getattr(node.config, "_kvconform_fuzz_seed", None)
    if seed is not None:
        node.workerinput["kvconform_fuzz_seed"] = seed
    node.workerinput[_RUNDIR_KEY] = getattr(node.config, "_kvconform_rundir", None)


def _reproduce_args(config, fuzz_seed: int | None) -> tuple:
    """The flags of this run that change what an item does, shell-quoted, for its ``reproduce:`` line (paths made
    absolute, so that the line works from any folder)."""
    import shlex

    args = []
    for path in _opt(config, OPT_CASES) or ():
        args += ["--kvconform-cases", shlex.quote(os.path.abspath(path))]
    for path in _opt(config, OPT_FAULTS) or ():
        args += ["--kvconform-known-faults", shlex.quote(os.path.abspath(path))]
    if _opt(config, OPT_STRICT):
        args.append("--kvconform-strict")
    if _opt(config, OPT_FULL):
        args.append("--kvconform-full")
    timeout = _timeout(config)
    if timeout != 300:
        args += ["--kvconform-timeout", f"{timeout:g}"]
    device = _opt(config, OPT_DEVICE) or "cpu"
    if device != "cpu":
        args += ["--kvconform-device", shlex.quote(device)]
    if _opt(config, OPT_TRUST):
        args.append("--kvconform-trust-remote-code")
    if fuzz_seed is not None:
        args += ["--kvconform-fuzz-seed", str(fuzz_seed)]
    return tuple(args)


def _hooked_specs(config) -> list:
    """The subjects every ``pytest_kvconform_caches`` implementation returned, flattened.

    Raises:
        pytest.UsageError: an implementation returned something else than a list (or tuple) — e.g. one CacheSpec
            instead of ``[CacheSpec(...)]`` — naming the plugin (the conftest.py) that did.
    """
    out = []
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


def _timeout(config) -> float:
    value = config.getoption(OPT_TIMEOUT)
    return float(config.getini(OPT_TIMEOUT) if value is None else value)


def _check_usage(config) -> None:
    """Usage errors (exit 4, one line) for the option values that would otherwise fail every item or the end of
    the run: the JSON report path, the per-item timeout, the torch device.

    Raises:
        pytest.UsageError: naming the option, the value and the cause.
    """
    from kvconform.report import json_path_problem

    for option, flag in ((OPT_JSON, "--kvconform-json"), (OPT_HTML, "--kvconform-html")):
        path = _opt(config, option)
        if path and (problem := json_path_problem(path)):
            raise pytest.UsageError(f"kvconform: {flag} {path!r}: {problem}")
    try:
        timeout = _timeout(config)
    except ValueError:
        raise pytest.UsageError(f"kvconform: kvconform_timeout {config.getini(OPT_TIMEOUT)!r}: not a number") from None
    if timeout < 0:
        raise pytest.UsageError(f"kvconform: --kvconform-timeout {timeout:g}: must be ≥ 0 (0 disables the timeout)")
    device = _opt(config, OPT_DEVICE) or "cpu"
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


@pytest.fixture
def kv_runner(kv_session, request):
    """``kv_runner(item)`` runs one conformance item and records its metrics on the report."""
    from kvconform.session import item_timeout

    def run(item):
        __tracebackhide__ = True  # see _detached: pytest would read and parse this module for every failed item
        from kvconform.checks import CheckSkipped, ConformanceError, KnownFaultShown, KVConformInternalError, Unexcused
        from kvconform.report import encode_property

        metrics = {}
        benchmark = None
        crashed = _crashed_subject_message(request.config, item)
        if crashed:
            request.node.user_properties.append((PROPERTY + "_metrics", encode_property({"crash": "earlier"})))
            raise ConformanceError(crashed)
        if item.check.family == "speed":
            # Under xdist (the default) pytest-benchmark disables itself: the rounds run in a plain loop, and a budget
            # exceeded is confirmed by a second measurement before the item fails (checks/speed.py), so the other
            # worker's load does not flip a verdict. --benchmark-disable still skips them (never a pass).
            if hasattr(request.config, "workerinput"):
                if request.config.getoption("benchmark_disable", False):
                    pytest.skip("benchmarking is disabled (--benchmark-disable), so this budget was not measured")
            elif request.config.pluginmanager.hasplugin("benchmark"):
                benchmark = request.getfixturevalue("benchmark")
        failure = skipped = xfailed = None
        try:
            with item_timeout(_timeout(request.config), item, kv_session.reproduce_args):
                metrics.update(kv_session.run(item, benchmark=benchmark))
        except CheckSkipped as exc:
            skipped = str(exc)
        except KnownFaultShown as exc:  # a known fault judged by its evidence, at run time
            metrics.update(exc.metrics)
            xfailed = str(exc)
        except (ConformanceError, Unexcused, KVConformInternalError) as exc:
            metrics.update(exc.metrics or {})
            failure = exc
        except Exception as exc:
            metrics.update(getattr(exc, "metrics", {}) or {})
            raise
        finally:
            request.node.user_properties.append((PROPERTY + "_metrics", encode_property(metrics)))
        # Raised outside the except blocks, without the chain: see _detached.
        if failure is not None:
            raise _detached(failure)
        if skipped is not None:
            pytest.skip(skipped)
        if xfailed is not None:
            pytest.xfail(xfailed)

    return run


def _detached(exc: BaseException) -> BaseException:
    """``exc`` without its traceback and exception chain, to be raised from ``kv_runner``.

    A kvconform failure's message is its whole report (``pytest_runtest_makereport`` replaces pytest's long
    representation with ``str(exc)``, and an xfailed item shows its reason only), but pytest builds the long
    representation first, for every failed and xfailed item: source lines of every frame down through transformers
    and torch, and of every chained exception. That came to about 0.1 s an item, 10 s of CPU in the default run
    (99 known faults xfail there). The chain's facts are already in the message (the exception line and the likely
    cause, ``checks/_diagnosis.py``). Anything other than a kvconform failure keeps its full traceback."""
    exc.__cause__ = exc.__context__ = None
    exc.__suppress_context__ = True
    return exc.with_traceback(None)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if call.excinfo is not None and PROPERTY in item.keywords:
        from kvconform.checks import ConformanceError, KVConformInternalError, Unexcused

        if isinstance(call.excinfo.value, (ConformanceError, Unexcused, KVConformInternalError)) and report.failed:
            report.longrepr = str(call.excinfo.value)
    return report


def pytest_runtest_logreport(report):
    props = dict(report.user_properties or ())
    if PROPERTY not in props:
        return
    config = _CONFIG.get("config")
    if config is None or RESULTS_KEY not in config.stash:
        return
    from kvconform.report import record_report

    with _JSON_LOCK:
        record_report(config.stash[RESULTS_KEY], report, props, config.stash.get(DIGEST_KEY, None))
    _write_json_progress(config)


_JSON_EVERY_S = 2.0
_JSON_LOCK = __import__("threading").Lock()


def _write_json_progress(config, final: bool = False, exitstatus=None, now: bool = False) -> None:
    """The JSON report is written when the run starts, rewritten as items finish, and written a last time at the end,
    so that a report never reads as complete when it is not: every write but the last says ``complete: false``
    (``_progress``), so a run killed from outside still leaves what it finished on disk, marked as cut short. A
    timer thread rewrites it ``_JSON_EVERY_S`` seconds after the first unwritten result (one rewrite per interval,
    not one per item: a rewrite costs the whole report); ``now`` writes at once (the run's start, its plan known);
    ``final`` writes the end state (``exitstatus``: the session's). Only by the run that holds the report's lock
    (``_lock_report``), and not in xdist workers (the controller writes the one report)."""
    import threading

    path = _opt(config, OPT_JSON)
    if not path or hasattr(config, "workerinput") or getattr(config, "_kvconform_lock", None) is None:
        return
    from kvconform.report import write_json

    def write(final_write):
        results = config.stash.get(RESULTS_KEY, {})
        write_json(path, results, config.stash.get(DIGEST_KEY, None),
                   _progress(config, results, final_write, exitstatus))

    def flush():  # under the lock: never interleaved with the final write, never after it
        with _JSON_LOCK:
            config._kvconform_json_timer = None
            if not getattr(config, "_kvconform_json_final", False):
                write(False)

    timer = getattr(config, "_kvconform_json_timer", None)
    if final:
        with _JSON_LOCK:
            config._kvconform_json_final = True
            if timer is not None:
                timer.cancel()
            write(True)
    elif now:
        with _JSON_LOCK:
            if not getattr(config, "_kvconform_json_final", False):
                write(False)
    elif timer is None:
        timer = config._kvconform_json_timer = threading.Timer(_JSON_EVERY_S, flush)
        timer.daemon = True
        timer.start()


def _progress(config, results: dict, final: bool, exitstatus) -> dict:
    """The report's state (``report.run_progress``): planned and finished counts, and why it is not complete —
    written while the run goes on (a report still saying so after the run ended was cut short by a kill that left
    no time to write: SIGKILL, the OOM killer), interrupted (Ctrl-C, SIGTERM), a usage error, or a session that
    stopped before its last item (``-x``, ``--maxfail``, workers that could not be replaced)."""
    from kvconform.report import run_progress

    planned = getattr(config, "_kvconform_planned", None)
    finished = len(results)
    of = f"{finished} of {planned if planned is not None else 'an unknown number of'} items"
    why = None
    if not final:
        why = (f"written while the run was going on ({of} finished): if that run has ended, it was killed before "
               f"it could finish the report (SIGKILL, the OOM killer, a machine lost)")
    elif exitstatus == pytest.ExitCode.INTERRUPTED:
        signal_name = getattr(config, "_kvconform_signal", None)
        why = f"interrupted ({signal_name or 'KeyboardInterrupt: Ctrl-C'}) after {of} had finished"
    elif exitstatus == pytest.ExitCode.USAGE_ERROR:
        why = f"the run ended with a usage error (exit 4) after {of}"
    elif planned is None:
        why = f"the run ended (exit status {int(exitstatus) if exitstatus is not None else '?'}) before its items " \
              f"were collected"
    elif finished < planned:
        why = (f"the session stopped after {of} (exit status {int(exitstatus) if exitstatus is not None else '?'}: "
               f"-x or --maxfail, or workers that crashed and could not be replaced)")
    return run_progress(planned, finished, why)


_CONFIG: dict = {}


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    if is_active(session.config):
        _CONFIG["config"] = session.config
        # before any item runs: a report at this path now says that this run has not finished (a run killed before
        # its next write leaves that, not an earlier run's report, which would read as this run's)
        _write_json_progress(session.config, now=True)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    # xdist workers' terminal output is not shown: the controller writes the one summary of the whole run (a
    # worker's known-fault summary planned the whole zoo's items for nothing: ~0.6 s at the end of each worker, py-spy)
    if not is_active(config) or RESULTS_KEY not in config.stash or hasattr(config, "workerinput"):
        return
    from kvconform.report import (reference_gaps, write_known_fault_summary, write_markdown_summary,
                                  write_own_gaps_summary, write_terminal_matrix)

    results, digest = config.stash[RESULTS_KEY], config.stash[DIGEST_KEY]
    reference_gaps(results)
    write_terminal_matrix(terminalreporter, results, digest)
    _write_own_failures_hint(terminalreporter, results)
    if _opt(config, OPT_SELFTEST):
        from kvconform.report import write_selftest_summary

        write_selftest_summary(terminalreporter)
    else:
        write_known_fault_summary(terminalreporter, results, digest)
    write_own_gaps_summary(terminalreporter, results, digest)
    write_markdown_summary(results, os.environ.get("GITHUB_STEP_SUMMARY"), digest)
    progress = _progress(config, results, True, exitstatus)
    if not progress["complete"] and progress["planned"] is not None:
        terminalreporter.write_line(f"kvconform: INCOMPLETE: {progress['incomplete']}; the matrix shows only the "
                                    f"items that finished" + (" (and so does the JSON report, which says so)"
                                                              if _opt(config, OPT_JSON) else ""), red=True)


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if not is_active(config):
        return
    if hasattr(config, "workerinput"):
        _freeze_worker_heap()
        return
    if RESULTS_KEY in config.stash:
        from kvconform.report import reference_gaps

        with _JSON_LOCK:  # before the final JSON and the summary: the reference's gaps are kvconform's
            reference_gaps(config.stash[RESULTS_KEY])
    _write_json_progress(config, final=True, exitstatus=exitstatus)
    if RESULTS_KEY in config.stash:
        _write_html(config, exitstatus)
        if any(r["outcome"] == "internal" for r in config.stash[RESULTS_KEY].values()) \
                and session.exitstatus in (0, 1):
            session.exitstatus = INTERNAL_EXIT


INTERNAL_EXIT = 3
"""The exit code of a run in which kvconform's own code failed on an item (pytest's ``ExitCode.INTERNAL_ERROR``):
some items have no verdict; the "kvconform's own gaps" summary says where. It wins over 1 (a subject's failure),
never over an interruption (2)."""


def _write_html(config, exitstatus=None) -> None:
    """``--kvconform-html PATH``: the page of the run's JSON report data (``html_report``), at the end of the run,
    with the run's state (``_progress``: an interrupted run's page says it is incomplete)."""
    path = _opt(config, OPT_HTML)
    if path:
        from kvconform.html_report import write_html
        from kvconform.report import json_payload

        with _JSON_LOCK:
            results = config.stash[RESULTS_KEY]
            payload = json_payload(results, config.stash[DIGEST_KEY], _progress(config, results, True, exitstatus))
        write_html(path, payload, config.stash[DIGEST_KEY])


def _freeze_worker_heap() -> None:
    """xdist worker, at the end of its session: move every object to the collector's permanent generation
    (``gc.freeze``). pytest's ``pytest_unconfigure`` then runs one full collection to report unraisable exceptions,
    which in a worker walked the whole heap of torch, transformers and the models (~0.5 s, while the controller
    waits for the worker to end) to report to nobody: the worker has sent its last event to the controller
    (pytest-xdist's ``workerfinished``, right after this hook) and the controller reads no more."""
    import gc

    gc.freeze()


def pytest_unconfigure(config):
    _CONFIG.pop("config", None)
    _crash_teardown(config)
    lock = getattr(config, "_kvconform_lock", None)
    if lock is not None:
        lock.release()
        config._kvconform_lock = None
    if getattr(config, "_kvconform_sigterm", False):
        import signal

        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        config._kvconform_sigterm = False


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist controller: a worker has ended. Until the last one ends a core is free, so the controller imports now
    what its terminal summary would import after the last worker: hypothesis's pytest plugin (a dependency of
    kvconform) imports the whole hypothesis package in its ``pytest_terminal_summary`` (``_WROTE_TO`` of
    ``hypothesis.internal.observability``), and the controller, which runs no item, has not imported it yet. That was
    ~1.1 s of a default run's wall time on 2 cores, all of it after the last item (timeline of one run: the last
    worker ended at 34.4 s, the controller at 35.9 s). Importing a module twice does nothing."""
    if is_active(node.config) and node.config.pluginmanager.has_plugin("hypothesispytest"):
        import hypothesis.internal.observability  # noqa: F401 - imported for its cost, see the docstring



# ------------------------------------------------------------------------------------------------------ crashes
# A subject with a native kernel can kill its process (segfault, abort, os._exit, the OOM killer's SIGKILL), which no
# try/except catches. `pytest --kvconform` therefore runs its items in pytest-xdist workers by default: the controller
# replaces a crashed worker and the session goes on. The crashed item fails with a kvconform message naming the
# subject, the signal and the last op started (read from the worker's breadcrumb file, kvconform.outcomes); the
# subject's other items fail at once naming that crash (each would take a worker down again). `-n 0` (or
# KVCONFORM_WORKERS=0) runs in-process, without that protection.
WORKERS_ENV = "KVCONFORM_WORKERS"
_RUNDIR_KEY = "kvconform_rundir"


def default_workers() -> int:
    """Workers of a default ``pytest --kvconform`` run: ``$KVCONFORM_WORKERS`` if set, else the usable CPU cores
    (at most 4: every worker builds its own models and oracles). 0: run in-process."""
    value = os.environ.get(WORKERS_ENV, "").strip()
    if value:
        if not value.isdigit():
            raise pytest.UsageError(f"kvconform: {WORKERS_ENV}={value!r}: an integer ≥ 0 (0 runs in-process)")
        return int(value)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, 4))


@pytest.hookimpl(wrapper=True)
def pytest_cmdline_main(config):
    # a wrapper: runs before pytest-xdist's own pytest_cmdline_main, which turns -n into its workers
    _distribute_by_default(config)
    return (yield)


def _distribute_by_default(config) -> None:
    """Under ``--kvconform`` with pytest-xdist installed and no ``-n``/``--dist``/``--tx`` given: ``-n`` of
    ``default_workers()`` (both cores working, and a crashing subject cannot take the session down)."""
    if not is_active(config) or hasattr(config, "workerinput") or not config.pluginmanager.hasplugin("xdist"):
        return
    opt = config.option
    if getattr(opt, "numprocesses", 0) is not None or getattr(opt, "tx", None) or getattr(opt, "dist", "no") != "no":
        return  # the user chose
    if getattr(opt, "collectonly", False) or getattr(opt, "usepdb", False) or getattr(opt, "looponfail", False):
        return
    workers = default_workers()
    if workers == 0:
        return
    from kvconform.scratch import is_scratch_spec

    models = _opt(config, OPT_MODEL) or []
    if models and all(is_scratch_spec(m) for m in models):
        # only from-scratch models (plain PyTorch, kvconform.scratch): in process, since starting a worker costs
        # more than their default tier (the worked example: 6 s of items, 17 s wall -n 0, 23 s with one worker,
        # on a loaded 2-core machine); -n N restores the workers
        return
    opt.numprocesses = workers
    if getattr(opt, "maxworkerrestart", None) is None:
        opt.maxworkerrestart = "1000"  # bounded anyway: a crashed subject's other items do not run
    config._kvconform_distributed = True


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist: under the default distribution (``_distribute_by_default``) the items of one model go to one
    worker, a model at a time (``ModelScheduling``), so that each model and its oracle are built in one process
    instead of in every worker. A distribution the user chose (``-n``, ``--dist``) is left to pytest-xdist."""
    if not getattr(config, "_kvconform_distributed", False):
        return None
    return _model_scheduling(config, log)


def _model_scheduling(config, log):
    """A ``ModelScheduling`` (defined here: pytest-xdist is imported only when it distributes)."""
    from xdist.scheduler import LoadScopeScheduling

    class ModelScheduling(LoadScopeScheduling):
        """pytest-xdist's load-scope scheduling with one scope per model (``subject-model-check-case`` node ids;
        a node id of another test is a scope of its own). Scopes go to workers largest first as they free up
        (xdist's ``--loadscope-reorder``). A crashed worker's item is not run again by another worker: it is
        reported once, by ``pytest_handlecrashitem``."""

        def __init__(self, config, log=None):
            super().__init__(config, log)
            digest = config.stash[DIGEST_KEY]
            self._subjects = sorted(digest.subject_names, key=len, reverse=True)
            self._models = sorted(digest.models, key=len, reverse=True)

        def _split_scope(self, nodeid: str) -> str:
            param = nodeid.partition("[")[2].removesuffix("]")
            for subject in self._subjects:
                if param.startswith(subject + "-"):
                    rest = param[len(subject) + 1:]
                    model = next((m for m in self._models if rest.startswith(m + "-")), None)
                    if model is not None:
                        return "model " + model
            return nodeid

        def remove_node(self, node):
            workload = self.assigned_work.pop(node)
            pending = [(scope, nodeid) for scope, unit in workload.items()
                       for nodeid, done in unit.items() if not done]
            if not pending:
                return None
            scope, crashitem = pending[0]
            workload[scope][crashitem] = True  # reported as crashed; the rest of its scope runs elsewhere
            self.workqueue.update({s: unit for s, unit in workload.items() if not all(unit.values())})
            for other in self.assigned_work:
                self._reschedule(other)
            return crashitem

    return ModelScheduling(config, log)


def _crash_setup(config) -> None:
    """Controller: a folder for the workers' breadcrumbs and the crashed subjects. Worker: its breadcrumb file."""
    worker = getattr(config, "workerinput", None)
    if worker is not None:
        if worker.get(_RUNDIR_KEY):
            from kvconform.outcomes import open_breadcrumbs

            open_breadcrumbs(os.path.join(worker[_RUNDIR_KEY], f"{worker.get('workerid', 'gw')}.crumb"))
        return
    if config.getoption("dist", "no") != "no":
        config._kvconform_rundir = tempfile.mkdtemp(prefix="kvconform-run-")


def _crash_teardown(config) -> None:
    import shutil

    from kvconform.outcomes import close_breadcrumbs

    close_breadcrumbs()
    rundir = getattr(config, "_kvconform_rundir", None)
    if rundir:
        shutil.rmtree(rundir, ignore_errors=True)


def _exit_text(gateway) -> tuple[str, str]:
    """``(short name, text)`` of how a crashed xdist worker process (its execnet ``gateway``) ended: the signal that
    killed it (SIGSEGV, SIGABRT, SIGKILL…) or its exit status."""
    import signal

    popen = getattr(getattr(gateway, "_io", None), "popen", None)
    code = None
    if popen is not None:
        try:
            code = popen.wait(timeout=10)
        except Exception:  # noqa: BLE001 - still running or already reaped elsewhere
            code = popen.returncode
    if code is None:
        return "unknown", "the worker process died (its exit status could not be read)"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        why = {"SIGSEGV": "a segmentation fault: memory read or written out of bounds, e.g. by a native kernel",
               "SIGABRT": "abort(): a failed assertion or check in native code",
               "SIGKILL": "killed: the kernel's OOM killer sends SIGKILL when memory runs out",
               "SIGBUS": "a bus error: a misaligned or unmapped memory access",
               "SIGFPE": "an arithmetic fault in native code",
               "SIGILL": "an illegal instruction: a kernel built for another CPU"}.get(name, "a fatal signal")
        return name, f"{name} ({why})"
    return f"exit {code}", (f"exit status {code} without a Python exception (os._exit, or exit() called from "
                            f"native code)")


def _plan_item(config, nodeid: str) -> tuple[str, dict] | None:
    """``(item id, PlanItem.describe())`` of a suite node id, from the controller's digest (None for other
    tests)."""
    digest = config.stash.get(DIGEST_KEY, None)
    if digest is None or "[" not in nodeid:
        return None
    from kvconform.digest import item_id

    described = digest.items.get(item_id(nodeid))
    return None if described is None else (item_id(nodeid), described)


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem, report, sched):
    """pytest-xdist: a worker died while running ``crashitem``. Turn xdist's bare "worker crashed" into the item's
    kvconform failure, and remember the subject so that its other items fail at once."""
    config = _CONFIG.get("config")
    if config is None or not is_active(config):
        return None
    planned = _plan_item(config, crashitem)
    if planned is None:
        return None
    from kvconform.digest import reproduce_line
    from kvconform.outcomes import read_breadcrumbs
    from kvconform.report import encode_property

    worker = getattr(report, "node", None)
    worker_id = getattr(getattr(worker, "gateway", None), "id", "?")
    name, how = _exit_text(getattr(worker, "gateway", None))
    rundir = getattr(config, "_kvconform_rundir", None)
    crumb = read_breadcrumbs(os.path.join(rundir, f"{worker_id}.crumb")) if rundir else None
    item_id, d = planned
    op = crumb[1] if crumb and crumb[0] == item_id else "none recorded (before the item's first op)"
    digest = config.stash[DIGEST_KEY]
    subject = digest.subject(d["subject"])
    message = "\n".join([
        f"{d['check']} failed: {d['subject']} on {d['model']}, case {d['case']}",
        f"  {d['subject']} killed its process: {how}",
        f"  last op started: {op}",
        f"  the session went on: pytest-xdist replaced worker {worker_id}; {d['subject']}'s other items fail "
        f"without running (each would take a worker down)",
        "  likely cause: a native kernel of the cache (C++, CUDA, Triton) crashed or aborted, the cache called "
        "os._exit, or it exhausted memory",
        "  " + reproduce_line(getattr(subject, "source", "builtin"), d["subject"],
                              digest.model_specs.get(d["model"], d["model"]), item_id, digest.reproduce_args)
        + "   (add -n 0 to see the crash itself)",
    ])
    report.longrepr = message
    report.when = "call"
    report.user_properties = [(PROPERTY, encode_property(d)),
                              (PROPERTY + "_metrics", encode_property({"crash": name, "last_op": op}))]
    if rundir:
        with open(os.path.join(rundir, "crashed.tsv"), "a", encoding="utf-8") as fh:
            fh.write(f"{d['subject']}\t{item_id}\t{how}\t{op}\n")
    return None


def _crashed_subject_message(config, item) -> str | None:
    """In a worker: the failure message for ``item`` when its subject already killed a worker this session."""
    rundir = getattr(config, "workerinput", {}).get(_RUNDIR_KEY)
    if not rundir:
        return None
    try:
        with open(os.path.join(rundir, "crashed.tsv"), encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in lines:
        subject, first, how, op = (line.split("\t") + ["", "", ""])[:4]
        if subject == item.subject.name:
            d = item.describe()
            return (f"{d['check']} failed: {d['subject']} on {d['model']}, case {d['case']}\n"
                    f"  not run: {subject} killed its process earlier in this session, in {first}: {how}; last op "
                    f"started: {op}\n"
                    f"  each of its items would take a worker down again; fix that crash first (its item's message "
                    f"says more)")
    return None


def _suite_items(items) -> list:
    """The items of kvconform's own suite module. A project's test decorated with ``parametrize_with_checks`` in the
    folder of a ``pytest --kvconform`` run is collected too and runs as the project's test; it is not counted in the
    matrix and the JSON report a second time (its items are the suite's items under another node id)."""
    return [it for it in items if Path(str(it.path)) in (SUITE_FILE, SELFTEST_FILE)]


def _write_own_failures_hint(terminalreporter, results) -> None:
    """Exit 1 with every conformance item green comes from the project's own tests collected beside the suite: say
    so, naming them, instead of leaving the user to find it under an all-green matrix."""
    if any(r["outcome"] in ("failed", "error", "internal") for r in results.values()):
        return
    own = [rep.nodeid for key in ("failed", "error") for rep in terminalreporter.stats.get(key, [])
           if PROPERTY not in dict(getattr(rep, "user_properties", None) or ())]
    own = list(dict.fromkeys(own))
    if not own:
        return
    shown = ", ".join(own[:3]) + (f" and {len(own) - 3} more" if len(own) > 3 else "")
    terminalreporter.write_line(
        f"kvconform: every conformance item conformed; the failures ({len(own)}) are the project's own tests, not "
        f"kvconform's: {shown}. Run the conformance suite alone with -m kvconform.", yellow=True)
