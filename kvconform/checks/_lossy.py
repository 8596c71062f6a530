"""Shared helpers of the checks on lossy subjects (quantized caches with a fake-quant twin).

A lossy subject is a ``CacheSpec`` with a ``twin`` (``kvconform.quant``). Its checks live in their families'
modules (``quality.check_quality_budget``, ``generate.check_generate_vs_twin``, ``batch.check_reorder_after_flush``,
``contract.check_crop_refused``, ``prefix.check_deepcopy_refused``); what they share is here, so that no family
module imports another:

* ``drive``: the op driver of these checks: ``_engine.run_ops``' manual loop plus ``reorder`` (rows reversed, so
  every row moves) and ``crop``;
* ``oracle_slices``: the oracle and uncached logits of each recorded step;
* ``judge_twin`` / ``fail_twin`` / ``twin_line`` / ``twin_spec``: comparing with the fake-quant twin;
* ``lossy_only``: the applicability rule "only subjects with a fake-quant twin";
* ``fail_subject_raised``: the failure message when the subject raises.
"""

from __future__ import annotations

from kvconform import compat
from kvconform.checks._engine import (SubjectRaised, Step, case_generator, describe_raise, encoder_ids_for,
                                      forward, random_tokens, seq_length)
from kvconform.oracle import compare_logits

CLEAR_ERRORS = (ValueError, NotImplementedError, RuntimeError, TypeError)
"""Exception types a refused operation may raise (a bare IndexError/AttributeError is an accident, not a refusal)."""


def lossy_only(subject, model, case, device="cpu"):
    """Applicability rule (``@register(..., applies=lossy_only)``): only subjects with a fake-quant twin."""
    if getattr(subject, "twin", None) is None:
        return "applies to lossy subjects only (a CacheSpec with a fake-quant twin)"
    return None


def beam_index(batch: int):
    """Rows reversed (``[B-1, ..., 0]``): every row moves for B ≥ 2, so a reorder that is skipped is visible."""
    import torch

    return torch.arange(batch - 1, -1, -1)


def drive(ctx, cache, position_mode=None, stop_before=None) -> list:
    """Run ``ctx.case.ops`` on ``cache`` like ``_engine.run_ops``, with ``reorder`` and ``crop`` too.

    ``reorder``: ``cache.reorder_cache(beam_index(B))`` and the held sequence's rows follow. ``crop N``:
    ``compat.crop(cache, N)`` and the held sequence loses its last N tokens. ``stop_before``: index of an op not to
    run (the steps so far are returned).

    Returns:
        the recorded ``Step`` list (float64 logits ``[B, k, V]``).

    Raises:
        SubjectRaised: any exception of the subject (names the op).
        ValueError: an op this driver does not implement (fork, repeat, select, reset).
    """
    import torch

    case, model = ctx.case, ctx.model
    position_mode = position_mode or case.position_ids
    gen = case_generator(case, model.name)
    encoder_ids = encoder_ids_for(ctx, gen)
    seq = torch.empty(case.batch, 0, dtype=torch.long)
    steps: list[Step] = []

    def feed(op_index, label, n):
        nonlocal seq
        new = random_tokens(gen, case.batch, n, model.vocab_size)
        start = seq.shape[1]
        try:
            logits = forward(model, cache, new, start, position_mode, encoder_ids)
        except Exception as exc:  # noqa: BLE001 - the subject's failure
            raise SubjectRaised(label, exc) from exc
        seq = torch.cat([seq, new], dim=1)
        steps.append(Step(len(steps), op_index, label, start, n, logits, seq.clone(), seq_length(cache)))

    for i, op in enumerate(case.ops):
        if i == stop_before:
            break
        if op.name in ("prefill", "chunk"):
            feed(i, op.label, op.n)
        elif op.name == "decode":
            after = " after reorder" if any(o.name == "reorder" for o in case.ops[:i]) else ""
            for s in range(op.n):
                feed(i, f"decode {s + 1}{after}", 1)
        elif op.name == "reorder":
            idx = beam_index(case.batch)
            try:
                cache.reorder_cache(idx)
            except Exception as exc:  # noqa: BLE001
                raise SubjectRaised("reorder", exc) from exc
            seq = seq[idx]
        elif op.name == "crop":
            try:
                compat.crop(cache, op.n, seq.shape[1])
            except Exception as exc:  # noqa: BLE001
                raise SubjectRaised(op.label, exc) from exc
            seq = seq[:, : seq.shape[1] - op.n]
        else:
            raise ValueError(f"op {op.name!r} is not supported by {ctx.check_name} (case {case.id})")
    ctx.encoder_ids = encoder_ids
    return steps


def oracle_slices(ctx, steps) -> dict:
    """``{step.index: (oracle, uncached)}`` logits ``[B, k, V]`` of each step. When every step's sequence is a prefix
    of the last one (no reorder or crop in between), one oracle forward of the last sequence serves them all
    (causality); otherwise one per step."""
    import torch

    enc = getattr(ctx, "encoder_ids", None)
    last = steps[-1].seq
    if all(torch.equal(s.seq, last[:, : s.seq.shape[1]]) for s in steps):
        full_o, full_u = ctx.oracle.logits(last, encoder_ids=enc), ctx.oracle.uncached(last, encoder_ids=enc)
        return {s.index: (full_o[:, s.start:s.start + s.length], full_u[:, s.start:s.start + s.length])
                for s in steps}
    return {s.index: (ctx.oracle.logits(s.seq, encoder_ids=enc)[:, s.start:s.start + s.length],
                      ctx.oracle.uncached(s.seq, encoder_ids=enc)[:, s.start:s.start + s.length]) for s in steps}


def twin_line(ctx) -> str:
    twin = ctx.subject.twin
    qc = getattr(twin, "quant_config", None)
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
    ctx.fail([f"the subject raised {describe_raise(exc)}",
              f"ops: {ctx.case.ops_label()}   [raised at {exc.where}]",
              "likely cause: " + cause], {"raised": type(exc.cause).__name__, "failed_at": exc.where})


def twin_spec(ctx):
    import dataclasses

    return dataclasses.replace(ctx.subject, name=f"{ctx.subject.name}.twin", factory=ctx.subject.twin, twin=None)
