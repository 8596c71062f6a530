"""Family ``logits``: cached forward logits equal the uncached float64 oracle at every step.

Both checks drive ``model.forward(..., cache=subject)`` in a manual loop, as callers outside ``generate`` do, with
explicit ``position_ids`` or without them (then the model derives positions from ``cache.get_seq_length()``).
"""

from __future__ import annotations

from kvconform.checks import register
from kvconform.checks._engine import (SubjectRaised, fail_raised, fail_verdict, judge, positions_label, run_ops,
                                      record_verdict)


def _length_note(steps, upto) -> str | None:
    for step in steps[: upto.index + 1]:
        fed = step.start + step.length
        if step.reported_length is not None and step.reported_length != fed:
            return (f"get_seq_length() returned {step.reported_length} after {fed} tokens were fed "
                    f"(at {step.label}), so positions derived from it are off")
    return None


def _decode_cause(ctx, steps):
    def cause(step, cmp):
        note = _length_note(steps, step)
        if note and not positions_label(ctx).startswith("explicit"):
            return note
        if step.label in ("decode 1",) or step.label.startswith("chunk") and step.index == 1:
            return "the prefill's keys/values (or states) were not stored intact: a dropped, shifted or stale token"
        if step.label.startswith("prefill"):
            return "the prefill itself is wrong: update() returns keys/values that differ from the ones passed in"
        good = step.start
        window = ctx.model.sliding_window
        if window and good >= window - 1:
            return (f"correct up to position {good - 1}, wrong after: the sliding window (size {window}) keeps the "
                    f"wrong number of past tokens")
        return (f"correct for the first {good} positions, wrong from position {good}: older tokens are being "
                f"evicted or overwritten (a hidden window or a capacity bug)")

    return cause


def _run(ctx, cause_for):
    cache = ctx.new_cache()
    try:
        steps = run_ops(ctx, cache)
    except SubjectRaised as exc:
        fail_raised(ctx, exc, "the cache does not support this sequence of calls (see the exception)")
    verdict = judge(ctx, steps)
    record_verdict(ctx, verdict, len(steps))
    if not verdict.passed:
        fail_verdict(ctx, verdict, cause_for(ctx, steps))


@register("logits", needs=("forward",))
def check_prefill_then_decode(ctx):
    """Prefill, then single-token decode steps: every step's logits equal the oracle's."""
    if not ctx.case.ops or ctx.case.ops[0].name != "prefill":
        raise ValueError(f"case {ctx.case.id}: check_prefill_then_decode needs ops starting with 'prefill N'")
    _run(ctx, _decode_cause)


def _chunk_cause(ctx, steps):
    base = _decode_cause(ctx, steps)

    def cause(step, cmp):
        if step.label.startswith("chunk") and step.index > 0:
            return (f"feeding {step.length} tokens at once into a warm cache loses or misplaces state: "
                    f"update() with k>1 new tokens after the prefill is wrong")
        return base(step, cmp)

    return cause


@register("logits", needs=("forward",))
def check_chunked_continuation(ctx):
    """Prefill, then chunks of k>1 tokens into the warm cache (incl. chunks straddling the sliding window)."""
    if not any(op.name == "chunk" for op in ctx.case.ops):
        raise ValueError(f"case {ctx.case.id}: check_chunked_continuation needs at least one 'chunk N' op")
    _run(ctx, _chunk_cause)
