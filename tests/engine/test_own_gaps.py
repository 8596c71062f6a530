"""kvconform's own failures are named as such (issue 30, deliverable 3; issue 35, deliverable 1's last sentence).

An exception raised inside kvconform's own code (not the subject's) is a "kvconform internal error" naming the place,
the versions and where to report it; such items get the outcome ``internal`` in the JSON report and the matrix, the
run's summary lists them once under "kvconform's own gaps", and the exit code is 3. kvconform's ReferenceCache failing
where transformers' DynamicCache passes the same (model, check, case) is kvconform's gap too.
"""

import json

import pytest
import torch

from kvconform.outcomes import KVConformInternalError, frame_owner, own_fault
from kvconform.reference import ReferenceAttentionLayer
from kvconform.report import OUTCOMES, REFERENCE_GAP, matrix, own_gaps, reference_gaps


def in_kvconform(fn, *args, **kwargs):
    """Call ``fn(*args, **kwargs)`` from a frame of a kvconform module (as kvconform's checks call into code) and
    return the exception it raised, its traceback starting in that frame."""
    namespace = {"__name__": "kvconform.checks._planted_by_test"}
    exec("def run(fn, *args, **kwargs):\n    try:\n        fn(*args, **kwargs)\n"
         "    except Exception as exc:  # noqa: BLE001\n        return exc\n", namespace)
    return namespace["run"](fn, *args, **kwargs)


def subject_code(x):
    """A subject's own code (this test module is no kvconform module): it raises."""
    raise ValueError(f"the subject's own bug: {x}")


class MyLayer(ReferenceAttentionLayer):
    """A user's layer built on kvconform's reference layer (README: copy or subclass the reference)."""


def test_kvconforms_own_raise_is_internal():
    from kvconform.outcomes import with_article

    exc = in_kvconform(with_article, None)  # kvconform's own helper raising on a value it did not expect
    fault = own_fault(exc)
    assert fault is not None and fault["place"].startswith("kvconform/outcomes.py:") \
        and fault["place"].endswith("in with_article"), fault
    assert fault["what"].startswith("TypeError: ") and fault["raised_in"] is None


def test_a_raise_in_the_subjects_code_is_the_subjects():
    exc = in_kvconform(subject_code, 1)
    assert [frame_owner(tb.tb_frame) for tb in _tb(exc)] == ["kvconform", "subject"]
    assert own_fault(exc) is None and own_fault(exc, through_subject_call=True) is None


def test_a_raise_in_torch_called_by_kvconform_is_kvconforms():
    exc = in_kvconform(torch.cat, [torch.zeros(2, 3), torch.zeros(2, 4)], 0)
    assert own_fault(exc)["place"].endswith("in run")  # kvconform's frame that made the call
    # inside a call on the subject, kvconform's glue raising reports on the subject, as the checks always have
    assert own_fault(exc, through_subject_call=True) is None


def test_a_raise_in_transformers_inside_a_call_on_the_subject_is_not_kvconforms():
    """transformers' own code raising inside a forward or a cache method (a built-in subject, the model) is the
    subject's or the model's: only outside such a call is it kvconform's (its code did not handle it)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    cache.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), 0)
    exc = in_kvconform(cache.batch_select_indices, torch.tensor([5]))  # a row the cache does not have
    assert isinstance(exc, IndexError), exc
    assert own_fault(exc, through_subject_call=True) is None
    assert own_fault(exc) is not None


def test_a_method_the_subject_lacks_inside_a_call_on_it_is_the_subjects():
    """kvconform's glue calls ``cache.crop(...)`` on a cache without ``crop``: the AttributeError is raised in
    kvconform's frame, and it is the subject's failure (as the contract family reports it)."""
    exc = in_kvconform(getattr, object(), "crop")
    assert isinstance(exc, AttributeError)
    assert own_fault(exc, through_subject_call=True) is None
    assert own_fault(exc) is not None  # escaped from a check unhandled: kvconform's gap


def test_an_inherited_transformers_method_on_kvconforms_reference_is_kvconforms():
    """The reference's layers inherit transformers' bookkeeping: a new attribute their ``__init__`` does not set (as
    5.25's counters) makes transformers' method raise on kvconform's object — kvconform's gap, named as the inherited
    method; the same on a user's subclass of the reference is the user's."""
    for klass, ours in ((ReferenceAttentionLayer, True), (MyLayer, False)):
        layer = klass()
        layer.__dict__.pop("is_initialized", None)
        exc = in_kvconform(layer.offload)  # CacheLayerMixin.offload reads self.is_initialized
        assert isinstance(exc, AttributeError), exc
        fault = own_fault(exc, through_subject_call=True)
        if ours:
            assert fault is not None and "in offload, inherited by kvconform's ReferenceAttentionLayer" \
                in fault["place"], fault
        else:
            assert fault is None


def _tb(exc):
    tb = exc.__traceback__
    while tb is not None:
        yield tb
        tb = tb.tb_next


def _record(subject, outcome, check="check_prefill_then_decode", case="decode_explicit_positions", model="mamba2",
            metrics=None):
    return {"nodeid": f"test_conformance.py::test_conformance[{subject}-{model}-{check}-{case}]", "subject": subject,
            "model": model, "check": check, "family": "logits", "case": case, "outcome": outcome, "message": "",
            "metrics": metrics or {}}


def test_reference_failing_where_dynamic_cache_passes_is_kvconforms_gap():
    results = {r["nodeid"]: r for r in [
        _record("ReferenceCache", "failed"), _record("DynamicCache", "passed"),
        _record("ReferenceCache", "failed", case="chunk2"), _record("DynamicCache", "failed", case="chunk2"),
        _record("ReferenceCache", "failed", case="chunk8")]}  # DynamicCache did not run chunk8
    marked = reference_gaps(results)
    assert [r["case"] for r in marked] == ["decode_explicit_positions"]
    assert marked[0]["outcome"] == "internal" and marked[0]["metrics"]["kvconform_internal"] == REFERENCE_GAP
    assert reference_gaps(results) == []  # idempotent
    by_case = {r["case"]: r["outcome"] for r in results.values() if r["subject"] == "ReferenceCache"}
    assert by_case == {"decode_explicit_positions": "internal", "chunk2": "failed", "chunk8": "failed"}


def test_summary_and_matrix_name_kvconforms_gaps():
    class Digest:
        environment = {"transformers": "5.25.0", "torch": "2.13.0", "kvconform": "0.1.0"}

    place = "kvconform/checks/_measure.py:219 in tensors_of"
    results = {r["nodeid"]: r for r in [
        _record("AdaptQC", "internal", metrics={"kvconform_internal": place,
                                                "internal_error": "TypeError: vars() argument must have __dict__"}),
        _record("AdaptQC", "internal", case="chunk2", metrics={"kvconform_internal": place}),
        _record("AdaptQC", "passed", case="chunk8"), _record("AdaptQC", "failed", case="chunk4")]}
    lines = own_gaps(results, Digest())
    assert lines[0] == ("2 item(s) are errors of kvconform's own code, not verdicts on their subjects (exit code 3) — "
                        "on transformers 5.25.0, torch 2.13.0, kvconform 0.1.0:")
    assert lines[1].startswith(f"  2 item(s): {place}: TypeError: vars() argument must have __dict__ "
                               f"(subjects: AdaptQC); e.g. ")
    assert "report it to kvconform's maintainers" in lines[-1]
    assert own_gaps({k: v for k, v in results.items() if v["outcome"] != "internal"}) == []
    [(name, [cell], failed)] = matrix(results, "subject", ["logits"], "family")
    assert (name, cell, failed) == ("AdaptQC", "1/4 F1 K2", True)
    assert "internal" in OUTCOMES


def test_record_of_an_internal_error_has_its_own_outcome():
    from types import SimpleNamespace

    from kvconform.report import encode_property, record_report

    info = {k: v for k, v in _record("AdaptQC", "x").items() if k not in ("nodeid", "outcome", "message", "metrics")}
    report = SimpleNamespace(nodeid="n", when="call", passed=False, skipped=False, failed=True,
                             longreprtext="kvconform internal error: ...")
    results = {}
    record_report(results, report, {"kvconform": encode_property(info),
                                    "kvconform_metrics": encode_property({"kvconform_internal": "x.py:1 in f"})})
    assert results["n"]["outcome"] == "internal" and results["n"]["message"] == "kvconform internal error: ..."
    record_report(results, report, {"kvconform": encode_property(info), "kvconform_metrics": encode_property({})})
    assert results["n"]["outcome"] == "failed"


PLANTED = '''
import kvconform.checks._evidence as drive
import kvconform.checks._interpreter as interpreter

# a bug planted into kvconform's own evidence code (defined in its module's namespace, so its frames are kvconform's):
# it raises on the caches of one subject, Victim
drive._original_nonfinite_in = drive.nonfinite_in
exec("def _planted_nonfinite_in(cache):\\n"
     "    if type(cache).__name__ == 'Victim':\\n"
     "        raise TypeError('planted kvconform bug')\\n"
     "    return _original_nonfinite_in(cache)\\n", drive.__dict__)
interpreter.nonfinite_in = drive._planted_nonfinite_in
'''

CACHES = '''
from transformers import DynamicCache


class Victim(DynamicCache):
    """Exactly DynamicCache: only kvconform's planted bug fails its items."""
'''


@pytest.mark.parametrize("workers", ["0", "2"])
def test_internal_errors_are_reported_once_and_the_session_goes_on(pytester, run_kvconform, workers):
    """A real run (under xdist too, where the controller writes the summary from the workers' reports): the items
    that hit a bug of kvconform's are errors of kvconform, named with the place; the other subject's items are
    judged as ever; the summary section appears once; the exit code is 3."""
    pytester.makeconftest(PLANTED)
    pytester.makepyfile(caches=CACHES)
    result = run_kvconform("--kvconform-cache", "caches.py:Victim", "--kvconform-model", "llama",
                           "-k", "(prefill_then_decode or chunked_continuation) and (Victim or DynamicCache) "
                                 "and not offloaded",
                           "--kvconform-json", "r.json", "-n", workers)
    out = result.stdout.str()
    assert result.ret == 3, out
    assert out.count("kvconform's own gaps") == 1, out
    assert "kvconform internal error: check_prefill_then_decode on Victim on llama (fp32, batch" in out, out
    assert ("kvconform's own code raised TypeError: planted kvconform bug (at kvconform.checks._evidence (<string>):3 "
            "in _planted_nonfinite_in)") in out, out
    assert "not a verdict on Victim" in out and "report it to kvconform's maintainers" in out
    assert "Traceback" not in out and "def _planted" not in out
    report = json.loads((pytester.path / "r.json").read_text())
    outcomes = {(r["subject"], r["check"], r["case"]): r["outcome"] for r in report["results"]}
    victim = {k: v for k, v in outcomes.items() if k[0] == "Victim"}
    dynamic = {k: v for k, v in outcomes.items() if k[0] == "DynamicCache"}
    assert len(victim) >= 4 and set(victim.values()) == {"internal"}, victim
    assert len(dynamic) == len(victim) and set(dynamic.values()) == {"passed"}, dynamic  # the session went on
    n = len(victim)
    assert f"Victim        0/{n} K{n}" in out or f"0/{n} K{n}" in out, out
    assert f"{n} item(s) are errors of kvconform's own code" in out, out


def test_an_internal_error_is_never_excused_as_a_known_fault():
    assert not isinstance(KVConformInternalError("m"), AssertionError)  # the xfail of a known fault: AssertionError


def test_a_call_refused_by_the_subjects_signature_is_the_subjects():
    """kvconform (its update watch, its op interpreter) calls the subject's method; a signature that refuses the call
    raises in kvconform's frame before the subject's code runs — still the subject's (adaptivekv 0.1.0's update()
    refuses transformers 5.24's kwargs=)."""

    class OldSignature:
        def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
            return key_states, value_states

    exc = in_kvconform(OldSignature().update, 1, 2, 0, kwargs={})
    assert isinstance(exc, TypeError) and "unexpected keyword argument" in str(exc)
    assert [frame_owner(tb.tb_frame) for tb in _tb(exc)] == ["kvconform"]  # the subject's code never ran
    assert own_fault(exc, through_subject_call=True) is None and own_fault(exc) is None

    from kvconform.outcomes import with_article

    exc = in_kvconform(with_article, "a", "b")  # kvconform's own function refusing kvconform's call: kvconform's
    assert isinstance(exc, TypeError) and own_fault(exc) is not None
