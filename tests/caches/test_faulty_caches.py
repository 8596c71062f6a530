"""Every faulty cache is caught: kvconform's own (``kvconform/testing``) by exactly the family it targets, with
its message and its "likely cause:" line pinned; the shared ones (``../shared/faulty_caches``) by the family their
README names.

The faulty caches share their runs: one ``pytest --kvconform`` subprocess per group of caches (each cache on its own
model, selected with ``-k``), and each test reads its cache's records from that run's JSON report. One start-up and
one model and oracle build per group instead of per cache (70 runs became 7). Under ``pytest tests -n auto`` a group
(the ``@<group>`` ending of a test's id) goes to one worker (tests/conftest.py's scheduler), which runs it once.
"""

import json
import os
import re
from pathlib import Path

import pytest

import forkserver

from kvconform.testing import faulty_caches
from kvconform.zoo import VLM_NAMES

FAULTY = faulty_caches()
SHARED = Path(__file__).resolve().parents[3] / "shared" / "faulty_caches" / "faulty_caches.py"
# family names of shared/faulty_caches → kvconform check families
SHARED_FAMILY = {"logits": "logits", "api-contract": "contract", "crop": "crop", "prefix-reuse": "prefix",
                 "batch-reorder": "batch", "reset": "lifecycle", "compile": "compile", "memory": "memory",
                 "speed": "speed", "mamba-state": "logits", "sliding-window": "logits"}
SHARED_MODEL = {"llama": "llama", "mistral_sw8": "mistral", "mamba": "mamba"}
GROUPS = 4  # groups of the bundled faulty caches on text models (speed, speculative and VLM faults: a group each)
OWN_GROUP = ("speed", "speculative")
"""Families whose faulty caches run in a group of their own, and which the other groups do not run: their items
are slow (benchmarks) or exercise what every fault touches (a whole speculative generate()), and only their own
faulty caches target them (tests/perf/test_perf.py and tests/semantics/test_speculative.py run them on correct
caches)."""
_TEXT_FAULTY = [f for f in FAULTY if f.family not in OWN_GROUP and f.model not in VLM_NAMES]  # over GROUPS groups
_RUNS: dict[str, dict] = {}  # group → {(subject, model): [records]}, once per process


def _group(faulty) -> str:
    if faulty.family in OWN_GROUP:
        return f"faulty-{faulty.family}"
    if faulty.model in VLM_NAMES:  # the vision-language models are the slowest to run: a group of their own
        return "faulty-vlm"
    return f"faulty-{_TEXT_FAULTY.index(faulty) % GROUPS}"


def _run_group(group: str, tmp_path_factory, specs, models, selection: str, marks: tuple[str, ...] = ()) -> dict:
    """``pytest --kvconform`` in a subprocess over ``specs`` (cache specs) and ``models``, the items ``selection``
    (a ``-k`` expression) names; returns the JSON report's records by ``(subject, model)``. A plain user run: in-process
    (``KVCONFORM_WORKERS=0``), without this worker's xdist variables, in the suite's order."""
    if group in _RUNS:
        return _RUNS[group]
    folder = tmp_path_factory.mktemp(group)
    # no power pass (mutants of the items that passed): it never decides an item's outcome, these tests read none of
    # it, and it was 30% of a group's CPU (tests/plugin/test_power.py covers it)
    args = ["--kvconform", "-p", "no:cacheprovider", "-p", "no:randomly", "-q",
            "--kvconform-json", "r.json", "--kvconform-power", "off", "-k", selection, *marks]
    for spec in specs:
        args += ["--kvconform-cache", spec]
    for model in sorted(set(models)):
        args += ["--kvconform-model", model]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env.update(KVCONFORM_WORKERS="0", PYTHONDONTWRITEBYTECODE="1")
    proc = forkserver.run_pytest(args, cwd=folder, env=env, timeout=1800)
    report = folder / "r.json"
    assert report.is_file(), f"{group}: no JSON report (exit {proc.returncode})\n{proc.stdout[-4000:]}{proc.stderr}"
    records: dict = {}
    for r in json.loads(report.read_text())["results"]:
        records.setdefault((r["subject"], r["model"]), []).append(r)
    _RUNS[group] = records
    return records


def _bundled_records(faulty, tmp_path_factory):
    group = _group(faulty)
    members = [f for f in FAULTY if _group(f) == group]
    # the fuzz family runs only on the caches it targets: 20 caches list it in also_caught_by (it is expected to catch
    # them too, which asserts nothing), and hypothesis shrinking each one's failing program was over half of a
    # group's run. Its precision on correct caches: tests/semantics/test_semantics.py and the main job (every built-in
    # subject).
    selection = " or ".join(f"({f.attr} and {f.model}{'' if f.family == 'fuzz' else ' and not kvconform_fuzz'})"
                            for f in members)
    # every family but those of OWN_GROUP, which run only in their own group (speed's benchmarks are most of a row's
    # time; speculative runs a whole generate() that every fault touches)
    others = [f for f in OWN_GROUP if group != f"faulty-{f}"]
    marks = ("-m", " and ".join(f"not kvconform_{f}" for f in others))
    return _run_group(group, tmp_path_factory, sorted({f.spec for f in members}), [f.model for f in members],
                      selection, marks)


def _cause_line(message: str) -> str:
    lines = [line.strip() for line in message.splitlines() if line.strip().startswith("likely cause:")]
    assert len(lines) == 1, message
    return lines[0]


@pytest.mark.parametrize("faulty", [pytest.param(f, id=f"{f.name}@{_group(f)}") for f in FAULTY])
def test_bundled_faulty_cache_caught_by_its_family(faulty, tmp_path_factory):
    """Caught by its check and case, with its message fragments, its likely-cause line (``FaultyCache.cause``), and
    failing no family outside ``FaultyCache.family`` / ``also_caught_by``."""
    assert faulty.cause, f"{faulty.name}: FaultyCache.cause (the regex its likely-cause line must match) is empty"
    assert faulty.case, f"{faulty.name}: FaultyCache.case is empty; pin the one case that catches it"
    records = _bundled_records(faulty, tmp_path_factory).get((faulty.attr, faulty.model), [])
    assert records, f"{faulty.name}: no items of {faulty.attr} on {faulty.model} in its group's run"
    failed = [r for r in records if r["outcome"] == "failed"]
    target = [r for r in failed if r["check"] == faulty.check and r["case"] == faulty.case]
    assert target, f"{faulty.name} not caught by {faulty.check}: {[(r['check'], r['outcome']) for r in records]}"
    for fragment in faulty.message:
        assert any(fragment in r["message"] for r in target), (fragment, target[0]["message"])
    line = _cause_line(target[0]["message"])
    assert re.search(faulty.cause, line), f"{faulty.name}: {line!r} does not match {faulty.cause!r}"
    families = {r["family"] for r in failed}
    assert families <= {faulty.family, *faulty.also_caught_by}, f"{faulty.name} also failed {families}"
    assert not any(r["outcome"] == "error" for r in records)


def _shared_entries():
    if not SHARED.is_file():
        return [pytest.param(None, marks=pytest.mark.skip(reason=f"{SHARED} not present"))]
    import importlib.util

    spec = importlib.util.spec_from_file_location("shared_faulty_caches", SHARED)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [pytest.param((cls.__name__, SHARED_FAMILY[fam], SHARED_MODEL[module.FAULTY_MODEL[name]]),
                         id=f"{name}@faulty-shared")
            for name, (cls, fam) in sorted(module.FAULTY_CACHES.items())]


SHARED_ENTRIES = _shared_entries()


@pytest.mark.parametrize("entry", SHARED_ENTRIES)
def test_shared_faulty_cache_caught(entry, tmp_path_factory):
    attr, family, model = entry
    entries = [e.values[0] for e in SHARED_ENTRIES]
    # -k matches marker names too: each cache runs only its family's items on its model
    selection = " or ".join(f"({a} and {m} and kvconform_{f})" for a, f, m in entries)
    records = _run_group("faulty-shared", tmp_path_factory, [f"{SHARED}:{a}" for a, _, _ in entries],
                         [m for _, _, m in entries], selection).get((attr, model), [])
    caught = [r for r in records if r["outcome"] == "failed" and r["family"] == family]
    assert caught, f"{attr} not caught by family {family}: {[(r['check'], r['outcome']) for r in records]}"
