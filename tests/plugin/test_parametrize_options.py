"""``parametrize_with_checks`` runs its items under the ``RunOptions`` it was given, as ``check_cache`` does: before,
``kv_runner`` ran them through the bare session of a pytest run without ``--kvconform`` (the default options), so
``strict=True`` planned an item as a failure that then xfailed at run time, and ``full=True`` planned the full-tier
items but ran them with ``options.full`` False (and the power pass ``check_cache`` leaves off ran on them)."""

RECORDING_CONFTEST = """
import json

from kvconform.session import KVSession

_run = KVSession.run


def run(self, item, benchmark=None):  # records the options each item runs under, then runs it unchanged
    with open("ran.jsonl", "a") as f:
        f.write(json.dumps({"id": item.id, "strict": self.options.strict, "full": self.options.full,
                            "power": self.options.power}) + "\\n")
    return _run(self, item, benchmark)


KVSession.run = run
"""


def test_strict_and_full_given_to_parametrize_with_checks_are_the_options_its_items_run_under(pytester):
    import json

    pytester.makeconftest(RECORDING_CONFTEST)
    pytester.makepyfile(test_mine="""
        import kvconform
        from transformers import DynamicCache


        class PlainDynamicCache(DynamicCache):
            '''transformers' DynamicCache unchanged: on mamba it meets the known upstream fault
            mamba-jamba-chunk-zero-state (judged at run time by its evidence).'''


        ONE = dict(models=["mamba"], checks=["check_chunked_continuation"], cases=["chunk2"])


        @kvconform.parametrize_with_checks([PlainDynamicCache], **ONE)
        def test_lenient(kv_item, kv_runner):
            kv_runner(kv_item)


        @kvconform.parametrize_with_checks([PlainDynamicCache], strict=True, **ONE)
        def test_strict(kv_item, kv_runner):
            kv_runner(kv_item)


        @kvconform.parametrize_with_checks([kvconform.ReferenceCache], models=["llama"],
                                           cases=["length_bookkeeping_batch_ops"], full=True)
        def test_full(kv_item, kv_runner):
            kv_runner(kv_item)
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q", "-p", "no:randomly")
    # the known fault excuses the lenient item (xfailed); under strict=True it is a failure, as check_cache says
    result.assert_outcomes(passed=1, failed=1, xfailed=1)
    assert "check_chunked_continuation failed: PlainDynamicCache on mamba" in result.stdout.str()
    ran = [json.loads(line) for line in (pytester.path / "ran.jsonl").read_text().splitlines()]
    by = {r["id"]: r for r in ran}
    full = by["ReferenceCache-llama-length_bookkeeping-length_bookkeeping_batch_ops"]
    assert full["full"] and not full["strict"] and full["power"] == "off", full
    assert [r["strict"] for r in ran if "mamba" in r["id"]] == [False, True], ran
