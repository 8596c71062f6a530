"""Every faulty cache is caught: kvconform's own (``kvconform/testing``) by exactly the family it targets, with
its message pinned; the shared ones (``../shared/faulty_caches``) by the family their README names."""

import json
from pathlib import Path

import pytest

from kvconform.testing import faulty_caches

SHARED = Path(__file__).resolve().parents[2] / "shared" / "faulty_caches" / "faulty_caches.py"
# family names of shared/faulty_caches → kvconform check families
SHARED_FAMILY = {"logits": "logits", "api-contract": "contract", "crop": "crop", "prefix-reuse": "prefix",
                 "batch-reorder": "batch", "reset": "lifecycle", "compile": "compile", "memory": "memory",
                 "speed": "speed", "mamba-state": "logits", "sliding-window": "logits"}
SHARED_MODEL = {"llama": "llama", "mistral_sw8": "mistral", "mamba": "mamba"}


def _records(pytester, name):
    return json.loads((pytester.path / name).read_text())["results"]


@pytest.mark.parametrize("faulty", faulty_caches(), ids=lambda f: f.name)
def test_bundled_faulty_cache_caught_by_its_family(faulty, run_kvconform, pytester):
    # every family but speed (its benchmarks are most of a row's time, and only the speed family's faulty caches
    # target it; tests/test_perf.py runs the speed family on correct caches)
    families = () if faulty.family == "speed" else ("-m", "not kvconform_speed")
    result = run_kvconform("--kvconform-cache", faulty.spec, "--kvconform-model", faulty.model,
                           "-k", faulty.attr, *families, "--kvconform-json", "r.json")
    assert result.ret == 1, result.stdout.str()
    records = [r for r in _records(pytester, "r.json") if r["subject"] == faulty.attr]
    failed = [r for r in records if r["outcome"] == "failed"]
    target = [r for r in failed if r["check"] == faulty.check and (not faulty.case or r["case"] == faulty.case)]
    assert target, f"{faulty.name} not caught by {faulty.check}: {[(r['check'], r['outcome']) for r in records]}"
    for fragment in faulty.message:
        assert any(fragment in r["message"] for r in target), (fragment, target[0]["message"])
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
    return [pytest.param((cls.__name__, SHARED_FAMILY[fam], SHARED_MODEL[module.FAULTY_MODEL[name]]), id=name)
            for name, (cls, fam) in sorted(module.FAULTY_CACHES.items())]


@pytest.mark.parametrize("entry", _shared_entries())
def test_shared_faulty_cache_caught(entry, run_kvconform, pytester):
    attr, family, model = entry
    result = run_kvconform("--kvconform-cache", f"{SHARED}:{attr}", "--kvconform-model", model,
                           "-k", attr, "-m", f"kvconform_{family}", "--kvconform-json", "r.json")
    records = [r for r in _records(pytester, "r.json") if r["subject"] == attr]
    caught = [r for r in records if r["outcome"] == "failed" and r["family"] == family]
    assert caught, f"{attr} not caught by family {family}: {[(r['check'], r['outcome']) for r in records]}"
    assert result.ret == 1
