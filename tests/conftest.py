"""kvconform's meta-tests drive the plugin in subprocesses (pytester), so torch/dynamo state never leaks."""

import os
import sys

import pytest

pytest_plugins = ["pytester"]


@pytest.fixture
def run_kvconform(pytester):
    """``run_kvconform(*args)`` → ``RunResult`` of ``pytest --kvconform -p no:cacheprovider *args`` in an empty dir."""

    def run(*args, timeout=600):
        return pytester.runpytest_subprocess("--kvconform", "-p", "no:cacheprovider", *args, timeout=timeout)

    return run


def pytest_configure(config):
    # Subprocess runs inherit this interpreter; make sure they find the same kvconform.
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")



@pytest.fixture(autouse=True)
def _inner_runs_are_not_xdist_workers(monkeypatch):
    """Under ``pytest tests -n auto`` this process is an xdist worker, and its environment says so
    (``PYTEST_XDIST_WORKER``): the pytest runs a test starts (pytester, subprocesses) would inherit it, and
    pytest-benchmark would then disable itself there, so their speed items would skip. Each run a test starts is a
    plain user run: without the worker's variables."""
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID"):
        monkeypatch.delenv(name, raising=False)


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
