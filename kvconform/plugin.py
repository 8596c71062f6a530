"""kvconform's pytest plugin: hooks only. The option table and the readers of its values are in
``kvconform.options``, the xdist controller's work (workers, scheduling, the digest, crashes) in ``kvconform.workers``.

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
from kvconform.outcomes import UsageError
from kvconform.options import (CACHE, CASES, DURATIONS, FAULTS, HTML, JSON, MODEL, SELFTEST, SUBJECT, add_options,
                               check_usage, hooked_specs, is_active, opt, refuse_bad_subjects,
                               refuse_flags_without_kvconform, refuse_mistyped_specs, run_options, timeout_s)
from kvconform.run_options import RunOptions
from kvconform.workers import (DIGEST_KEY, PROPERTY, RESULTS_KEY, RUNDIR_KEY, SESSION_KEY, await_digest,
                               collector_paused_while_building, crash_setup, crash_teardown,
                               crashed_subject_message, distribute_by_default, freeze_heap_at_exit, freeze_worker_heap,
                               model_scheduling, report_crash, starts_workers, write_digest)
from kvconform.digest import BUILD_ERROR_FILE, USAGE_ERROR_FILE, write_atomically

SHARD_LINE_FILE = "shard-line.txt"
"""In the run folder: the ``--kvconform-shard`` line a worker computed at collection, for the controller to print."""

SUITE_DIR = Path(__file__).parent / "suite"
SUITE_FILE = SUITE_DIR / "test_conformance.py"
SELFTEST_FILE = SUITE_DIR / "test_selftest.py"


# ------------------------------------------------------------------------------------------------------ options
def pytest_addoption(parser):
    add_options(parser)


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


def refuse_unknown_markers(config) -> None:
    """``-m`` naming a ``kvconform_*`` marker that is not registered (``kvconform_logit`` for ``kvconform_logits``):
    pytest would start the workers (~10 s) to select nothing and exit 5 without a word on why.

    Raises:
        pytest.UsageError: naming the marker, the closest one and the family markers.
    """
    import difflib
    import re

    expression = config.getoption("markexpr", "") or ""
    registered = {line.split(":")[0].split("(")[0].strip() for line in config.getini("markers")}
    for name in re.findall(r"\bkvconform\w*", expression):
        if name not in registered:  # the user's own markers are registered too
            close = difflib.get_close_matches(name, list(MARKERS), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise pytest.UsageError(f"kvconform: -m {expression!r}: no item carries the marker {name!r}{hint} "
                                    f"(kvconform's markers: {', '.join(MARKERS)})")


def pytest_addhooks(pluginmanager):
    from kvconform import hookspecs

    pluginmanager.add_hookspecs(hookspecs)


# tryfirst: runs before pytest-benchmark's pytest_configure, which creates its storage folder.
@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    if not is_active(config):
        refuse_flags_without_kvconform(config)
        return
    _keep_benchmarks_out_of_the_folder(config)
    # torch's own deprecation of torch.jit.script_method, raised by modules transformers imports in every worker:
    # dozens of lines before the matrix that say nothing about the caches under test (only that one message)
    config.addinivalue_line("filterwarnings", "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
    freeze_heap_at_exit()
    worker_rundir = getattr(config, "workerinput", {}).get(RUNDIR_KEY)
    try:
        check_usage(config)
        if not hasattr(config, "workerinput"):
            refuse_unknown_markers(config)
            refuse_mistyped_specs(config)
            if starts_workers(config):
                refuse_bad_subjects(config)  # the workers would find it only after importing torch (~13 s)
        build = functools.partial(_build_session, config, run_options(config))
        if not hasattr(config, "workerinput"):
            _lock_report(config)
        if starts_workers(config):
            # the workers build the session and run the items; the controller reads the digest one of them writes,
            # or builds the session itself (pytest_collection_build)
            config._kvconform_pending_build = functools.partial(build, runs_items=False)
        else:
            with collector_paused_while_building():
                build()
            if worker_rundir:
                write_digest(config.stash[SESSION_KEY], worker_rundir)
            else:
                _set_digest(config, config.stash[SESSION_KEY].digest())
    except pytest.UsageError as exc:
        if worker_rundir:  # the controller raises it (exit 4) while it waits for the digest
            write_atomically(os.path.join(worker_rundir, USAGE_ERROR_FILE), str(exc))
        raise
    except Exception as exc:
        if worker_rundir:  # the controller raises it (exit 3) while it waits for the digest, instead of waiting on
            import traceback  # a worker that xdist keeps alive, waiting on the controller

            write_atomically(os.path.join(worker_rundir, BUILD_ERROR_FILE), "".join(traceback.format_exception(exc)))
        raise
    suite_ids = _point_suite_node_ids_at_the_suite(config)
    if not suite_ids and str(SUITE_DIR) not in config.args:
        config.args.append(str(SUITE_DIR))
    crash_setup(config)


def _lock_report(config) -> None:
    """Hold ``--kvconform-json PATH`` for this run (``report.ReportLock``, released at unconfigure): a second run
    writing the same report is a usage error naming the first, instead of the later run's results replacing the
    earlier's without a word. A run killed with SIGTERM (a CI job cancelled or out of time) ends as an interrupted
    one, so that its report says so.

    Raises:
        pytest.UsageError: another run holds the report.
    """
    path = opt(config, JSON)
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


def _build_session(config, options: RunOptions, runs_items=True) -> None:
    """Resolve the run's subjects (``--kvconform-cache`` and the ``pytest_kvconform_caches`` hook), models, cases and
    known faults (``session.build_session``) into the config's stash.

    Raises:
        pytest.UsageError: a bad cache spec, case file, known-faults file or model (exit 4, naming it).
    """
    from kvconform.session import build_session

    from kvconform.scratch import is_adapter

    hooked = hooked_specs(config)
    adapters = [h for h in hooked if is_adapter(h)]  # a model written from scratch (kvconform.scratch)
    hooked = [h for h in hooked if not is_adapter(h)]
    try:
        session = build_session(
            caches=[*opt(config, CACHE), *hooked], models=opt(config, MODEL), extra_models=adapters,
            case_paths=opt(config, CASES), known_faults=opt(config, FAULTS), only_subjects=opt(config, SUBJECT),
            runs_items=runs_items, options=options,
        )
    except UsageError as exc:  # SpecError, CaseFileError, KnownFaultsError, a bad model or subject name
        raise pytest.UsageError(f"kvconform: {exc}") from None
    config.stash[SESSION_KEY] = session


def _set_digest(config, digest) -> None:
    """The reporting process's digest (``DIGEST_KEY``) and its empty results."""
    config.stash[DIGEST_KEY] = digest
    config.stash[RESULTS_KEY] = {}


# A wrapper of pytest_collection: the first hook after pytest_sessionstart, where pytest-xdist's DSession has started
# the workers and the terminal has written its header (DSession's own pytest_collection returns at once in the
# controller, before non-wrapper implementations would run).
@pytest.hookimpl(wrapper=True, specname="pytest_collection")
def pytest_collection_build(session):
    """xdist controller: read the digest a worker writes once it has built its session (``await_digest``; the
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
        digest = await_digest(config)
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
    selftest = bool(opt(config, SELFTEST))
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


# after -k / -m deselection (trylast), so that the shares stay balanced
@pytest.hookimpl(trylast=True, specname="pytest_collection_modifyitems")
def pytest_collection_modifyitems_shard(session, config, items):
    """``--kvconform-shard I/N``: keep share I of the items (``merge.select_shard``), deselect the others. Then the
    items left (after -k / -m and the shard) are the ones the sampled power pass samples from
    (``KVSession.power_scope``)."""
    kv_session = config.stash.get(SESSION_KEY, None) if is_active(config) else None
    shard = kv_session.options.shard if kv_session is not None else None
    if shard:
        from kvconform.merge import read_durations, select_shard

        index, count = (int(x) for x in shard.split("/"))
        durations_path = opt(config, DURATIONS)
        durations = read_durations(durations_path) if durations_path else None
        kept, dropped = select_shard(items, index, count, durations)
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        items[:] = kept
        source = getattr(config, "_kvconform_shard_source", "")
        balance = "balanced by the durations of " + durations_path if durations else "balanced by estimated cost"
        config._kvconform_shard_line = (f"kvconform shard {shard}{f' ({source})' if source else ''}: {len(kept)} "
                                        f"of {len(kept) + len(dropped)} items, {balance} (merge the shards' "
                                        f"--kvconform-json reports with kvconform-merge)")
        worker_rundir = getattr(config, "workerinput", {}).get(RUNDIR_KEY)
        if worker_rundir:  # the xdist controller prints it (pytest_xdist_node_collection_finished)
            write_atomically(os.path.join(worker_rundir, SHARD_LINE_FILE), config._kvconform_shard_line)
    if kv_session is not None:
        kv_session.power_scope = {it.callspec.params["kv_item"].id for it in _suite_items(items)
                                  if "kv_item" in getattr(getattr(it, "callspec", None), "params", {})}


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
    rundir = getattr(config, "_kvconform_rundir", None)
    path = os.path.join(rundir, SHARD_LINE_FILE) if rundir else None
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if path and os.path.exists(path) and reporter is not None:  # the shard line a worker wrote (same in each)
        with open(path, encoding="utf-8") as fh:
            reporter.write_line(fh.read().strip())


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

    return build_session(builtin=False, timeout=timeout_s(request.config))


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


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist controller → worker: the same fuzz seed in every worker (``random`` is drawn once)."""
    seed = getattr(node.config, "_kvconform_fuzz_seed", None)
    if seed is not None:
        node.workerinput["kvconform_fuzz_seed"] = seed
    node.workerinput[RUNDIR_KEY] = getattr(node.config, "_kvconform_rundir", None)


@pytest.fixture
def kv_runner(kv_session, request):
    """``kv_runner(item)`` runs one conformance item and records its metrics on the report: through the session that
    planned it when ``kvconform.parametrize_with_checks`` did (its ``RunOptions``: ``api.planning_session``), else
    through ``kv_session``."""
    from kvconform.api import planning_session
    from kvconform.workers import item_timeout

    def run(item):
        __tracebackhide__ = True  # see _detached: pytest would read and parse this module for every failed item
        from kvconform.checks import CheckSkipped, ConformanceError, KnownFaultShown, KVConformInternalError, Unexcused
        from kvconform.report import encode_property

        session = planning_session(item) or kv_session
        metrics = {}
        benchmark = None
        crashed = crashed_subject_message(request.config, item)
        if crashed:
            request.node.user_properties.append((PROPERTY + "_metrics", encode_property({"crash": "earlier"})))
            raise ConformanceError(crashed)
        if item.check.timed:
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
            with item_timeout(session.options.timeout, item, session.options.reproduce_args):
                metrics.update(session.run(item, benchmark=benchmark))
        except CheckSkipped as exc:
            skipped = str(exc)
        except KnownFaultShown as exc:  # a known fault judged by its evidence, at run time
            metrics.update(exc.metrics)
            xfailed = str(exc)
        except (ConformanceError, Unexcused, KVConformInternalError) as exc:
            metrics.update(exc.metrics or {})
            failure = exc
            record = getattr(exc, "failure", None)  # the typed record (kvconform.failure.Failure), for the reports
            if record is not None:
                request.node.user_properties.append((PROPERTY + "_failure", encode_property(record.as_dict())))
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


def _record_report(config, report) -> None:
    """``pytest_runtest_logreport`` of an active run (``_RunHooks``): a kvconform item's report into the results."""
    props = dict(report.user_properties or ())
    if PROPERTY not in props:
        return
    if RESULTS_KEY not in config.stash:
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

    path = opt(config, JSON)
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


class _RunHooks:
    """The hooks pytest calls without the config (an item's report, a crashed item), registered with the config of
    an active run at session start (``RUN_HOOKS``) and unregistered at unconfigure: no module global holds it."""

    def __init__(self, config):
        self.config = config

    def pytest_runtest_logreport(self, report):
        _record_report(self.config, report)

    @pytest.hookimpl(optionalhook=True)
    def pytest_handlecrashitem(self, crashitem, report, sched):
        _handle_crashitem(self.config, crashitem, report)


RUN_HOOKS = "kvconform-run-hooks"


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    if is_active(session.config):
        if not session.config.pluginmanager.has_plugin(RUN_HOOKS):
            session.config.pluginmanager.register(_RunHooks(session.config), RUN_HOOKS)
        # before any item runs: a report at this path now says that this run has not finished (a run killed before
        # its next write leaves that, not an earlier run's report, which would read as this run's)
        _write_json_progress(session.config, now=True)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    # xdist workers' terminal output is not shown: the controller writes the one summary of the whole run (a
    # worker's known-fault summary planned the whole zoo's items for nothing: ~0.6 s at the end of each worker, py-spy)
    if not is_active(config) or RESULTS_KEY not in config.stash or hasattr(config, "workerinput"):
        return
    from kvconform.report import (reference_gaps, write_known_fault_summary, write_markdown_summary,
                                  write_own_gaps_summary, write_power_summary, write_terminal_matrix)

    results, digest = config.stash[RESULTS_KEY], config.stash[DIGEST_KEY]
    reference_gaps(results)
    write_terminal_matrix(terminalreporter, results, digest)
    write_power_summary(terminalreporter, results, digest)
    _write_own_failures_hint(terminalreporter, results)
    if opt(config, SELFTEST):
        from kvconform.report import write_selftest_summary

        write_selftest_summary(terminalreporter)
    else:
        write_known_fault_summary(terminalreporter, results, digest)
    write_own_gaps_summary(terminalreporter, results, digest)
    from kvconform.report import write_architecture_summary

    write_architecture_summary(terminalreporter, results)
    write_markdown_summary(results, os.environ.get("GITHUB_STEP_SUMMARY"), digest)
    progress = _progress(config, results, True, exitstatus)
    # --collect-only runs no item by design: the plan is not a session cut short
    if not progress["complete"] and progress["planned"] is not None and not config.getoption("collectonly", False):
        terminalreporter.write_line(f"kvconform: INCOMPLETE: {progress['incomplete']}; the matrix shows only the "
                                    f"items that finished" + (" (and so does the JSON report, which says so)"
                                                              if opt(config, JSON) else ""), red=True)


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if not is_active(config):
        return
    if hasattr(config, "workerinput"):
        freeze_worker_heap()
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
    path = opt(config, HTML)
    if path:
        from kvconform.html_report import write_html
        from kvconform.report import json_payload

        with _JSON_LOCK:
            results = config.stash[RESULTS_KEY]
            payload = json_payload(results, config.stash[DIGEST_KEY], _progress(config, results, True, exitstatus))
        write_html(path, payload, config.stash[DIGEST_KEY])


def pytest_unconfigure(config):
    hooks = config.pluginmanager.get_plugin(RUN_HOOKS)
    if hooks is not None:
        config.pluginmanager.unregister(hooks, RUN_HOOKS)
    crash_teardown(config)
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


@pytest.hookimpl(wrapper=True)
def pytest_cmdline_main(config):
    # a wrapper: runs before pytest-xdist's own pytest_cmdline_main, which turns -n into its workers
    distribute_by_default(config)
    return (yield)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist: under the default distribution (``distribute_by_default``) the items of one model go to one
    worker, a model at a time (``ModelScheduling``), so that each model and its oracle are built in one process
    instead of in every worker. A distribution the user chose (``-n``, ``--dist``) is left to pytest-xdist."""
    if not getattr(config, "_kvconform_distributed", False):
        return None
    return model_scheduling(config, log)


def _handle_crashitem(config, crashitem, report) -> None:
    """pytest-xdist's ``pytest_handlecrashitem`` in an active run (``_RunHooks``): a worker died while running
    ``crashitem``. Turn xdist's bare "worker crashed" into the item's kvconform failure, and remember the subject so
    that its other items fail at once (``workers.report_crash``)."""
    report_crash(config, crashitem, report)


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
