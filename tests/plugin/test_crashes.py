"""A subject that kills its process (segfault, abort, os._exit, SIGKILL as the OOM killer sends it) fails its own
items with a kvconform message naming the subject, the signal and the last op started; every other item, the matrix
and the JSON report are complete; exit code 1. ``pytest --kvconform`` runs its items in pytest-xdist workers by
default for that (kvconform/plugin.py, "crashes"). One plugin run serves every assertion."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("xdist")

CRASHING = textwrap.dedent('''
    import ctypes, os, signal
    from transformers import DynamicCache

    class _OnDecode(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            if key_states.shape[-2] == 1:
                self.die()
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    class SegvCache(_OnDecode):
        def die(self):
            ctypes.string_at(0)

    class AbortingCache(_OnDecode):
        def die(self):
            os.abort()

    class ExitingCache(_OnDecode):
        def die(self):
            os._exit(3)

    class OomKilledCache(_OnDecode):  # what the kernel's OOM killer does: SIGKILL
        def die(self):
            os.kill(os.getpid(), signal.SIGKILL)
''')
NAMES = ("SegvCache", "AbortingCache", "ExitingCache", "OomKilledCache")
SIGNALS = {"SegvCache": "SIGSEGV", "AbortingCache": "SIGABRT", "ExitingCache": "exit status 3",
           "OomKilledCache": "SIGKILL"}


CONTROLLER_PROBE = textwrap.dedent('''
    import sys

    def pytest_unconfigure(config):
        if not hasattr(config, "workerinput"):  # the xdist controller
            built = sorted(m for m in ("kvconform.session", "kvconform.suite", "torch") if m in sys.modules)
            with open("controller_imports.txt", "w") as fh:
                fh.write(" ".join(built))
''')
"""A conftest.py that records which of kvconform's session modules the xdist controller imported."""


@pytest.fixture(scope="module")
def crashed_run(tmp_path_factory):
    """One default run (no -n: kvconform distributes by itself) of the four crashing subjects and ReferenceCache on
    llama, two cases: ``(exit code, stdout, JSON records)``. Its folder's conftest.py is ``CONTROLLER_PROBE``."""
    folder = tmp_path_factory.mktemp("crashes")
    (folder / "crashing.py").write_text(CRASHING)
    (folder / "conftest.py").write_text(CONTROLLER_PROBE)
    args = [sys.executable, "-m", "pytest", "--kvconform", "-p", "no:cacheprovider", "-p", "no:randomly",
            "--kvconform-model", "llama", "--kvconform-json", "r.json", "-k",
            "prefill_then_decode and (decode_explicit_positions or decode_implicit_positions)"]
    for name in NAMES:
        args += ["--kvconform-cache", f"crashing.py:{name}", "--kvconform-subject", name]
    args += ["--kvconform-subject", "ReferenceCache"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env.pop("KVCONFORM_WORKERS", None)
    proc = subprocess.run(args, cwd=folder, capture_output=True, text=True, timeout=900, env=env)
    records = json.loads((folder / "r.json").read_text())["results"]
    return proc.returncode, proc.stdout, records, (folder / "controller_imports.txt").read_text()


def test_the_controller_only_reports_from_the_digest_a_worker_wrote(crashed_run):
    """The xdist controller of a default run builds no session: it reads the digest a worker wrote
    (kvconform/digest.py), never importing the session (building a session there took ~5 s
    of CPU on the two cores the workers start on), nor torch: the ``--kvconform-cache`` specs are imported where the
    workers build their sessions, first of all (``options.refuse_bad_subjects``). Its header lines, crash messages,
    matrix and JSON come from that digest."""
    code, out, records, controller_imports = crashed_run
    assert controller_imports == ""
    assert out.count("kvconform subjects: ") == 1
    assert out.index("test session starts") < out.index("kvconform subjects: ") < out.index("conformance matrix")


def test_each_crash_fails_its_items_with_subject_signal_and_last_op(crashed_run):
    code, out, records, _ = crashed_run
    assert code == 1, out[-3000:]
    by_subject = {}
    for r in records:
        by_subject.setdefault(r["subject"], []).append(r)
    for name in NAMES:
        ran = by_subject[name]
        assert ran and all(r["outcome"] == "failed" for r in ran), [(r["case"], r["outcome"]) for r in ran]
        first = [r for r in ran if "killed its process:" in r["message"]]
        assert first, [r["message"] for r in ran]
        message = first[0]["message"]
        assert message.startswith(f"check_prefill_then_decode failed: {name} on llama"), message
        assert SIGNALS[name] in message, message
        assert "last op started: decode 1 of" in message, message
        assert "--kvconform-cache crashing.py:" + name in message
        assert not message.startswith("[gw")  # the worker's line is not part of the message
        for other in ran:
            assert SIGNALS[name] in other["message"], other["message"]  # the others name the first crash


def test_the_session_survives_with_every_other_item_the_matrix_and_the_json(crashed_run):
    code, out, records, _ = crashed_run
    reference = [r for r in records if r["subject"] == "ReferenceCache"]
    assert len(reference) == 2 and all(r["outcome"] == "passed" for r in reference), reference
    assert len(records) == 2 * (len(NAMES) + 1)
    assert "subjects × check families" in out and "models × subjects" in out
    for name in NAMES:
        assert f"{name} " in out.split("subjects × check families")[1]


def test_the_json_report_is_written_as_items_finish(tmp_path):
    """A session killed from outside (here: SIGKILL to the in-process run, -n 0) leaves the items it finished."""
    (tmp_path / "late.py").write_text(textwrap.dedent('''
        import os, signal, time
        from transformers import DynamicCache

        class KillsTheSessionCache(DynamicCache):
            def update(self, *args, **kwargs):
                time.sleep(2.5)  # past the report's rewrite interval: the finished items are on disk
                os.kill(os.getpid(), signal.SIGKILL)
    '''))
    args = [sys.executable, "-m", "pytest", "--kvconform", "-p", "no:cacheprovider", "-p", "no:randomly", "-n", "0",
            "--kvconform-model", "llama", "--kvconform-cache", "late.py:KillsTheSessionCache",
            "--kvconform-json", "r.json", "-k", "decode_explicit_positions and (ReferenceCache or KillsTheSession)"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    proc = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-2000:]
    records = json.loads((tmp_path / "r.json").read_text())["results"]
    assert [(r["subject"], r["outcome"]) for r in records] == [("ReferenceCache", "passed")]


def test_workers_that_die_building_the_session_end_the_run_with_a_usage_error(tmp_path):
    """A subject module that kills every process importing it (here: each xdist worker, as a native extension built
    for another CPU would) ends the run at once with exit 4 naming how the workers ended, instead of pytest-xdist
    replacing them without end (each replacement dies the same way)."""
    (tmp_path / "dies_on_import.py").write_text(textwrap.dedent('''
        import os
        if os.environ.get("PYTEST_XDIST_WORKER"):
            os._exit(3)
        from transformers import DynamicCache

        class NeverBuilt(DynamicCache):
            pass
    '''))
    args = [sys.executable, "-m", "pytest", "--kvconform", "-p", "no:cacheprovider", "-p", "no:randomly",
            "--kvconform-model", "llama", "--kvconform-cache", "dies_on_import.py:NeverBuilt"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env.pop("KVCONFORM_WORKERS", None)
    proc = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "every worker process ended while building the session" in proc.stderr, proc.stderr
    assert "gw0: exit status 3" in proc.stderr and "--kvconform-cache dies_on_import.py:NeverBuilt" in proc.stderr
    assert "replacing crashed worker" not in proc.stdout


def test_a_worker_raising_while_building_the_session_ends_the_run(tmp_path):
    """A session build that raises something other than a usage error in the workers (a bug in kvconform or in what
    it imports: transformers 5.5's architecture survey once did) ends the run as an internal error carrying the
    worker's traceback. The controller used to wait for the digest for ever while xdist kept the workers waiting on
    it (seen in a 5.5 architecture sweep under -n 2)."""
    (tmp_path / "conftest.py").write_text(textwrap.dedent('''
        import pytest

        @pytest.hookimpl(tryfirst=True)
        def pytest_configure(config):
            if hasattr(config, "workerinput"):
                import kvconform.session

                def build_session(*args, **kwargs):
                    raise RuntimeError("planted: the session build raises")

                kvconform.session.build_session = build_session
    '''))
    args = [sys.executable, "-m", "pytest", "--kvconform", "-p", "no:cacheprovider", "-p", "no:randomly", "-n", "2",
            "--kvconform-model", "llama", "-k", "ReferenceCache and decode_explicit_positions"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    proc = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == pytest.ExitCode.INTERNAL_ERROR, out[-3000:]
    assert "a worker raised while building the session" in out and "planted: the session build raises" in out
