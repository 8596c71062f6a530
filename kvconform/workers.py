"""The xdist controller and its workers (ARCHITECTURE.md, "Crashes and workers"): where a run's state lives in the
config's stash, how many workers a default run starts (``default_workers``, ``distribute_by_default``), the
scheduling of one model per worker (``model_scheduling``), the digest a worker writes and the controller reads
(``write_digest``, ``await_digest``), and a crashed worker's item turned into its kvconform failure
(``crash_setup``, ``report_crash``, ``crashed_subject_message``). The hooks that call these are in
``kvconform.plugin``. Torch-free at the top level.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile

import pytest

from kvconform.options import CACHE, is_active, opt
from kvconform.plan import SKIPPED_COST
from kvconform.digest import BUILD_ERROR_FILE, DIGEST_FILE, RunDigest, USAGE_ERROR_FILE, item_id, reproduce_line
from kvconform.outcomes import close_breadcrumbs, open_breadcrumbs, read_breadcrumbs

PROPERTY = "kvconform"
"""The user property that carries an item's record (``PlanItem.record``) on its report."""
SESSION_KEY = pytest.StashKey["object"]()
"""The process's ``KVSession`` (not in the controller of a run whose workers write the digest)."""
DIGEST_KEY = pytest.StashKey["object"]()
"""The ``digest.RunDigest`` the reports read, in the process that reports (the controller, or a run without
workers)."""
RESULTS_KEY = pytest.StashKey["dict"]()
"""Item records (``report.record_report``), in the process that reports."""

# A subject with a native kernel can kill its process (segfault, abort, os._exit, the OOM killer's SIGKILL), which no
# try/except catches. `pytest --kvconform` therefore runs its items in pytest-xdist workers by default: the controller
# replaces a crashed worker and the session goes on. The crashed item fails with a kvconform message naming the
# subject, the signal and the last op started (read from the worker's breadcrumb file, kvconform.outcomes); the
# subject's other items fail at once naming that crash (each would take a worker down again). `-n 0` (or
# KVCONFORM_WORKERS=0) runs in-process, without that protection.

WORKERS_ENV = "KVCONFORM_WORKERS"
RUNDIR_KEY = "kvconform_rundir"
"""The ``workerinput`` key of the run's folder (breadcrumbs, ``crashed.tsv``, the digest)."""

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

def distribute_by_default(config) -> None:
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
    if _only_scratch_models(config):
        # only from-scratch models (plain PyTorch, kvconform.scratch): in process, since starting a worker costs
        # more than their default tier (the worked example: 6 s of items, 17 s wall -n 0, 23 s with one worker,
        # on a loaded 2-core machine); -n N restores the workers
        return
    opt.numprocesses = workers
    if getattr(opt, "maxworkerrestart", None) is None:
        opt.maxworkerrestart = "1000"  # bounded anyway: a crashed subject's other items do not run
    config._kvconform_distributed = True


def _only_scratch_models(config) -> bool:
    """Whether every ``--kvconform-model`` names a model adapter (``kvconform.scratch``): a source that runs in
    process (``ModelSource.runs_in_process``)."""
    from kvconform.options import MODEL
    from kvconform.sources import source_of

    models = opt(config, MODEL) or []
    return bool(models) and all(source_of(m).runs_in_process for m in models)


def starts_workers(config) -> bool:
    """True in the controller of a pytest-xdist run (pytest-xdist's own condition for starting workers: a
    distribution mode and not ``--collect-only``)."""
    return (not hasattr(config, "workerinput") and config.getoption("dist", "no") != "no"
            and not config.getoption("collectonly", False))

STARTED_FIRST = ("compile",)
"""Families whose items form a scope of their own per model, given to the workers before every other scope: a
compile item is one long item whose time depends on torch's compile cache (a decode compiled with inductor: 20 s of
one core cold, 2.8 s warm, measured on llama), so started first it runs beside its model's other items instead of
after them."""


def model_scheduling(config, log):
    """A ``ModelScheduling`` (defined here: pytest-xdist is imported only when it distributes)."""
    from xdist.scheduler import LoadScopeScheduling

    class ModelScheduling(LoadScopeScheduling):
        """pytest-xdist's load-scope scheduling with one scope per model (a node id of another test is a scope of
        its own), and one per model for each family of ``STARTED_FIRST``. Those scopes go to the workers first; the
        others follow, the costliest first (the sum of their items' estimated costs, ``RunDigest.costs``), as
        workers free up. A crashed worker's item is not run again by another worker: it is reported once, by
        ``pytest_handlecrashitem``."""

        def __init__(self, config, log=None):
            super().__init__(config, log)
            digest = config.stash[DIGEST_KEY]
            self._items = digest.items
            self._costs = digest.costs
            self._ordered = False

        def _split_scope(self, nodeid: str) -> str:
            record = self._items.get(item_id(nodeid))
            if record is None:
                return nodeid
            if record["family"] in STARTED_FIRST and self._costs.get(item_id(nodeid), 0.0) > SKIPPED_COST:
                return f"{record['family']} {record['model']}"  # a compile item that runs (a skip stays with its model)
            return "model " + record["model"]

        def _assign_work_unit(self, node):
            if not self._ordered:  # the first assignment: every scope is queued (LoadScopeScheduling.schedule)
                self._ordered = True
                ordered = sorted(self.workqueue.items(), key=self._priority)
                self.workqueue.clear()
                self.workqueue.update(ordered)
            super()._assign_work_unit(node)

        def _priority(self, scope_and_unit) -> tuple:
            scope, unit = scope_and_unit
            cost = sum(self._costs.get(item_id(nodeid), 1.0) for nodeid in unit)
            return scope.partition(" ")[0] not in STARTED_FIRST, -cost

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


# ------------------------------------------------------------------------------------------------------ the digest

def write_digest(session, rundir: str) -> None:
    """xdist worker: write the session's digest for the controller, unless another worker already has (every
    worker builds the same session)."""
    if not os.path.exists(os.path.join(rundir, DIGEST_FILE)):
        session.digest().write(rundir)

DIGEST_POLL_S = 0.02


class BuildError(RuntimeError):
    """A worker's session build raised something other than a usage error (``await_digest``)."""


def await_digest(config):
    """xdist controller: the ``RunDigest`` the first worker to build its session writes to the run's folder (~5 s
    after the start, while the controller has nothing else to do: the workers run no item before it returns).
    Returns None when it cannot come: every worker process has ended without writing it, or the workers' processes
    cannot be watched (then the controller builds the session itself).

    Raises:
        pytest.UsageError: the usage error a worker found building its session (exit 4, its message).
        BuildError: another exception a worker raised building its session (pytest's internal error, exit 3, with
            the worker's traceback).
    """
    import time

    rundir = getattr(config, "_kvconform_rundir", None)
    if not rundir:
        return None

    def arrived():
        try:
            with open(os.path.join(rundir, BUILD_ERROR_FILE), encoding="utf-8") as fh:
                raise BuildError(f"kvconform: a worker raised while building the session (a bug in kvconform or in "
                                 f"what it imports, not in your input; run with -n 0 to see it in one process):\n"
                                 f"{fh.read()}")
        except FileNotFoundError:
            pass
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
        time.sleep(DIGEST_POLL_S)

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
    caches = opt(config, CACHE) or []
    imported = (f"the subjects' modules ({', '.join(f'--kvconform-cache {c}' for c in caches)}), " if caches else "")
    return (f"kvconform: every worker process ended while building the session, before any item ran ({ends}). "
            f"Building it imports {imported}the conftest.py hooks, torch, transformers and the models; a crash "
            f"there would end any process that runs the items. Run with -n 0 (in one process) to see where it "
            f"crashes.")


# ------------------------------------------------------------------------------------------------------ crashes

def crash_setup(config) -> None:
    """Controller: a folder for the workers' breadcrumbs and the crashed subjects. Worker: its breadcrumb file."""
    worker = getattr(config, "workerinput", None)
    if worker is not None:
        if worker.get(RUNDIR_KEY):
            open_breadcrumbs(os.path.join(worker[RUNDIR_KEY], f"{worker.get('workerid', 'gw')}.crumb"))
        return
    if config.getoption("dist", "no") != "no":
        config._kvconform_rundir = tempfile.mkdtemp(prefix="kvconform-run-")

def crash_teardown(config) -> None:
    import shutil

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

    described = digest.items.get(item_id(nodeid))
    return None if described is None else (item_id(nodeid), described)

def report_crash(config, crashitem: str, report) -> None:
    """Controller (``pytest_handlecrashitem``): a worker died while running ``crashitem`` (a node id). Turn xdist's
    bare "worker crashed" ``report`` into the item's kvconform failure (message, ``when = "call"``, the item's
    properties), and append the subject to ``crashed.tsv`` so that its other items fail at once. Other tests' node
    ids are left as they are."""
    planned = _plan_item(config, crashitem)
    if planned is None:
        return
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

def crashed_subject_message(config, item) -> str | None:
    """In a worker: the failure message for ``item`` when its subject already killed a worker this session."""
    rundir = getattr(config, "workerinput", {}).get(RUNDIR_KEY)
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

def freeze_worker_heap() -> None:
    """xdist worker, at the end of its session: move every object to the collector's permanent generation
    (``gc.freeze``). pytest's ``pytest_unconfigure`` then runs one full collection to report unraisable exceptions,
    which in a worker walked the whole heap of torch, transformers and the models (~0.5 s, while the controller
    waits for the worker to end) to report to nobody: the worker has sent its last event to the controller
    (pytest-xdist's ``workerfinished``, right after this hook) and the controller reads no more."""
    import gc

    gc.freeze()


@contextlib.contextmanager
def collector_paused_while_building():
    """Around a process's session build (torch, transformers and the backends imported, the plan made): the cyclic
    garbage collector is paused, and what the build leaves is moved to its permanent generation (``gc.freeze``) at the
    end, then the collector runs again as before.

    The build creates ~500,000 tracked objects (the modules, classes and functions of torch and transformers) that
    live as long as the process. Left to the collector, the import alone triggered 8 full collections (1.1 s per
    worker process, measured with ``gc.callbacks`` on the 2-core AMD EPYC), and every full collection during the
    items walked the same heap again (~70 ms each, 2-26 per worker in a default run). Frozen, they are never walked;
    the objects of the items (models, caches, tensors) are collected as before. Import-time cycles that were already
    garbage stay allocated (the build makes few). Nothing is frozen when the build raises."""
    import gc

    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
        gc.freeze()
    finally:
        if enabled:
            gc.enable()


@functools.cache  # once per process
def freeze_heap_at_exit() -> None:
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


# ------------------------------------------------------------------------------------------ the per-item timeout
class ItemTimeout(BaseException):
    """Raised inside an item that ran past ``--kvconform-timeout`` (converted to a ConformanceError). A
    BaseException, so that the checks' ``except Exception`` around subject calls does not swallow it."""


def item_timeout(seconds: float, item, reproduce_args=()):
    """Context manager failing ``item`` (a ``plan.PlanItem``) with a ConformanceError after ``seconds`` (POSIX main
    thread only; a hang inside one native call is interrupted when it returns to Python). ``seconds <= 0`` disables
    it."""
    import contextlib
    import signal
    import threading

    @contextlib.contextmanager
    def guard():
        usable = seconds > 0 and hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
        if not usable:
            yield
            return

        def on_alarm(signum, frame):
            raise ItemTimeout()

        previous = signal.signal(signal.SIGALRM, on_alarm)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            yield
        except ItemTimeout:
            from kvconform.checks import ConformanceError, reproduce_line

            d = item.describe()
            raise ConformanceError(
                f"{d['check']} failed: {d['subject']} on {d['model']}, case {d['case']}\n"
                f"  no result after {seconds:g} s (per-item timeout, --kvconform-timeout)\n"
                f"  likely cause: the subject hangs (an endless loop, a lock) or is pathologically slow\n"
                f"  {reproduce_line(item.subject, item.model.spec, item.id, reproduce_args)}",
                {"timeout_s": seconds}) from None
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)

    return guard()
