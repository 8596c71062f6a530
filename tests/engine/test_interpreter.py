"""The op interpreter (``kvconform.checks._interpreter.Runner``) directly: observers see every op and forward in
order, a lock-step cache gets the same tokens and ops, and ``Runner.run``'s hooks (``plan``, ``on_raise``,
``StopRun``, op ``handlers``) steer a run the way the checks use them."""

from __future__ import annotations

import pytest

from kvconform.cases import Op

OPS = [Op("prefill", 6), Op("decode", 2), Op("reorder"), Op("crop", 2), Op("decode", 1), Op("fork"), Op("decode", 1),
       Op("reset"), Op("prefill", 3)]


@pytest.fixture(scope="module")
def llama_ctx():
    import torch

    from kvconform.cases import Case
    from kvconform.checks import CheckContext
    from kvconform.oracle import Oracle
    from kvconform.subjects import builtin_subjects
    from kvconform.zoo import build_zoo_model

    torch.set_num_threads(1)
    zm = build_zoo_model("llama")
    subjects = {s.name: s for s in builtin_subjects()}
    case = Case(id="unit", check="check_reorder_then_decode", source="test", batch=3, params={"padding": [0, 2, 3]})
    return CheckContext(subjects["DynamicCache"], zm, case, Oracle(zm), reference=subjects["ReferenceCache"])


class Recorder:
    """Observer writing every hook call as a short event string."""

    def __init__(self):
        self.events = []

    def before_op(self, runner, op, op_index):
        self.events.append(f"before {op.label} #{op_index}")

    def after_op(self, runner, op, op_index):
        self.events.append(f"after {op.label} #{op_index} held={runner.length}")

    def before_forward(self, runner, label, n):
        self.events.append(f"forward {label} n={n} at {runner.length}")

    def after_forward(self, runner, step):
        self.events.append(f"step {step.index} {step.label} held={step.seq.shape[1]}")


def test_observers_see_every_op_and_forward_in_order(llama_ctx):
    from kvconform.checks._interpreter import Runner

    rec = Recorder()
    runner = Runner(llama_ctx, llama_ctx.new_cache(), observers=[rec])
    steps = runner.run(OPS)
    assert rec.events[:6] == ["before prefill(6) #0", "forward prefill(6) n=6 at 0", "step 0 prefill(6) held=6",
                              "after prefill(6) #0 held=6", "before decode×2 #1", "forward decode 1 n=1 at 6"]
    assert "after crop(-2) #3 held=6" in rec.events
    assert rec.events[-2:] == ["forward original of fork #1: decode n=1 at 7",  # the parked original's check
                               f"step {len(steps) - 1} original of fork #1: decode held=8"]
    assert sum(e.startswith("step ") for e in rec.events) == len(steps) == 7


def test_lockstep_cache_gets_the_same_tokens_and_ops(llama_ctx):
    import torch

    from kvconform.checks._interpreter import Runner
    from kvconform.checks._judge import judge

    runner = Runner(llama_ctx, llama_ctx.new_cache(), lockstep=llama_ctx.new_cache(), lockstep_label="fresh")
    steps = runner.run(OPS)
    twin = runner.lockstep_steps
    assert len(twin) == len(steps) == 7
    for a, b in zip(steps, twin):
        assert b.label == f"fresh: {a.label}" and (a.start, a.length, a.op_index) == (b.start, b.length, b.op_index)
        assert torch.equal(a.seq, b.seq)
        assert torch.equal(a.logits, b.logits)  # a fresh instance of the same exact class, same ops: bit-equal
    assert runner.partner.cache is not runner.cache and runner.partner.length == runner.length
    assert judge(llama_ctx, twin).passed


def test_lockstep_does_not_change_the_subjects_run(llama_ctx):
    import torch

    from kvconform.checks._interpreter import Runner

    alone = Runner(llama_ctx, llama_ctx.new_cache()).run(OPS)
    paired = Runner(llama_ctx, llama_ctx.new_cache(), lockstep=llama_ctx.new_cache()).run(OPS)
    assert [s.label for s in alone] == [s.label for s in paired]
    assert all(torch.equal(a.seq, b.seq) and torch.equal(a.logits, b.logits) for a, b in zip(alone, paired))


def test_plan_skips_and_rewrites_ops(llama_ctx):
    from kvconform.checks._interpreter import Runner

    def plan(runner, op, i):
        if op.name == "reorder":
            return None
        return Op("chunk", 2) if op.name == "decode" and op.n == 2 else op

    runner = Runner(llama_ctx, llama_ctx.new_cache())
    steps = runner.run(OPS[:3], plan=plan)
    assert [s.label for s in steps] == ["prefill(6)", "chunk(2)"]
    assert runner.trail == ["prefill(6)", "chunk(2)"]


class NoReorderCache:
    """A DynamicCache whose reorder_cache refuses (as a cache without beam search support does)."""

    def __new__(cls, config):
        from transformers import DynamicCache

        class _NoReorder(DynamicCache):
            def reorder_cache(self, beam_idx):
                raise NotImplementedError("reorder_cache is not supported by this cache")

        return _NoReorder(config=config)


def test_on_raise_goes_on_or_stops_and_stoprun_ends_the_run(llama_ctx):
    from kvconform.checks._drive import SubjectRaised
    from kvconform.checks._interpreter import Runner, StopRun

    def new():
        return NoReorderCache(llama_ctx.model.model.config)

    with pytest.raises(SubjectRaised) as info:
        Runner(llama_ctx, new()).run(OPS)
    assert info.value.where == "reorder" and isinstance(info.value.cause, NotImplementedError)

    refused = []
    steps = Runner(llama_ctx, new()).run(OPS[:5], on_raise=lambda r, op, i, exc: refused.append(op.label) or True)
    assert refused == ["reorder"] and [s.label for s in steps][-1] == "decode 1"

    steps = Runner(llama_ctx, new()).run(OPS, on_raise=lambda *_: False)
    assert len(steps) == 3  # prefill, decode 1, decode 2; nothing after the refused reorder

    class StopAfterFirstDecode:
        def after_forward(self, runner, step):
            if step.label == "decode 1":
                raise StopRun

    steps = Runner(llama_ctx, llama_ctx.new_cache(), observers=[StopAfterFirstDecode()]).run(OPS)
    assert [s.label for s in steps] == ["prefill(6)", "decode 1"]


def test_handler_replaces_an_op(llama_ctx):
    from kvconform.checks._interpreter import Runner

    seen = []

    def crop(runner, op):
        seen.append((op.n, runner.length))
        runner.trail.append("crop (handled)")

    runner = Runner(llama_ctx, llama_ctx.new_cache(), handlers={"crop": crop})
    runner.run(OPS[:5])
    assert seen == [(2, 8)] and "crop (handled)" in runner.trail
    assert runner.length == 9  # the handler kept the sequence: 8 held, one more decode


def test_length_and_pointer_traces(llama_ctx):
    from kvconform.checks._interpreter import LengthTrace, PointerTrace, Runner

    lengths, pointers = LengthTrace(), PointerTrace()
    ops = [Op("prefill", 6), Op("decode", 2), Op("crop", 3), Op("reset"), Op("prefill", 4)]
    Runner(llama_ctx, llama_ctx.new_cache(), observers=[lengths, pointers]).run(ops)
    assert lengths.rows == [("prefill(6)", 6, 6), ("decode×2", 8, 8), ("crop(-3)", 5, 5), ("reset", 0, 0),
                            ("prefill(4)", 4, 4)]
    assert [label for label, _ in pointers.rows] == ["prefill(6)", "decode 1", "decode 2", "prefill(4)"]
    assert all(any(name.endswith(".keys") for name in ptrs) for _, ptrs in pointers.rows)
    # DynamicCache concatenates: every decode step allocates new key buffers
    assert pointers.rows[1][1]["layers[0].keys"] != pointers.rows[2][1]["layers[0].keys"]


# ------------------------------------------------------------------------------------------------ the op table
def test_every_op_of_the_table_is_parsed_labelled_and_dispatched():
    """``kvconform.ops.OPS`` is the one op table: every entry names a ``Runner`` method that exists, parses from case
    syntax, and its held-token rule agrees with ``tokens_held``; the derived lists come from it."""
    from kvconform import ops
    from kvconform.cases import _parse_op
    from kvconform.checks._interpreter import Runner

    for name, spec in ops.OPS.items():
        assert callable(getattr(Runner, spec.runner, None)), f"{name}: Runner has no method {spec.runner!r}"
        text = f"{name} 2" if spec.count == "required" else name
        op = _parse_op("t.toml", "c", text)
        assert (op.name, op.label) == (name, spec.label_of(op.n))
        assert spec.feeds == (spec.cause is None)  # a non-feeding op has a likely cause to blame a divergence on
    assert ops.tokens_held([Op("prefill", 6), Op("decode", 2), Op("swap_rows"), Op("crop", 3), Op("reset"),
                            Op("chunk", 4), Op("crop", 9)]) == [6, 8, 8, 5, 0, 4, 0]
    from kvconform.checks import TOKEN_OPS
    from kvconform.checks._consistency import CAUSES, STRUCTURAL_OPS
    from kvconform.checks._lossy import LOSSY_OPS
    from kvconform.checks.fuzz import NEEDS, OPS as FUZZ_OPS
    from kvconform.checks.memory import MEMORY_OPS

    assert TOKEN_OPS == ("prefill", "decode", "chunk") and set(CAUSES) == set(STRUCTURAL_OPS)
    assert "swap_rows" in LOSSY_OPS and NEEDS["swap_rows"] == "reorder"
    assert "swap_rows" in MEMORY_OPS and "fork" not in MEMORY_OPS  # rows permuted, never copied into a new cache
    assert FUZZ_OPS == ("decode", "chunk", "crop", "fork", "reorder", "repeat", "select", "reset")  # programs kept


def test_swap_rows_exchanges_rows_0_and_1(llama_ctx):
    """``swap_rows`` calls ``reorder_cache`` with rows 0 and 1 exchanged, the other rows staying, and its decode
    steps match the oracle on DynamicCache (the ``Runner``'s sequence follows the swap)."""
    from kvconform.checks._interpreter import Runner
    from kvconform.checks._judge import judge

    runner = Runner(llama_ctx, llama_ctx.new_cache())
    before = []
    runner.observe(type("Before", (), {"before_op": lambda self, r, op, i: before.append(r.seq.clone())})())
    steps = runner.run([Op("prefill", 6), Op("swap_rows"), Op("decode", 2)])
    swapped = steps[-1].seq[:, :6]
    assert swapped[0].equal(before[1][1]) and swapped[1].equal(before[1][0]) and swapped[2].equal(before[1][2])
    assert steps[1].ops_before == ("swap_rows",)
    assert judge(llama_ctx, steps).passed


def test_beam_fork_takes_row_0_twice(llama_ctx):
    """``beam_fork`` calls ``reorder_cache([0, 0, 2])`` (beam search keeping two continuations of beam 0): the
    ``Runner``'s rows 0 and 1 both hold row 0's history, row 2 stays, and the two copies then decode different tokens
    that match the oracle on DynamicCache."""
    from kvconform.checks._interpreter import Runner
    from kvconform.checks._judge import judge

    runner = Runner(llama_ctx, llama_ctx.new_cache())
    before = []
    runner.observe(type("Before", (), {"before_op": lambda self, r, op, i: before.append(r.seq.clone())})())
    steps = runner.run([Op("prefill", 6), Op("beam_fork"), Op("decode", 2)])
    forked = steps[-1].seq
    assert forked[0, :6].equal(before[1][0]) and forked[1, :6].equal(before[1][0]) and forked[2, :6].equal(before[1][2])
    assert not forked[0, 6:].equal(forked[1, 6:])  # the copies diverge after the fork
    assert steps[1].ops_before == ("beam_fork",)
    assert judge(llama_ctx, steps).passed


def test_beam_fork_case_passes_correct_caches_of_other_designs_and_fails_shared_pages():
    """``beam_fork_padded`` passes on kvconform's reference cache, transformers' DynamicCache and StaticCache, a paged,
    a lossy and an evicting cache, and fails on a paged cache whose reorder_cache shares the pages of a row taken
    twice (``faulty_beam.RowPagedCache``, no copy-on-write), naming the fork; ``reorder_padded`` (a permutation) passes
    on that cache, which is why the fork needs its own case."""
    import kvconform
    from kvconform.subjects import builtin_subjects
    from kvconform.testing import evicting, faulty_beam, lossy, paged

    subjects = {s.name: s for s in builtin_subjects()}
    correct = [subjects[n] for n in ("ReferenceCache", "DynamicCache", "StaticCache")] + [
        paged.PagedCache, lossy.Int8ResidualCache, evicting.SinkWindowCache]
    results = {(r.subject, r.case): r for r in kvconform.check_cache(
        [*correct, faulty_beam.RowPagedCache], models=["llama"], checks=["check_reorder_then_decode"],
        cases=["beam_fork_padded", "reorder_padded"])}
    for (subject, case), r in results.items():
        if subject != "RowPagedCache":
            assert r.outcome == "passed", (subject, case, r.message)
    assert results[("RowPagedCache", "reorder_padded")].outcome == "passed"
    faulty = results[("RowPagedCache", "beam_fork_padded")]
    assert faulty.outcome == "failed", faulty.message
    assert "beam_fork" in faulty.message and "left the two copies sharing a part" in faulty.message


def test_swap_rows_case_passes_correct_caches_and_fails_a_faulty_beam_cache():
    """The batch case ``swap_rows_padded`` passes on ReferenceCache and DynamicCache and fails on a bundled faulty
    beam cache (reorder_cache moves the exact residual only), blaming the swap."""
    import kvconform
    from kvconform.subjects import builtin_subjects
    from kvconform.testing import lossy

    subjects = {s.name: s for s in builtin_subjects()}
    results = {r.subject: r for r in kvconform.check_cache(
        [subjects["ReferenceCache"], subjects["DynamicCache"], lossy.Int8ReorderResidualOnly], models=["llama"],
        checks=["check_reorder_then_decode"], cases=["swap_rows_padded"])}
    assert results["ReferenceCache"].outcome == results["DynamicCache"].outcome == "passed"
    faulty = results["Int8ReorderResidualOnly"]
    assert faulty.outcome == "failed", faulty.message
    assert "swap_rows" in faulty.message and "reorder_cache() exchanging two rows did not move" in faulty.message
