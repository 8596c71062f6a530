"""kvconform's meta-tests drive the plugin in subprocesses (pytester), so torch/dynamo state never leaks."""

import os


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

