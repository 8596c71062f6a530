"""How subjects are built and selected: constructors that forward **kwargs, arguments kvconform cannot pass,
caches that cannot be built, and running only chosen subjects."""

import json

import pytest
import torch  # noqa: F401 - before pytester snapshots sys.modules (see test_plugin.py)
from transformers import DynamicCache, StaticCache

from kvconform.subjects import accepted_names, required_unknown_arguments


class ForwardsToDynamic(DynamicCache):
    def __init__(self, bits=4, **kwargs):
        super().__init__(**kwargs)
        self.bits = bits


class ForwardsToStatic(StaticCache):
    def __init__(self, page=16, **kwargs):
        super().__init__(**kwargs)


def test_kwargs_constructors_accept_what_their_bases_accept():
    dynamic = accepted_names(ForwardsToDynamic)
    assert {"bits", "config"} <= dynamic and "max_cache_len" not in dynamic
    assert {"page", "config", "max_cache_len"} <= accepted_names(ForwardsToStatic)
    assert accepted_names(lambda **kw: None) is None  # a factory taking anything is given everything


def test_required_arguments_kvconform_cannot_pass_are_named():
    def needs_tokenizer(tokenizer, config, max_cache_len=8):
        return None

    class NeedsPageTable(DynamicCache):
        def __init__(self, config, page_table):
            super().__init__(config=config)

    assert required_unknown_arguments(needs_tokenizer) == ["tokenizer"]
    assert required_unknown_arguments(NeedsPageTable) == ["page_table"]
    assert required_unknown_arguments(ForwardsToDynamic) == []


CACHES = '''
from transformers import DynamicCache


class KwargsCache(DynamicCache):
    def __init__(self, bits=4, **kwargs):
        super().__init__(**kwargs)
        self.bits = bits


def needs_tokenizer(tokenizer, config):
    return DynamicCache(config=config)


def Broken(config):
    raise RuntimeError("boom: cannot build")
'''


def test_kwargs_cache_builds_and_only_chosen_subjects_run(run_kvconform, pytester):
    pytester.makepyfile(caches=CACHES)
    result = run_kvconform("--kvconform-cache", "caches.py:KwargsCache", "--kvconform-subject", "KwargsCache",
                           "--kvconform-model", "llama", "-k", "prefill_then_decode or chunked", "--kvconform-json",
                           "r.json")
    assert result.ret == 0, result.stdout.str()
    records = json.loads((pytester.path / "r.json").read_text())["results"]
    assert records and {r["subject"] for r in records} == {"KwargsCache"}
    assert all(r["outcome"] == "passed" for r in records)
    result = run_kvconform("--kvconform-subject", "KwargCache", "--collect-only")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "--kvconform-subject 'KwargCache': no such subject" in result.stderr.str()


def test_unbuildable_subjects_are_one_usage_error_or_failures_never_xfails(run_kvconform, pytester):
    pytester.makepyfile(caches=CACHES)
    result = run_kvconform("--kvconform-cache", "caches.py:needs_tokenizer", "--collect-only")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "needs_tokenizer requires 'tokenizer', which kvconform cannot pass" in result.stderr.str()
    # On mamba the reference fails some cases (known upstream faults): a cache that was never built must still
    # fail those items, not be excused by the model's known fault.
    result = run_kvconform("--kvconform-cache", "caches.py:Broken", "--kvconform-subject", "Broken",
                           "--kvconform-model", "mamba", "--kvconform-json", "r.json")
    records = json.loads((pytester.path / "r.json").read_text())["results"]
    ran = [r for r in records if r["outcome"] != "skipped"]
    assert ran and all(r["outcome"] == "failed" for r in ran), [(r["case"], r["outcome"]) for r in ran]
    assert all("RuntimeError: boom: cannot build" in r["message"] for r in ran)
