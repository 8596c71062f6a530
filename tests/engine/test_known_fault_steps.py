"""An envelope may name the step a known fault arises at (``failed_at``, a regular expression of the step's label):
a failure at another step lies outside it and fails as the subject's own; a ``failed_at`` that names no step a run
reports is rejected at load (exit 4), like any other typo in a known-faults file."""

from __future__ import annotations

import textwrap

import pytest

from kvconform import known_faults


def _write(tmp_path, body):
    path = tmp_path / "steps.toml"
    path.write_text(textwrap.dedent(body))
    return path


@pytest.mark.parametrize("bound, problem", [
    ('"^chunk \\\\("', "names no step a run reports"),
    ("3", "names no step a run reports"),
])
def test_a_step_that_names_no_step_is_rejected(tmp_path, bound, problem):
    path = _write(tmp_path, f'[[fault]]\nid = "s1"\ntransformers = ">=5.5"\nreason = "r"\n'
                            f'envelope = {{ max_abs = 1.0, failed_at = {bound} }}\n')
    with pytest.raises(known_faults.KnownFaultsError) as err:
        known_faults.load_known_faults(path)
    assert "fault 's1': key 'envelope': failed_at" in str(err.value) and problem in str(err.value)
    assert "prefill(8), decode 1, chunk(8)" in str(err.value)  # the forms it could have named


def test_the_step_bounds_what_an_envelope_excuses(tmp_path):
    path = _write(tmp_path, '[[fault]]\nid = "s1"\ntransformers = ">=5.5"\nreason = "r"\n'
                            'envelope = { max_abs = 5.0, failed_at = "^chunk\\\\(" }\n')
    (fault,) = known_faults.load_known_faults(path)
    assert fault.within({"max_abs": 1.0, "failed_at": "chunk(2)"})
    assert not fault.within({"max_abs": 1.0, "failed_at": "prefill(12)"})
    assert "failed_at 'prefill(12)' (envelope: ~ '^chunk\\\\(')" in fault.outside(
        {"max_abs": 1.0, "failed_at": "prefill(12)"})
    # a failure that reports no step (a contract finding) is judged by the metrics it reports
    assert fault.within({"max_abs": 1.0})


def test_a_failure_at_another_step_fails_as_the_subjects_own(tmp_path):
    """A real failure (HiddenWindowCache: keys past 16 tokens evicted, wrong from a decode step on) inside the Δ of
    two entries: the one whose step is a chunk does not excuse it (it fails, naming the entry it is not), the one
    whose step is a decode does (xfail)."""
    from kvconform.checks import ConformanceError, KnownFaultShown
    from kvconform.session import build_session

    path = _write(tmp_path, """
        [[fault]]
        id = "arises-at-chunk"
        transformers = ">=5.5"
        subject = "HiddenWindowCache"
        model = "llama"
        check = "check_prefill_then_decode"
        case = "decode_explicit_positions"
        envelope = { max_abs = 10.0, failed_at = "^chunk\\\\(" }
        reason = "a fault that arises at a chunk"

        [[fault]]
        id = "arises-at-decode"
        transformers = ">=5.5"
        subject = "HiddenWindowCache"
        model = "llama"
        check = "check_prefill_then_decode"
        case = "decode_implicit_positions"
        envelope = { max_abs = 10.0, failed_at = "^decode " }
        reason = "a fault that arises at a decode step"
    """)
    session = build_session(caches=["kvconform.testing.faulty_logits:HiddenWindowCache"], models=["llama"],
                            builtin=False, checks=["check_prefill_then_decode"],
                            case_ids=["decode_explicit_positions", "decode_implicit_positions"], known_faults=[path])
    outcomes = {}
    for item in session.items():
        case = item.describe()["case"]
        try:
            session.run(item)
            outcomes[case] = ("passed", "")
        except KnownFaultShown as exc:
            outcomes[case] = ("xfailed", str(exc))
        except ConformanceError as exc:
            outcomes[case] = ("failed", str(exc))
    outcome, message = outcomes["decode_explicit_positions"]
    assert outcome == "failed", message
    assert "not known upstream fault 'arises-at-chunk'" in message and "failed_at 'decode " in message, message
    assert outcomes["decode_implicit_positions"][0] == "xfailed", outcomes["decode_implicit_positions"]
