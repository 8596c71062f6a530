"""Reports people and CI dashboards read: JUnit XML from kvconform-merge, shards from the CI's own variables, and
reports that never lose or misstate data (a report held by one run at a time, a report cut short says so — in the
JSON report, the terminal, the HTML page and the merge —, mistyped specs refused before any worker starts)."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from kvconform import junit, merge
from kvconform.digest import item_id
from kvconform.outcomes import UsageError

REPO = Path(__file__).resolve().parents[2]
CI_VARIABLES = ("CI_NODE_INDEX", "CI_NODE_TOTAL", "BUILDKITE_PARALLEL_JOB", "BUILDKITE_PARALLEL_JOB_COUNT",
                "JOB_COMPLETION_INDEX", "GITHUB_ACTIONS")


@pytest.fixture(autouse=True)
def _no_ci_variables(monkeypatch):
    """This test run may itself be a CI job: the runs a test starts see only the variables it sets."""
    for name in CI_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env.update(extra)
    return env


# ------------------------------------------------------------------------------------------------------ JUnit XML
def _counts(root):
    suite = root.find("testsuite")
    return {k: int(suite.get(k)) for k in ("tests", "failures", "errors", "skipped")}


def test_merge_junitxml_has_one_testcase_per_item_with_messages_reasons_and_known_faults(run_kvconform, pytester):
    """A real run with a failure (a faulty cache), skips (CUDA-only subjects) and a known upstream fault's xfail: the
    JUnit XML of kvconform-merge parses back with the JSON report's counts, class = subject, name = item id, the
    failure's whole message, each skip's reason, each xfail's fault id. pytest's own --junitxml of the same run has
    one testcase per item too, with kvconform's message (what docs/reports.md says of a single run)."""
    result = run_kvconform("--kvconform-model", "llama", "--kvconform-cache",
                           "kvconform.testing.faulty_logits:HiddenWindowCache", "-k",
                           "(HiddenWindowCache and decode_explicit) or (StaticCache and crop)",
                           "--kvconform-json", "r.json", "--junitxml", "pytest-junit.xml")
    assert result.ret == 1, result.stdout.str()
    report = json.loads((pytester.path / "r.json").read_text())
    records = {item_id(r["nodeid"]): r for r in report["results"]}
    by_outcome = {o: [r for r in records.values() if r["outcome"] == o] for o in ("failed", "skipped", "xfailed")}
    assert all(by_outcome.values()), {o: len(r) for o, r in by_outcome.items()}  # each kind is there to be checked
    assert report["complete"] is True and report["planned"] == report["finished"] == len(records)

    code = merge.main(["--junitxml", str(pytester.path / "k.xml"), str(pytester.path / "r.json")])
    assert code == 1  # a failed item
    root = ET.parse(pytester.path / "k.xml").getroot()
    assert _counts(root) == {"tests": len(records), "failures": len(by_outcome["failed"]), "errors": 0,
                             "skipped": len(by_outcome["skipped"]) + len(by_outcome["xfailed"])}
    cases = {c.get("name"): c for c in root.iter("testcase")}
    assert set(cases) == set(records)
    for name, record in records.items():
        case = cases[name]
        assert case.get("classname") == record["subject"]
        props = {p.get("name"): p.get("value") for p in case.find("properties")}
        assert props["model"] == "llama" and props["outcome"] == record["outcome"]
        if record["outcome"] == "failed":
            failure = case.find("failure")
            assert failure.text == record["message"] and "reproduce: pytest --kvconform" in failure.text
            assert failure.get("message") == record["message"].splitlines()[0]
        elif record["outcome"] == "skipped":
            assert case.find("skipped").get("message") == record["message"] and record["message"]
        elif record["outcome"] == "xfailed":
            fault = record["metrics"]["known_fault"]
            skipped = case.find("skipped")
            assert skipped.get("type") == "pytest.xfail"
            assert skipped.get("message") == f"known upstream fault {fault!r}: {record['message']}"
        else:
            assert case.find("failure") is None and case.find("skipped") is None
    suite_props = {p.get("name"): p.get("value") for p in root.find("testsuite").find("properties")}
    assert suite_props["complete"] == "true" and suite_props["transformers"] == report["environment"]["transformers"]

    own = ET.parse(pytester.path / "pytest-junit.xml").getroot()
    own_cases = list(own.iter("testcase"))
    assert len(own_cases) == len(records)
    for case in own_cases:
        name = case.get("name")
        assert case.get("classname") == "test_conformance" and name.startswith("test_conformance[")
        record = records[name.removeprefix("test_conformance[").removesuffix("]")]
        if record["outcome"] == "failed":
            assert case.find("failure").text.startswith(record["message"].splitlines()[0])


def _report(shard=None, records=(), **state):
    env = {"kvconform": "0", "transformers": "5", "torch": "2", "device": "cpu", "strict": False,
           "subjects": ["DynamicCache"], "models": ["llama"], **({"shard": shard} if shard else {})}
    return {"schema": 1, **state, "environment": env,
            "results": [{"nodeid": f"test_conformance.py::test_conformance[{n}]", "subject": "DynamicCache",
                         "model": "llama", "check": "check_x", "family": "logits", "case": "c", "outcome": o,
                         "message": m, "metrics": mt} for n, o, m, mt in records]}


def test_junit_of_an_incomplete_report_is_red_and_xml_safe(tmp_path):
    records = [("a", "passed", "", {}), ("b", "xpassed", "reason", {"known_fault": "f1"}),
               ("c", "failed", "check_x failed: \x1b[31mred\x1b[0m\x00\n  reproduce: ...", {})]
    report = _report(records=records, complete=False, planned=5, finished=3,
                     incomplete="interrupted (SIGTERM) after 3 of 5 items had finished")
    path = tmp_path / "j.xml"
    junit.write_junit(str(path), report)
    root = ET.parse(path).getroot()  # control characters in a message do not break the file
    assert _counts(root) == {"tests": 4, "failures": 1, "errors": 1, "skipped": 0}
    run = next(c for c in root.iter("testcase") if c.get("classname") == "kvconform")
    assert run.get("name") == "run complete"
    assert run.find("error").get("message") == "INCOMPLETE: interrupted (SIGTERM) after 3 of 5 items had finished"
    xpass = next(c for c in root.iter("testcase") if c.get("name") == "b")
    assert "XPASS" in xpass.find("system-out").text and "'f1'" in xpass.find("system-out").text
    assert "\\x1b[31mred" in next(c for c in root.iter("testcase") if c.get("name") == "c").find("failure").text


def test_merge_is_complete_only_when_every_shard_is(tmp_path, capsys):
    one = _report("1/2", [("a", "passed", "", {})], complete=True, planned=1, finished=1, incomplete=None)
    two = _report("2/2", [("b", "passed", "", {})], complete=False, planned=4, finished=1,
                  incomplete="interrupted (KeyboardInterrupt: Ctrl-C) after 1 of 4 items had finished")
    old = _report("2/2", [("b", "passed", "", {})])  # written before reports carried their state: complete
    paths = {}
    for name, payload in (("1.json", one), ("2.json", two), ("old.json", old)):
        paths[name] = tmp_path / name
        paths[name].write_text(json.dumps(payload))
    code = merge.main(["--json", str(tmp_path / "m.json"), "--junitxml", str(tmp_path / "m.xml"), "--html",
                       str(tmp_path / "m.html"), str(paths["1.json"]), str(paths["2.json"])])
    assert code == 1
    assert "INCOMPLETE: 2 of 5 planned items finished" in capsys.readouterr().err
    merged = json.loads((tmp_path / "m.json").read_text())
    assert (merged["complete"], merged["planned"], merged["finished"]) == (False, 5, 2)
    assert "2.json: interrupted (KeyboardInterrupt: Ctrl-C)" in merged["incomplete"]
    assert [m["complete"] for m in merged["environment"]["merged_from"]] == [True, False]
    assert _counts(ET.parse(tmp_path / "m.xml").getroot())["errors"] == 1
    assert 'id="kv-incomplete"' in (tmp_path / "m.html").read_text()
    assert merge.main(["--json", str(tmp_path / "m2.json"), str(paths["1.json"]), str(paths["old.json"])]) == 0
    assert json.loads((tmp_path / "m2.json").read_text())["complete"] is True


# ------------------------------------------------------------------------------------------------------ shard auto
@pytest.mark.parametrize("text, env, share", [
    ("2/4", {"CI_NODE_INDEX": "3", "CI_NODE_TOTAL": "4"}, (2, 4)),  # given explicitly: the variables are not read
    ("auto", {"CI_NODE_INDEX": "1", "CI_NODE_TOTAL": "3"}, (1, 3)),  # GitLab: 1-based
    ("auto", {"CI_NODE_INDEX": "3", "CI_NODE_TOTAL": "3"}, (3, 3)),
    ("auto", {"BUILDKITE_PARALLEL_JOB": "0", "BUILDKITE_PARALLEL_JOB_COUNT": "3"}, (1, 3)),  # Buildkite: 0-based
    ("auto", {"BUILDKITE_PARALLEL_JOB": "2", "BUILDKITE_PARALLEL_JOB_COUNT": "3"}, (3, 3)),
    ("auto/5", {"JOB_COMPLETION_INDEX": "4"}, (5, 5)),  # a Kubernetes indexed Job: 0-based, the count given
    ("auto", {"CI_NODE_TOTAL": "1", "BUILDKITE_PARALLEL_JOB": "1", "BUILDKITE_PARALLEL_JOB_COUNT": "2"}, (2, 2)),
])
def test_shard_auto_reads_the_ci_variables(text, env, share):
    assert merge.resolve_shard(text, env)[:2] == share


@pytest.mark.parametrize("text, env, message", [
    ("auto", {}, "no CI variable says this job's share"),
    ("auto", {"GITHUB_ACTIONS": "true", "CI_NODE_TOTAL": "1"}, "GitHub Actions exports no such variable"),
    ("auto", {"JOB_COMPLETION_INDEX": "0"}, "give their number, --kvconform-shard auto/N"),
    ("auto", {"CI_NODE_INDEX": "0", "CI_NODE_TOTAL": "4"}, "outside the 4 jobs (CI_NODE_INDEX counts from 1)"),
    ("auto", {"BUILDKITE_PARALLEL_JOB": "4", "BUILDKITE_PARALLEL_JOB_COUNT": "4"}, "counts from 0"),
    ("auto", {"CI_NODE_INDEX": "x", "CI_NODE_TOTAL": "4"}, "expected non-negative integers"),
    ("auto", {"BUILDKITE_PARALLEL_JOB": "1"}, "BUILDKITE_PARALLEL_JOB_COUNT is not"),
    ("auto/3", {"CI_NODE_INDEX": "1", "CI_NODE_TOTAL": "4"}, "GitLab CI runs 4 jobs (CI_NODE_TOTAL=4), not 3"),
    ("auto", {"CI_NODE_INDEX": "1", "CI_NODE_TOTAL": "2", "BUILDKITE_PARALLEL_JOB": "1",
              "BUILDKITE_PARALLEL_JOB_COUNT": "2"}, "the CI variables disagree"),
    ("automatic", {}, "expected auto, auto/N"),
])
def test_shard_auto_refuses_what_does_not_give_one_share(text, env, message):
    with pytest.raises(UsageError, match="--kvconform-shard") as info:
        merge.resolve_shard(text, env)
    assert message in str(info.value)


def test_shard_auto_in_a_run_takes_the_share_the_ci_gives(run_kvconform, monkeypatch):
    """GitLab's second of two jobs and Buildkite's second (index 1) run the items that --kvconform-shard 2/2 runs;
    with no variable set the run stops at once (exit 4) naming the variables and GitHub's matrix."""
    select = ("--kvconform-model", "llama", "-m", "kvconform_logits", "--collect-only", "-q")

    def ids(*args):
        result = run_kvconform(*select, *args)
        assert result.ret == 0, result.stdout.str() + result.stderr.str()
        line = next(s for s in result.outlines if s.startswith("kvconform shard"))
        return line, sorted(s for s in result.outlines if "::" in s)

    _, explicit = ids("--kvconform-shard", "2/2")
    monkeypatch.setenv("CI_NODE_INDEX", "2")
    monkeypatch.setenv("CI_NODE_TOTAL", "2")
    line, gitlab = ids("--kvconform-shard", "auto")
    assert line.startswith("kvconform shard 2/2 (GitLab CI: CI_NODE_INDEX=2, CI_NODE_TOTAL=2): ")
    for name in ("CI_NODE_INDEX", "CI_NODE_TOTAL"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("BUILDKITE_PARALLEL_JOB", "1")
    monkeypatch.setenv("BUILDKITE_PARALLEL_JOB_COUNT", "2")
    _, buildkite = ids("--kvconform-shard", "auto")
    assert explicit == gitlab == buildkite and explicit
    for name in ("BUILDKITE_PARALLEL_JOB", "BUILDKITE_PARALLEL_JOB_COUNT"):
        monkeypatch.delenv(name)
    result = run_kvconform("--kvconform-shard", "auto")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    err = result.stderr.str()
    for name in ("CI_NODE_INDEX", "BUILDKITE_PARALLEL_JOB", "JOB_COMPLETION_INDEX", "GitHub Actions"):
        assert name in err, err


def _template_shards(path: str):
    """(what the CI sets in each of its parallel jobs, the shard command) of a ci/ template."""
    data = yaml.safe_load((REPO / "ci" / path).read_text())
    if "gitlab" in path:
        job = data["kvconform-shard"]
        n = job["parallel"]
        return [{"CI_NODE_INDEX": str(i), "CI_NODE_TOTAL": str(n)} for i in range(1, n + 1)], " ".join(job["script"])
    step = next(s for s in data["steps"] if isinstance(s, dict) and "parallelism" in s)
    n = step["parallelism"]
    return ([{"BUILDKITE_PARALLEL_JOB": str(i), "BUILDKITE_PARALLEL_JOB_COUNT": str(n)} for i in range(n)],
            step["command"])


@pytest.mark.parametrize("path", ["kvconform-architectures.gitlab-ci.yml", "kvconform-architectures.buildkite.yml"])
def test_ci_templates_use_the_cis_own_parallelism(path):
    """The GitLab and Buildkite templates run --kvconform-shard auto in the CI's parallel jobs: the variables the CI
    sets in its jobs give every share of one split once; the merge writes the JUnit XML."""
    jobs, command = _template_shards(path)
    assert "--kvconform-shard auto" in command and len(jobs) > 1
    shares = [merge.resolve_shard("auto", env)[:2] for env in jobs]
    assert sorted(shares) == [(i, len(jobs)) for i in range(1, len(jobs) + 1)]
    assert "kvconform-merge --json kvconform.json --junitxml kvconform-junit.xml" in (REPO / "ci" / path).read_text()


# ------------------------------------------------------------------------------------------------------ integrity
SLOW_CACHE = textwrap.dedent('''
    import time
    from transformers import DynamicCache

    class SlowCache(DynamicCache):
        def update(self, *args, **kwargs):
            time.sleep(0.05)
            return super().update(*args, **kwargs)
''')


def _start(tmp_path, *args, env=None):
    # the power pass off: these runs are about interrupting a run of plain items (a mutant run would triple a slow
    # item's time and move the moments the tests interrupt at)
    cmd = [sys.executable, "-m", "pytest", "--kvconform", "-p", "no:cacheprovider", "-p", "no:randomly",
           "--kvconform-model", "llama", "--kvconform-cache", "slow.py:SlowCache", "--kvconform-subject", "SlowCache",
           "--kvconform-power", "off", *args]
    # SIGINT back to its default in the child: a suite started in the background by a non-interactive shell
    # (`pytest tests &`) ignores SIGINT, children inherit that, and Python then installs no KeyboardInterrupt handler,
    # so the Ctrl-C test's signal would do nothing
    return subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env or _env(KVCONFORM_WORKERS="0"),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _wait_for(predicate, timeout=300, proc=None):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run ended first: {proc.returncode}\n{proc.stdout.read()[-3000:]}"
                                 f"{proc.stderr.read()[-2000:]}")
        time.sleep(0.2)
    raise AssertionError("timed out")


def _read(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _running(path):
    """The report once the run has items finished (it says it is not complete yet)."""
    data = _read(path)
    return data if data and data.get("planned") and data.get("finished", 0) >= 2 else None


def test_two_runs_never_write_one_report_and_an_interrupted_one_says_so(tmp_path):
    """While a run writes r.json, a second run given r.json stops at once (exit 4) naming the first and the fix,
    instead of replacing its results. The first run, ended by SIGTERM (a cancelled CI job), writes a report that
    says it is not complete, with its planned and finished counts; then the path is free again."""
    (tmp_path / "slow.py").write_text(SLOW_CACHE)
    report = tmp_path / "r.json"
    first = _start(tmp_path, "--kvconform-json", "r.json", "--kvconform-html", "r.html")
    running = _wait_for(lambda: _running(report), proc=first)
    assert running["complete"] is False and "written while the run was going on" in running["incomplete"]
    assert (tmp_path / "r.json.lock").exists()

    start = time.monotonic()
    second = subprocess.run([sys.executable, "-m", "pytest", "--kvconform", "-p", "no:cacheprovider",
                             "--kvconform-model", "gpt2", "--kvconform-json", "r.json"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300, env=_env())
    refused_in = time.monotonic() - start
    assert second.returncode == 4, second.stdout[-2000:] + second.stderr[-2000:]
    assert f"another kvconform run is writing this report now (pid {first.pid} on " in second.stderr
    assert "--kvconform-model llama" in second.stderr and "--kvconform-json r-2.json" in second.stderr
    assert (_read(report) or {}).get("environment", {}).get("models") == ["llama"]  # the first run's report, intact

    first.send_signal(signal.SIGTERM)
    out, err = first.communicate(timeout=300)
    assert first.returncode == pytest.ExitCode.INTERRUPTED, out[-2000:] + err[-2000:]
    data = _read(report)
    assert data["complete"] is False and data["incomplete"].startswith("interrupted (SIGTERM) after ")
    assert 2 <= data["finished"] == len(data["results"]) < data["planned"], {k: data[k] for k in ("planned",
                                                                                                   "finished")}
    assert "kvconform: INCOMPLETE: interrupted (SIGTERM)" in out
    page = (tmp_path / "r.html").read_text()  # the page says so too
    assert 'id="kv-incomplete"' in page and "interrupted (SIGTERM)" in page
    assert not (tmp_path / "r.json.lock").exists()
    print(f"second run refused in {refused_in:.1f} s")


def test_a_killed_run_leaves_a_report_that_says_it_was_cut_short(tmp_path):
    """SIGKILL leaves no time to write: the report on disk is the last one written while the run went on, and it
    says so (complete: false). The kernel let the lock go with the process: the next run takes the path."""
    (tmp_path / "slow.py").write_text(SLOW_CACHE)
    report = tmp_path / "r.json"
    report.write_text(json.dumps({"schema": 1, "complete": True, "results": []}))  # an earlier run's report
    run = _start(tmp_path, "--kvconform-json", "r.json")
    _wait_for(lambda: _running(report), proc=run)
    run.kill()
    run.communicate(timeout=60)
    data = _read(report)
    assert data["complete"] is False and "it was killed before it could finish the report" in data["incomplete"]
    assert data["finished"] == len(data["results"]) >= 2 and data["planned"] > data["finished"]
    again = subprocess.run([sys.executable, "-m", "pytest", "--kvconform", "-p", "no:cacheprovider",
                            "--kvconform-model", "llama", "-k", "ReferenceCache and decode_explicit",
                            "--kvconform-json", "r.json"], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                           env=_env(KVCONFORM_WORKERS="0"))
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    data = _read(report)
    assert (data["complete"], data["planned"], data["finished"], data["incomplete"]) == (True, 1, 1, None)
    assert not (tmp_path / "r.json.lock").exists()


def test_ctrl_c_under_workers_leaves_an_incomplete_report(tmp_path):
    """The default run (pytest-xdist workers) interrupted with Ctrl-C (SIGINT to the controller): the controller
    writes the report of what finished, complete: false."""
    (tmp_path / "slow.py").write_text(SLOW_CACHE)
    report = tmp_path / "r.json"
    env = _env()
    env.pop("KVCONFORM_WORKERS", None)
    run = _start(tmp_path, "-n", "2", "--kvconform-json", "r.json", env=env)
    _wait_for(lambda: _running(report), proc=run)
    run.send_signal(signal.SIGINT)
    out, err = run.communicate(timeout=300)
    data = _read(report)
    assert data["complete"] is False, out[-3000:] + err[-2000:]
    assert data["incomplete"].startswith("interrupted (KeyboardInterrupt: Ctrl-C) after ")
    assert data["finished"] == len(data["results"]) < data["planned"]


def test_mistyped_specs_are_refused_before_workers_start_and_without_torch(tmp_path):
    """Under the default distribution (workers), a class-name typo in a --kvconform-cache file, a module that does
    not exist, a mistyped zoo name, a malformed case file or known-faults file are usage errors in the controller at
    configure time: no worker starts, torch is not imported, and a zoo-name typo gets a "did you mean"."""
    (tmp_path / "mycache.py").write_text("from transformers import DynamicCache\n\nclass MyCache(DynamicCache):\n"
                                         "    pass\n")
    script = textwrap.dedent("""
        import sys, time, pytest
        start = time.monotonic()
        code = pytest.main(["--kvconform", "-p", "no:cacheprovider", "-n", "2", *sys.argv[1:]])
        took = round(time.monotonic() - start, 2)
        print("exit", int(code), "torch imported", "torch" in sys.modules, "seconds", took)
    """)
    cases = [(["--kvconform-cache", "mycache.py:MyCahce"],
              "'mycache.py:MyCahce': file 'mycache.py' has no attribute 'MyCahce' (did you mean 'MyCache'?)"),
             (["--kvconform-cache", "no_such_module_xyz:Cache"],
              "importing 'no_such_module_xyz' failed: ModuleNotFoundError"),
             (["--kvconform-model", "lama"], "--kvconform-model 'lama': not a zoo name (did you mean 'llama'?)"),
             (["--kvconform-cases", "mine.toml"], "mine.toml: case 'x': key 'ops': expected list, got str"),
             (["--kvconform-cases", "no_such_folder"], "no_such_folder: no such case file or folder"),
             (["--kvconform-known-faults", "faults.toml"], "faults.toml: cannot read known-faults file")]
    (tmp_path / "mine.toml").write_text('[[case]]\nid = "x"\ncheck = "check_prefill_then_decode"\n'
                                        'ops = "prefill 4, decode 2"\n')
    (tmp_path / "faults.toml").write_text("x = [\n")
    for args, text in cases:
        proc = subprocess.run([sys.executable, "-c", script, *args], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300, env=_env())
        assert "exit 4 torch imported False" in proc.stdout, proc.stdout + proc.stderr
        assert text in proc.stderr and "gw0" not in proc.stdout + proc.stderr, proc.stderr
        # importing the subject's module imports torch before pytest's warning filters apply: only the error is shown
        assert "DeprecationWarning" not in proc.stderr and "warnings.warn" not in proc.stderr, proc.stderr
        print(args, proc.stdout.strip().splitlines()[-1])


def test_subjects_refused_by_their_import_are_usage_errors_before_any_item_runs(tmp_path):
    """Under the default distribution (workers), a cache class whose constructor needs an argument, a class that is
    not a cache, a budget-key typo, a name a built-in subject has and a --kvconform-subject typo are usage errors
    (exit 4) with the session's own messages and nothing else: a spec is judged first of all where the workers build
    their session (the controller never imports it, nor torch: ``options.refuse_bad_subjects``); a subject-name typo
    without --kvconform-cache is judged in the controller before the workers start."""
    (tmp_path / "mine.py").write_text(textwrap.dedent("""
        from transformers import DynamicCache

        class NeedsArgs(DynamicCache):
            def __init__(self, size):
                super().__init__()

        class NotACache:
            pass

        class BudgetTypo(DynamicCache):
            kvconform_lossy = {"kl_mx": 0.05, "top1_min": 0.8}

        class DynamicCache(DynamicCache):
            pass
    """))
    script = textwrap.dedent("""
        import sys, time, pytest
        start = time.monotonic()
        code = pytest.main(["--kvconform", "-p", "no:cacheprovider", "-n", "2", *sys.argv[1:]])
        took = round(time.monotonic() - start, 2)
        print("exit", int(code), "torch imported", "torch" in sys.modules, "seconds", took)
    """)
    cases = [(["--kvconform-cache", "mine.py:NeedsArgs"], "NeedsArgs requires 'size', which kvconform cannot pass"),
             (["--kvconform-cache", "mine.py:NotACache"], "NotACache is a class but not a transformers.Cache subclass"),
             (["--kvconform-cache", "mine.py:BudgetTypo"], "unknown budget keys 'kl_mx' (did you mean 'kl_max'?)"),
             (["--kvconform-cache", "mine.py:DynamicCache"], "a built-in subject is already named 'DynamicCache'"),
             (["--kvconform-subject", "DynamicCach"], "--kvconform-subject 'DynamicCach': no such subject; did you "
                                                       "mean 'DynamicCache'?"),
             (["--kvconform-cache", "mine.py:NeedsArgs", "--kvconform-subject", "NeedArgs"],
              "NeedsArgs requires 'size'")]
    for args, text in cases:
        proc = subprocess.run([sys.executable, "-c", script, *args], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300, env=_env())
        assert "exit 4 torch imported False" in proc.stdout, proc.stdout + proc.stderr
        assert text in proc.stderr, proc.stderr
        # no worker's report of its own (a crash, "node down", a traceback): the error alone
        assert not re.search(r"\[gw\d+\]|node down|Traceback", proc.stdout + proc.stderr), proc.stdout + proc.stderr
        # the modules the workers import raise torch's own deprecations: none of them is shown beside the error
        assert "DeprecationWarning" not in proc.stderr and "warnings.warn" not in proc.stderr, proc.stderr
        if "--kvconform-cache" not in args:
            assert "bringing up nodes" not in proc.stdout, proc.stdout  # refused before the workers start
        print(args, proc.stdout.strip().splitlines()[-1])


def test_a_subject_added_by_a_spec_is_not_refused_by_the_controller(tmp_path):
    """The controller's early check knows the subjects --kvconform-cache adds: naming one with --kvconform-subject
    runs its items in the workers."""
    (tmp_path / "mine.py").write_text("from transformers import DynamicCache\n\nclass MyCache(DynamicCache):\n"
                                      "    pass\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "--kvconform", "-p", "no:cacheprovider", "-n", "1",
                           "--kvconform-cache", "mine.py:MyCache", "--kvconform-subject", "MyCache",
                           "--kvconform-model", "llama", "-k", "prefill_then_decode and decode_explicit", "-q"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600, env=_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout, proc.stdout


def test_a_cache_module_that_fails_to_import_is_refused_before_the_session_is_built(tmp_path):
    """A file that parses but does not import is judged by importing it: the first thing a session does, before
    the checks, cases and built-in subjects (exit 4 with the import's error)."""
    (tmp_path / "broken.py").write_text("from transformers import NoSuchCacheClass\n\nclass Mine:\n    pass\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "--kvconform", "-p", "no:cacheprovider",
                           "--kvconform-cache", "broken.py:Mine"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env=_env(KVCONFORM_WORKERS="0"))
    assert proc.returncode == 4
    assert "'broken.py:Mine': importing 'broken.py' failed: ImportError: cannot import name 'NoSuchCacheClass'" \
        in proc.stderr, proc.stderr


@pytest.mark.parametrize("ini_file, text", [
    ("pytest.ini", "[pytest]\nkvconform = true\nkvconform_model =\n    llama\n    gpt2\n"),
    ("pyproject.toml", '[tool.pytest.ini_options]\nkvconform = true\nkvconform_model = ["llama", "gpt2"]\n'),
    ("pytest.ini", "[pytest]\nkvconform = true\nkvconform_model = llama gpt2\n"),
])
def test_an_ini_twin_takes_several_values_one_per_line_or_as_a_toml_list(pytester, ini_file, text):
    """What docs/flags.md says of ini twins: one value per line (or a list in pyproject.toml); one line is one value."""
    (pytester.path / ini_file).write_text(text)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--collect-only", "-q", "-k",
                                           "ReferenceCache and decode_explicit")
    if "llama gpt2" in text:
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        assert "--kvconform-model 'llama gpt2': not a zoo name" in result.stderr.str()
        return
    assert result.ret == 0, result.stdout.str() + result.stderr.str()
    ids = [line for line in result.outlines if "::" in line]
    assert {line.split("-")[1] for line in ids} == {"llama", "gpt2"}, ids


def test_the_shard_line_is_printed_under_workers_too(run_kvconform):
    # the default run distributes to workers, which collect and cut the shard; the controller prints their line
    result = run_kvconform("--kvconform-model", "llama", "-m", "kvconform_lifecycle", "--kvconform-shard", "1/2",
                           "-n", "2")
    assert result.ret == 0, result.stdout.str()
    lines = [s for s in result.outlines if s.startswith("kvconform shard 1/2: ")]
    assert len(lines) == 1 and "balanced by estimated cost" in lines[0], result.stdout.str()
