"""kvconform's meta-tests drive the plugin in subprocesses (pytester), so torch/dynamo state never leaks."""

import os
import sys

import pytest
from _pytest import pytester as _pytester

import forkserver

pytest_plugins = ["pytester"]

# Modules that register native state when first imported (torch libraries: ``TORCH_LIBRARY(c10d_functional)`` by
# ``torch.distributed``, quanto's and hqq's operators) cannot be imported twice in one process. pytester snapshots
# ``sys.modules`` before each test (and around each in-process run) and drops every module imported after: a model
# built inside a test loads ``torch.distributed`` modules, pytester drops them, and the next transformers model import
# re-registers the library ("Only a single TORCH_LIBRARY can be used to register the namespace ..."), so tests failed
# by the order they ran in. These packages are kept across snapshots; kvconform's own modules are still dropped, so
# each in-process run imports its plugin and session afresh. ``kernels`` too: transformers keeps its ``Mode`` enum, and
# a re-imported kernels package has another, which from_pretrained's kernelize then cannot compare (TypeError).
NATIVE_PACKAGES = ("torch", "torchgen", "functorch", "transformers", "optimum", "hqq", "triton", "safetensors",
                   "tokenizers", "numpy", "scipy", "sympy", "huggingface_hub", "turboquant", "kernels")


def _keeps_native_state(name: str) -> bool:
    return name.split(".", 1)[0] in NATIVE_PACKAGES


class _SysModulesSnapshot(_pytester.SysModulesSnapshot):
    """pytester's snapshot, keeping the modules of ``NATIVE_PACKAGES`` imported after it was taken."""

    def __init__(self, preserve=None):
        super().__init__(preserve=lambda name: _keeps_native_state(name) or bool(preserve and preserve(name)))


_pytester.SysModulesSnapshot = _SysModulesSnapshot


@pytest.fixture
def run_kvconform(pytester):
    """``run_kvconform(*args)`` → ``RunResult`` of ``pytest --kvconform -p no:cacheprovider *args`` in an empty dir."""

    def run(*args, timeout=600):
        # -p no:randomly: a user's run, in the suite's order (pytest-randomly, in the dev extra, would shuffle it)
        args = ("--kvconform", "-p", "no:cacheprovider", "-p", "no:randomly", *args)
        if not forkserver.enabled():
            return pytester.runpytest_subprocess(*args, timeout=timeout)
        return _forked_run(pytester, args, timeout)

    return run


def _forked_run(pytester, args, timeout):
    """What ``pytester.runpytest_subprocess(*args)`` does (a numbered ``--basetemp`` folder, the folder and
    environment ``pytester.popen`` gives, the output echoed), through ``forkserver.run_pytest``."""
    import subprocess
    import time

    from _pytest.pathlib import make_numbered_dir
    from _pytest.pytester import RunResult

    basetemp = make_numbered_dir(root=pytester.path, prefix="runpytest-", mode=0o700)
    args = (f"--basetemp={basetemp}", *args)
    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH", "")]))
    print("running (forked):", "pytest", *args)
    start = time.monotonic()
    try:
        proc = forkserver.run_pytest(args, os.getcwd(), env, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise pytester.TimeoutExpired(f"{timeout} second timeout expired running: pytest {args}") from None
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    try:
        ret = pytest.ExitCode(proc.returncode)
    except ValueError:
        ret = proc.returncode
    return RunResult(ret, proc.stdout.splitlines(), proc.stderr.splitlines(), time.monotonic() - start)


def _warm_bytecode(config) -> None:
    """Write, once, the bytecode every subprocess run would otherwise compile again: kvconform's modules (an editable
    install has none) and hypothesis's. hypothesis ships a pytest plugin, so pytest rewrites the asserts of its whole
    package when a run imports it (the fuzz family does): ~1.5 CPU-s a process, each time, when nothing may be cached.
    The subprocess runs below do not write bytecode (the modules the tests write would be cached by path and
    modification time), but they read what is cached here: a run like theirs, of one hypothesis test, ~2 s. Only in
    the process that starts the run (not in an xdist worker), and not when the user asked for no bytecode
    (``PYTHONDONTWRITEBYTECODE`` set before the run)."""
    if sys.dont_write_bytecode or hasattr(config, "workerinput"):
        return
    import compileall
    import subprocess
    import tempfile

    import kvconform

    compileall.compile_dir(os.path.dirname(kvconform.__file__), quiet=2, workers=1)
    with tempfile.TemporaryDirectory() as folder:
        test = os.path.join(folder, "test_warm.py")
        with open(test, "w") as f:
            f.write("from hypothesis import HealthCheck, Phase, given, seed, settings, strategies as st\n"
                    "@seed(0)\n@settings(max_examples=2, database=None, deadline=None)\n"
                    "@given(st.lists(st.one_of(st.tuples(st.just('a'), st.integers(0, 3))), max_size=3))\n"
                    "def test_warm(program):\n    pass\n")
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider", test],
                       cwd=folder, capture_output=True, timeout=120, check=False)


def pytest_configure(config):
    _warm_bytecode(config)
    # Subprocess runs inherit this interpreter; make sure they find the same kvconform.
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    # The project's tests patch models, forwards and kvconform's own code in process: the oracle's forwards are not
    # kept between runs here (kvconform.oracle.DiskMemo; tests/engine/test_oracle_disk_memo.py turns it on where it
    # tests it). Not in a `pytest --kvconform` started from the project's folder, which loads this file too
    # (testpaths) and is a run like a user's.
    if not config.getoption("kvconform", False):
        os.environ.setdefault("KVCONFORM_CACHE", "off")


def pytest_unconfigure(config):
    forkserver.close()


SHARED_RUN_MODULES = {
    "test_crashes.py": "its module-scoped crashed_run (a default run whose four subjects each kill a worker, ~60 s)",
    "test_html_report.py": "its module-scoped run (llama and gpt2, two families, ~15 s) and its browser",
}
"""Modules whose tests share one module-scoped kvconform run: their tests go to one worker (which then runs it once,
not once per worker that gets one of them)."""


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`pytest tests -n auto`: tests that share one kvconform run (e.g. the faulty caches of
    tests/caches/test_faulty_caches.py, whose parameter ids end in ``@<group>``, and the modules of
    ``SHARED_RUN_MODULES``)
    go to one worker, which runs it once; every other test is a unit of its own, as under ``--dist load``; the
    largest groups start first. A distribution chosen
    on the command line (``--dist ...``) is kept. (pytest-xdist's own ``--dist loadgroup`` groups by a node-id suffix
    that its worker hook writes to ``item._nodeid``, which pytest 9 no longer reads: the groups are not kept there.)"""
    if config.option.dist != "load" or "--dist" in " ".join(config.invocation_params.args):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedRunScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.partition("::")[0]
            if module.rpartition("/")[2] in SHARED_RUN_MODULES:
                return "module " + module
            param = nodeid.partition("[")[2].removesuffix("]")
            return "group " + param.rpartition("@")[2] if "@" in param else nodeid

    return SharedRunScheduling(config, log)


@pytest.fixture(autouse=True)
def _inner_runs_are_not_xdist_workers(monkeypatch):
    """Under ``pytest tests -n auto`` this process is an xdist worker, and its environment says so
    (``PYTEST_XDIST_WORKER``): the pytest runs a test starts (pytester, subprocesses) would inherit it, and
    pytest-benchmark would then disable itself there, so their speed items would skip. Each run a test starts is a
    plain user run: without the worker's variables."""
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID"):
        monkeypatch.delenv(name, raising=False)
    # `pytest --kvconform` runs its items in pytest-xdist workers by default (kvconform/plugin.py, "crashes"); the
    # runs a test starts are small, and worker start-ups would cost more than they save: in-process, unless a test
    # asks for workers (-n) or unsets this (tests/plugin/test_crashes.py runs the default).
    monkeypatch.setenv("KVCONFORM_WORKERS", "0")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """In-process tests with tiny models: several torch threads on a shared 2-core machine oversubscribe and run
    many times slower (the plugin does the same for its own runs, see kvconform.session._limit_threads)."""
    if "torch" not in sys.modules:  # tests that never import torch stay torch-free
        yield
        return
    torch = sys.modules["torch"]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
