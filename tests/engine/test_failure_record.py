"""The failure record (``kvconform.failure``): facts travel as typed fields, never read back out of the message.

A cause reworded keeps its id and facts, so the diagnosis built on it still fires; a known fault may name a cause
id and excuses the failure whose record names it (a real run of a bundled faulty cache); the JSON report carries
the record, and the HTML page takes the reproduce command from that field."""

from __future__ import annotations

import json
import os
import textwrap
from types import SimpleNamespace

import forkserver

from kvconform import html_report, known_faults
from kvconform.checks import _diagnosis, _evidence
from kvconform.failure import Cause, Failure, Measured, OpsTrail
from kvconform.scratch import adapter_lines

CACHE = "kvconform.testing.faulty_causes:UpdateOneShortCache"  # update() returns one key short: a kv_length cause
ITEM = "UpdateOneShortCache and prefill_then_decode and decode_explicit_positions"


def test_the_record_renders_the_message_and_its_fields():
    trail = OpsTrail((("prefill", "prefill(12)"), ("decode", "decode×2")), at="decode 1", note="explicit position_ids")
    cause = Cause("a sentence", "kv_length", {"returned": 11, "held": 12})
    failure = Failure("check_x failed: C on llama (fp32, batch 1), case c", ("a line", "", trail, cause),
                      Measured("max|Δlogit|", 0.5, 1e-4, "logits"), "reproduce: pytest --kvconform -k \"x\"")
    assert failure.render().splitlines() == [
        "check_x failed: C on llama (fp32, batch 1), case c", "  a line",
        "  ops: prefill(12) → decode×2   [failed at decode 1]; explicit position_ids",
        "  likely cause: a sentence", "  reproduce: pytest --kvconform -k \"x\""]
    record = json.loads(json.dumps(failure.as_dict()))
    assert record["cause"] == {"id": "kv_length", "text": "a sentence", "facts": {"returned": 11, "held": 12}}
    assert record["ops"]["at"] == "decode 1" and record["ops"]["ops"][0] == ["prefill", "prefill(12)"]
    assert record["measured"]["value"] == 0.5 and record["measured"]["unit"] == "logits"


def test_a_reworded_kv_length_cause_still_gets_its_diagnosis():
    # the numbers come from the cause's facts: the sentence may say anything
    found = _evidence.kv_length_mismatch([[0, 1, 256]], {}, [-1], 257)
    assert found.id == "kv_length" and found.facts == {"layer_idx": 0, "returned": 256, "held": 257, "mask": None}
    reworded = found.with_text("the layer gave back too few keys")
    ctx = SimpleNamespace(model=SimpleNamespace(dtype="torch.bfloat16"))
    out = _diagnosis._count_in_model_dtype(ctx, reworded)
    assert isinstance(out, Cause) and out.id == "count_in_model_dtype"
    assert out.text.startswith("the layer gave back too few keys — 256 is where bfloat16 stops holding every")
    assert out.facts["returned"] == 256 and out.facts["exact_up_to"] == 256
    # a sentence that merely reads like one (no id, no facts) is not parsed
    assert _diagnosis._count_in_model_dtype(ctx, str(found)) == str(found)
    # a bounded layer's mismatch (its mask's size given) is not the dtype's stalled count
    bounded = _evidence.kv_length_mismatch([[0, 1, 256]], {0: (300, 0)}, [512], 257)
    assert bounded.facts["mask"] == 300 and _diagnosis._count_in_model_dtype(ctx, bounded) is bounded


def test_the_adapter_reads_the_trail_fields():
    trail = OpsTrail((("prefill", "prefill(8)"), ("append", "chunk(3)")), at="chunk(3)", note="explicit position_ids")
    body = adapter_lines("check_chunked_continuation", ["max|Δlogit| = 1", trail, Cause("generic", "some_id")])
    assert body[1].note.startswith("positions: the start offset kvconform passes the adapter")
    assert body[2].id == "some_id" and body[2].text.startswith("your cached forward, given T > 1 new tokens")
    assert body[2].text.endswith("(kvconform's reading: generic)")
    # the words of the trail decide, not a line's text: a plain string that looks like an ops line is just text
    plain = adapter_lines("check_chunked_continuation", ["ops: prefill(8)   [failed at chunk(3)]", Cause("g")])
    assert plain[1] == Cause("g")


def test_a_known_fault_matches_a_cause_id(tmp_path):
    path = tmp_path / "faults.toml"
    path.write_text(textwrap.dedent("""
        [[fault]]
        id = "by-cause"
        transformers = ">=5"
        cause = "kv_length"
        reason = "named by its cause"
    """))
    (fault,) = known_faults.load_known_faults(path)
    assert fault.judged_at_run_time
    assert fault.shown_by("any words at all", "kv_length")
    assert not fault.shown_by("update(layer_idx=0) returned keys of length 11", None)
    assert not fault.shown_by("update(layer_idx=0) returned keys of length 11", "count_in_model_dtype")
    path.write_text(path.read_text().replace('cause = "kv_length"', 'cause = "kv length!"'))
    try:
        known_faults.load_known_faults(path)
    except known_faults.KnownFaultsError as exc:
        assert "key 'cause': expected a cause id" in str(exc)
    else:
        raise AssertionError("a cause that is no id loaded")


def _run(folder, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env.update(KVCONFORM_WORKERS="0", PYTHONDONTWRITEBYTECODE="1")
    cmd = ["--kvconform", "-p", "no:cacheprovider", "-p", "no:randomly", "-q",
           "--kvconform-cache", CACHE, "--kvconform-model", "llama", "-k", ITEM, "--kvconform-json", "r.json", *args]
    proc = forkserver.run_pytest(cmd, cwd=folder, env=env, timeout=900)
    report = folder / "r.json"
    assert report.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return [r for r in json.loads(report.read_text())["results"] if r["subject"] == "UpdateOneShortCache"]


def test_a_real_failure_carries_its_record_and_a_cause_id_entry_xfails_it(tmp_path):
    failed = tmp_path / "failed"
    failed.mkdir()
    (record,) = _run(failed)
    assert record["outcome"] == "failed"
    failure = record["failure"]
    assert failure["cause"]["id"] == "kv_length"
    assert failure["cause"]["facts"] == {"layer_idx": 0, "returned": 11, "held": 12, "mask": None}
    assert failure["ops"]["at"] and failure["ops"]["verb"] == "failed"
    assert failure["measured"]["unit"] == "logits" and failure["measured"]["value"] > failure["measured"]["bound"]
    assert record["message"].startswith(failure["headline"])
    assert failure["reproduce"] in record["message"].splitlines()[-1]

    # the HTML page: the reproduce command from the field, the line left out of the message text
    payload = html_report.page_data(json.loads((failed / "r.json").read_text()))
    item = next(it for it in payload["items"] if payload["subjects"][it[0]] == "UpdateOneShortCache")
    assert payload["reproduces"][item[11]] == failure["reproduce"].removeprefix("reproduce: ")
    assert "reproduce: " not in payload["texts"][item[8]]

    # a known fault naming the cause id excuses it, whatever its words
    xfail = tmp_path / "xfail"
    xfail.mkdir()
    (xfail / "faults.toml").write_text(textwrap.dedent("""
        [[fault]]
        id = "one-short-by-cause"
        transformers = ">=5"
        subject = "UpdateOneShortCache"
        cause = "kv_length"
        reason = "pretend upstream: update() returns one key short"
    """))
    (record,) = _run(xfail, "--kvconform-known-faults", "faults.toml")
    assert record["outcome"] == "xfailed", record["message"]
    assert record["message"] == "pretend upstream: update() returns one key short"
