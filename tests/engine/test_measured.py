"""``checks.Measured``: the typed record of what an item measured, and the rule that a pass whose measurement is
empty or degenerate where the case says it cannot be is not a pass (``blind``, enforced by ``run_check``)."""

from __future__ import annotations

import pytest

import kvconform
from kvconform.checks import BATCH_OPS, Measured
from kvconform.testing.page_pool import PagePoolCache


def test_batch_ops_are_the_ops_that_edit_rows():
    assert set(BATCH_OPS) == {"reorder", "swap_rows", "beam_fork", "repeat", "select"}


def test_blind_rules():
    assert Measured().blind() is None  # nothing recorded: no claim
    assert Measured(bytes_held=4096, tokens_held=12).blind() is None
    assert Measured(bytes_held=0, tokens_held=0).blind() is None  # an empty cache may hold nothing
    assert Measured(bytes_held=0, tokens_held=12).blind().startswith(
        "0 bytes counted while the cache holds 12 tokens per row")
    applied = Measured(ops_applied={"prefill": 1, "decode": 3}, expects_ops=("reorder",))
    assert applied.blind() == ("the case's reorder op was never applied to the cache (applied: prefill, decode), so "
                               "the item measured nothing about it")
    refused = Measured(ops_applied={"prefill": 1}, ops_refused={"reorder": 1}, expects_ops=("reorder",))
    assert refused.blind() is None  # refused, and the check let it pass: a refusal is a measurement
    assert Measured(timed_steps=0).blind() == "no timed sample: the timed step never ran, so no time was measured"
    assert Measured(timed_steps=5).blind() is None


def test_record_and_metrics():
    m = Measured()
    m.record(bytes_held=10, tokens_held=2)
    m.applied("prefill")
    m.applied("reorder", refused=True)
    assert m.as_metrics() == {"bytes_held": 10, "tokens_held": 2, "ops_applied": {"prefill": 1},
                              "ops_refused": {"reorder": 1}}
    with pytest.raises(TypeError, match="Measured has no field 'bytes'"):
        m.record(bytes=1)


def test_the_interpreter_records_the_batch_ops_it_applied_to_the_subject():
    """A reorder item's metrics carry the ops the interpreter applied: the reorder among them, so the pass measured
    the op it is about."""
    (result,) = [r for r in kvconform.check_cache(PagePoolCache, models=["llama"],
                                                  checks=["check_reorder_then_decode"], cases=["reorder_padded"])
                 if r.outcome != "skipped"]
    assert result.outcome == "passed", result.message
    assert result.metrics["measured"]["ops_applied"]["reorder"] >= 1


def _ctx(subject, ops):
    import dataclasses

    from kvconform.cases import Case, Op
    from kvconform.checks import CheckContext
    from kvconform.oracle import Oracle
    from kvconform.subjects import builtin_subjects
    from kvconform.zoo import build_zoo_model

    zm = build_zoo_model("llama")
    reference = next(s for s in builtin_subjects() if s.name == "ReferenceCache")
    case = Case(id="unit", check="check_reorder_then_decode", source="test", batch=2,
                ops=tuple(Op(*op) for op in ops))
    return CheckContext(dataclasses.replace(reference, name=subject.__name__, factory=subject), zm, case,
                        Oracle(zm), reference=reference)


class RefusesReorder(PagePoolCache):
    """Refuses every reorder, clearly (a cache without beam search)."""

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("RefusesReorder does not reorder its rows")


def test_a_reached_batch_op_that_raised_and_was_let_pass_is_blind_unless_recorded_as_refused():
    """The interpreter records what it applied on the case's own ops: a check that caught the reorder's raise and
    passed would have measured nothing about the reorder (``blind``); one that lets it pass through ``on_raise`` (the
    contract's allowed refusal) records it as refused."""
    from kvconform.checks._drive import SubjectRaised
    from kvconform.checks._interpreter import Runner

    ops = [("prefill", 6), ("decode", 1), ("reorder", 0), ("decode", 1)]
    ctx = _ctx(RefusesReorder, ops)
    with pytest.raises(SubjectRaised):
        Runner(ctx, ctx.new_cache()).run()
    assert ctx.measured.ops_applied == {"prefill": 1, "decode": 1}
    assert ctx.measured.blind().startswith("the case's reorder op was never applied to the cache")

    ctx = _ctx(RefusesReorder, ops)
    Runner(ctx, ctx.new_cache()).run(on_raise=lambda runner, op, i, exc: True)
    assert ctx.measured.ops_refused == {"reorder": 1} and ctx.measured.blind() is None

    ctx = _ctx(PagePoolCache, ops)  # a correct cache: applied, nothing blind
    Runner(ctx, ctx.new_cache()).run()
    assert ctx.measured.ops_applied == {"prefill": 1, "decode": 2, "reorder": 1} and ctx.measured.blind() is None
