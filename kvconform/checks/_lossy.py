"""Shared helpers of the checks on lossy subjects (quantized caches with a fake-quant twin).

A lossy subject is a ``CacheSpec`` with a ``twin`` (``kvconform.quant``). Its checks live in their families'
modules (``quality.check_quality_budget``, ``generate.check_generate_vs_twin``, ``batch.check_reorder_after_flush``,
``contract.check_crop_refused``, ``prefix.check_deepcopy_refused``); what they share is here, so that no family
module imports another:

* ``drive``: the op driver of these checks: the interpreter with ``reorder`` reversing the rows (so every row moves)
  and only the ops ``LOSSY_OPS``;
* ``oracle_slices``: the oracle and uncached logits of each recorded step;
* ``judge_twin`` / ``fail_twin`` / ``twin_line`` / ``twin_spec``: comparing with the fake-quant twin;
* ``TWIN_ONLY``: the kind fact "only subjects with a fake-quant twin" (``@register(..., facts=TWIN_ONLY)``);
* ``fail_subject_raised``: the failure message when the subject raises.
"""

from __future__ import annotations

from kvconform.checks._diagnosis import describe_raise, measured_cause
from kvconform.checks._drive import SubjectRaised
from kvconform.checks._interpreter import Runner
from kvconform.failure import Cause, OpsTrail
from kvconform.ops import op_names
from kvconform.oracle import compare_logits
from kvconform.outcomes import CheckSkipped

LOSSY_OPS = op_names(copies=False, rows=("keep", "permute"))
"""The ops the lossy checks' driver accepts: those that keep the batch size and copy nothing (the twin follows
them in lock-step): the feeding ops, ``crop`` and the beam reorders (``kvconform.ops``)."""

CLEAR_ERRORS = (ValueError, NotImplementedError, RuntimeError, TypeError)
"""Exception types a refused operation may raise (a bare IndexError/AttributeError is an accident, not a refusal)."""


TWIN_ONLY = {"has_twin": "applies only to subjects with a fake-quant twin (CacheSpec(..., twin=...), as transformers' "
                         "QuantizedCache has); other lossy subjects are judged against a fresh instance of themselves"}
"""``@register(..., facts=TWIN_ONLY)``: the check judges only subjects whose kind has a fake-quant twin
(``Kind.has_twin``)."""


def beam_index(batch: int):
    """Rows reversed (``[B-1, ..., 0]``): every row moves for B ≥ 2, so a reorder that is skipped is visible."""
    import torch

    return torch.arange(batch - 1, -1, -1)


def drive(ctx, cache, position_mode=None, stop_before=None) -> list:
    """Run ``ctx.case.ops`` on ``cache`` through the interpreter (``_interpreter.Runner``), without padding, with
    ``reorder`` reversing the rows (``beam_index``: every row moves) and decode steps after a reorder labelled so.

    ``stop_before``: index of an op not to run (the steps so far are returned).

    Returns:
        the recorded ``Step`` list (float64 logits ``[B, k, V]``).

    Raises:
        SubjectRaised: any exception of the subject (names the op).
        ValueError: an op this driver does not implement (fork, repeat, select, reset).
    """
    ops = ctx.case.ops if stop_before is None else ctx.case.ops[:stop_before]
    runner = Runner(ctx, cache, position_mode, padding=[], allowed_ops=LOSSY_OPS, beam="reverse",
                    decode_suffix_after_reorder=True)
    runner.run(ops, parked=False)
    ctx.encoder_ids = runner.steps[0].encoder_ids if runner.steps else runner.encoder_ids
    return runner.steps


def oracle_slices(ctx, steps) -> dict:
    """``{step.index: (oracle, uncached)}`` logits ``[B, k, V]`` of each step. When every step's sequence (and
    encoder input) is a prefix of the last one (no reorder or crop in between), one oracle forward of the last
    sequence serves them all (causality); otherwise one per step."""
    import torch

    def enc(s):
        return s.encoder_ids if s.encoder_ids is not None else ctx.encoder_ids

    last, last_enc = steps[-1].seq, enc(steps[-1])
    if all(torch.equal(s.seq, last[:, : s.seq.shape[1]]) and (last_enc is None or torch.equal(enc(s), last_enc))
           for s in steps):
        full_o = ctx.oracle.logits(last, encoder_ids=last_enc)
        full_u = ctx.oracle.uncached(last, encoder_ids=last_enc)
        return {s.index: (full_o[:, s.start:s.start + s.length], full_u[:, s.start:s.start + s.length])
                for s in steps}
    return {s.index: (ctx.oracle.logits(s.seq, encoder_ids=enc(s))[:, s.start:s.start + s.length],
                      ctx.oracle.uncached(s.seq, encoder_ids=enc(s))[:, s.start:s.start + s.length]) for s in steps}


def twin_line(ctx) -> str:
    spec = ctx.kind.twin_spec()
    twin = spec.factory if spec is not None else None
    qc = ctx.kind.quant_config
    what = qc.describe(ctx.model.config) if qc is not None else "the declared quantization"
    return f"twin: {getattr(twin, '__name__', 'twin')} ({what}), exact bookkeeping"


def judge_twin(ctx, steps):
    """(first failing (step, Comparison) or None, worst pair) of ``steps`` against the twin on the same ops."""
    from kvconform.checks._twin import twin_targets

    tol = ctx.tolerance()
    targets = twin_targets(ctx, ctx.subject, steps, driver=drive)
    first = worst = None
    for step in steps:
        target, floor_ref = targets[step.index]
        cmp = compare_logits(step.logits, target, floor_ref, tol)
        if worst is None or cmp.max_abs > worst[1].max_abs:
            worst = (step, cmp)
        if first is None and not cmp.passed:
            first = (step, cmp)
    return first, worst


def fail_twin(ctx, failed, cause):
    step, cmp = failed
    b, offset = cmp.worst
    observed = "NaN/inf" if cmp.max_abs == float("inf") else f"{cmp.max_abs:.1e}"
    ctx.fail([
        f"max|Δlogit| = {observed} vs its fake-quant twin, but should be ≤ {cmp.tol:.1e} "
        f"({ctx.tolerance().describe(cmp.floor)})",
        f"worst at batch={b} step={step.index} position={step.start + offset}",
        f"ops: {ctx.case.ops_label()}   [failed at {step.label}]",
        twin_line(ctx),
        "likely cause: " + cause,
    ], {"max_abs": cmp.max_abs, "tolerance": cmp.tol, "noise_floor": cmp.floor, "failed_at": step.label,
        "compared_with": "fake-quant twin"})


def fail_subject_raised(ctx, exc: SubjectRaised, cause: str):
    from kvconform.subjects import ModelLeftChanged

    from kvconform.checks._drive import prefill_refusal

    reason = prefill_refusal(ctx, exc)
    if reason:
        raise CheckSkipped(reason)
    if isinstance(exc.cause, ModelLeftChanged):
        cause = ModelLeftChanged.likely_cause
    ctx.fail([f"the subject raised {describe_raise(exc)}",
              OpsTrail.of_case(ctx.case, at=exc.where, verb="raised"),
              _as_cause(measured_cause(exc) or cause)],
             {"raised": type(exc.cause).__name__, "failed_at": exc.where})


def twin_spec(ctx):
    """The ``CacheSpec`` of the subject's fake-quant twin (``Kind.twin_spec``)."""
    return ctx.kind.twin_spec()


def _as_cause(cause) -> Cause:
    """``cause`` (a ``Cause`` or a sentence) as a ``Cause``."""
    return cause if isinstance(cause, Cause) else Cause(cause)
