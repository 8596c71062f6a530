"""The fork server the tests start their pytest runs from (tests/forkserver.py) gives each run what a fresh
interpreter would have: its folder, environment, ``sys.path``, its own ``random`` seed, its output and exit status;
and a run past its timeout is killed."""

import os
import subprocess

import pytest

import forkserver

pytestmark = pytest.mark.skipif(not forkserver.enabled(), reason="KVCONFORM_TESTS_FORK=0: runs use fresh interpreters")

PROBE = """
import os, random, sys

def test_probe():
    print("cwd", os.getcwd())
    print("env", os.environ.get("FORKSERVER_PROBE"))
    print("path0", sys.path[0])
    print("random", random.random())
    print("dont_write_bytecode", sys.dont_write_bytecode)
    print("fail", os.environ.get("FORKSERVER_FAIL"))
    assert not os.environ.get("FORKSERVER_FAIL")
"""


def _values(stdout: str) -> dict:
    return dict(line.split(" ", 1) for line in stdout.splitlines()
                if line.split(" ", 1)[0] in ("cwd", "env", "path0", "random", "dont_write_bytecode", "fail"))


def test_a_forked_run_is_a_fresh_run_of_its_folder_and_environment(tmp_path):
    (tmp_path / "test_probe.py").write_text(PROBE)
    env = {**os.environ, "FORKSERVER_PROBE": "seen", "PYTHONDONTWRITEBYTECODE": "1"}
    args = ["-s", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "test_probe.py"]
    first = forkserver.run_pytest(args, cwd=tmp_path, env=env, timeout=120)
    second = forkserver.run_pytest(args, cwd=tmp_path, env=env, timeout=120)
    assert first.returncode == 0 and second.returncode == 0, first.stdout + first.stderr
    one, two = _values(first.stdout), _values(second.stdout)
    assert one["cwd"] == str(tmp_path) and one["path0"] == str(tmp_path) and one["env"] == "seen"
    assert one["dont_write_bytecode"] == "True"
    assert one["random"] != two["random"]  # each run draws its own seed, as a fresh interpreter does
    failing = forkserver.run_pytest(args, cwd=tmp_path, env={**env, "FORKSERVER_FAIL": "1"}, timeout=120)
    assert failing.returncode == 1 and "1 failed" in failing.stdout


def test_a_run_past_its_timeout_is_killed_and_the_server_goes_on(tmp_path):
    (tmp_path / "test_slow.py").write_text("import time\n\ndef test_slow():\n    time.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        forkserver.run_pytest(["-q", "-p", "no:cacheprovider", "test_slow.py"], cwd=tmp_path, env=dict(os.environ),
                              timeout=3)
    (tmp_path / "test_quick.py").write_text("def test_quick():\n    pass\n")
    after = forkserver.run_pytest(["-q", "-p", "no:cacheprovider", "test_quick.py"], cwd=tmp_path,
                                  env=dict(os.environ), timeout=120)
    assert after.returncode == 0 and "1 passed" in after.stdout, after.stdout + after.stderr
