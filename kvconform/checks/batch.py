"""Family ``batch``: batch surgery on a warm cache — ``reorder_cache`` (beam search), ``batch_repeat_interleave`` and
``batch_select_indices`` (contrastive search, prompt-cache expansion) — keeps every row's own history.

The cases use *distinct* prompts per row, left-padded with an attention mask (``params.padding``: pad tokens per
row), so that a row that picks up another row's keys or states, or a pad that leaks, shows in the logits. After
each op the decode steps are compared with the oracle rows of the rearranged batch. ``check_beam_search`` runs
``generate(num_beams ≥ 2)`` on such a batch and compares with uncached beam search. ``check_reorder_after_flush``
(lossy subjects): beam ``reorder_cache`` with distinct rows around a residual flush, then decode, equals the
fake-quant twin (transformers 5.5–5.18 left the quantized part in the old order).
"""

from __future__ import annotations

from kvconform import compat
from kvconform.checks import EXACT, IGNORES_OPS, OP_PARAMS, OpRule, Param, register
from kvconform.checks._drive import SubjectRaised, case_generator, generate, random_tokens
from kvconform.checks._interpreter import run_ops
from kvconform.checks._judge import judge, record_verdict
from kvconform.checks._diagnosis import describe_exception, fail_raised, fail_verdict, token_mismatch
from kvconform.checks._lossy import LOSSY_OPS, drive, fail_subject_raised, fail_twin, judge_twin, lossy_only
from kvconform.subjects import FRESH, kind_of

_OP_CAUSE = {
    "reorder": ("reorder_cache", "reorder_cache() did not move every tensor of every layer with its row (keys "
                "and values, conv and recurrent states, and any per-row counter)"),
    "repeat": ("batch_repeat_interleave", "batch_repeat_interleave() did not repeat every tensor row by row "
               "([b0, b0, b1, b1]: repeat_interleave, not tile)"),
    "select": ("batch_select_indices", "batch_select_indices() did not keep exactly the selected rows of every "
               "tensor of every layer"),
}


def _run_batch_case(ctx, op_name):
    if not any(op.name == op_name for op in ctx.case.ops):
        raise ValueError(f"case {ctx.case.id}: this check needs a '{op_name}' op")
    if op_name == "reorder" and ctx.case.batch < 2:
        raise ValueError(f"case {ctx.case.id}: a non-identity reorder needs batch ≥ 2")
    method, cause_text = _OP_CAUSE[op_name]
    try:
        steps = run_ops(ctx, ctx.new_cache())
    except SubjectRaised as exc:
        fail_raised(ctx, exc, _raised_cause(ctx, exc, op_name, method))
    verdict = judge(ctx, steps)
    record_verdict(ctx, verdict, len(steps))
    if not verdict.passed:
        op_index = next(i for i, op in enumerate(ctx.case.ops) if op.name == op_name)

        def cause(step, cmp):
            if step.op_index < op_index:
                return "the batch is wrong before the op: rows or padding are not kept apart (see the logits family)"
            return cause_text

        fail_verdict(ctx, verdict, cause)


def _raised_cause(ctx, exc, op_name, method) -> str:
    """The likely cause of a raise in a batch case, from where it raised relative to the batch op (``exc.op_index``
    against the op's index in the case) — ``fail_raised`` prefers what was measured at the raise when it explains
    it (a layer count, a key length, the tensors' batch sizes)."""
    op_index = next(i for i, op in enumerate(ctx.case.ops) if op.name == op_name)
    raised_at = exc.op_index if exc.op_index is not None else op_index
    if raised_at < op_index:
        return (f"the cache fails before {method}() is called, at {exc.where}: it cannot take this case's batch "
                f"(distinct rows, left padding and an attention mask — see the logits family)")
    if raised_at == op_index:
        if isinstance(exc.cause, (AttributeError, NotImplementedError)):
            return f"the cache (or one of its layers) has no working {method}()"
        return f"{method}() fails on this cache (see the exception)"
    return (f"after {method}() the next forward fails: {method}() left the cache in a state its update() cannot "
            f"handle (see the exception)")


@register("batch", needs=("forward", "reorder"), params=OP_PARAMS,
          ops=OpRule(required=("reorder",), min_batch=2, why="a non-identity reorder needs two rows"))
def check_reorder_then_decode(ctx):
    """Left-padded distinct prompts, decode, ``reorder_cache`` with a non-identity permutation, decode: every row
    equals the oracle row of the permuted batch."""
    _run_batch_case(ctx, "reorder")


@register("batch", needs=("forward", "batch_repeat"), params=OP_PARAMS, ops=OpRule(required=("repeat",)))
def check_repeat_then_decode(ctx):
    """Left-padded distinct prompts, ``batch_repeat_interleave(r)``, decode: rows ``b·r … b·r+r−1`` each equal the
    oracle of prompt ``b``."""
    _run_batch_case(ctx, "repeat")


@register("batch", needs=("forward", "batch_select"), params=OP_PARAMS,
          ops=OpRule(required=("select",), min_batch=2, why="select keeps every row but the first"))
def check_select_then_decode(ctx):
    """Left-padded distinct prompts, ``batch_select_indices`` dropping row 0, decode: the kept rows equal their
    oracle rows."""
    _run_batch_case(ctx, "select")


def _beam(m, prompt, mask, n, beams, cache_kwargs):
    """Beam search with ``m`` (a ``PreTrainedModel``) through ``_drive.generate``; returns (sequences, sequence
    scores float64) on CPU."""
    import torch

    seq, _, out = generate(m, prompt, n, cache_kwargs, mask, num_beams=beams, early_stopping=False,
                           length_penalty=1.0, output_scores=True)
    return seq, out.sequences_scores.detach().to("cpu", torch.float64)


@register("batch", needs=("generate", "reorder"), judges=(EXACT,),
          params={**OP_PARAMS, "beams": Param(int, default=2, min=2, doc="num_beams of generate()")},
          ops=IGNORES_OPS)
def check_beam_search(ctx):
    """``generate(num_beams=params.beams)`` on distinct, left-padded prompts with the subject's cache equals uncached
    beam search: the same sequences, and sequence scores within the tolerance (noise floor: uncached beam search in
    the case dtype vs in float64)."""
    import torch

    case, model = ctx.case, ctx.model
    beams = int(case.params.get("beams", 2))
    if beams < 2:
        raise ValueError(f"case {case.id}: params.beams must be ≥ 2")
    gen = case_generator(case, model.name)
    length = case.encoder_len if model.is_encoder_decoder else case.prompt
    prompt = random_tokens(gen, case.batch, length, model.vocab_size)
    mask = torch.ones_like(prompt)
    padding = case.params.get("padding") if not model.is_encoder_decoder else None
    for b, p in enumerate(padding or ()):
        if b < case.batch:
            prompt[b, :p], mask[b, :p] = 0, 0
    n = case.max_new_tokens
    ops_text = (f"generate(num_beams={beams}, prompts {length} tokens"
                + (f" left-padded by {list(padding)[:case.batch]}" if padding else "") + f", max_new_tokens={n})")
    cache = ctx.subject.build(model, max_cache_len=ctx.max_cache_len, batch_size=case.batch * beams,
                              encoder_len=case.encoder_len)
    try:
        seq, scores = _beam(model.model, prompt, mask, n, beams, compat.generate_cache_kwargs(cache, model.model))
    except Exception as exc:  # noqa: BLE001
        missing = isinstance(exc, (AttributeError, NotImplementedError))
        ctx.fail([f"beam search raised {describe_exception(exc)}", f"ops: {ops_text}",
                  "likely cause: " + ("the cache has no working reorder_cache() (beam search calls it every step)"
                                      if missing else "the cache cannot follow beam search (see the exception)")],
                 {"raised": type(exc).__name__})
    ref_seq, ref_scores = _beam(model.model, prompt, mask, n, beams, {"use_cache": False})
    # noise floor: the same uncached beam search in float64, row by row without the pads (a fully masked pad row
    # turns some models' float64 eager attention into NaN; a padded row must equal its prompt alone anyway)
    exact_scores = torch.cat([_beam(model.oracle_model(), prompt[b:b + 1, mask[b].bool()], None, n, beams,
                                    {"use_cache": False})[1] for b in range(case.batch)])
    tol = ctx.tolerance()
    floor = float((ref_scores - exact_scores).abs().max())
    same = tuple(seq.shape) == tuple(ref_seq.shape) and bool((seq == ref_seq).all())
    delta = float((scores - ref_scores).abs().max()) if same else float("inf")
    bound = tol.bound(floor)
    ctx.metrics.update(max_abs=delta, tolerance=bound, noise_floor=floor, beams=beams, tokens_equal=same)
    if same and delta <= bound:
        return
    lines = []
    if not same:
        lines.append(token_mismatch(seq, ref_seq, "beam-search sequences", "uncached beam search"))
    else:
        lines.append(f"max|Δ sequence score| = {delta:.1e}, but should be ≤ {bound:.1e} ({tol.describe(floor)})")
    lines += [f"ops: {ops_text}",
              "likely cause: reorder_cache() does not move every layer's tensors with the surviving beams (or the "
              "padding of the rows leaks into other rows)"]
    ctx.fail(lines)


# ------------------------------------------------------------------------------------------ reorder after a flush
def _lossy_subject(subject, model, case, device="cpu"):
    """Applicability: lossy subjects, with a fake-quant twin or judged by self-consistency (``kind="lossy"``)."""
    if kind_of(subject).declared_lossy:
        return None
    return lossy_only(subject, model, case, device=device)


@register("batch", needs=("reorder",), applies=_lossy_subject,
          ops=OpRule(allowed=LOSSY_OPS, required=("reorder",), min_batch=2, why="the rows are reversed around a flush"))
def check_reorder_after_flush(ctx):
    """Beam ``reorder_cache`` (rows reversed) around a residual flush, then decode: every step equals the twin,
    which reorders its quantized part and its residual together (a lossy subject without a twin: a fresh instance
    of its class fed the reordered history)."""
    if not any(op.name == "reorder" for op in ctx.case.ops) or ctx.case.batch < 2:
        raise ValueError(f"case {ctx.case.id}: check_reorder_after_flush needs a 'reorder' op and batch ≥ 2")
    try:
        steps = drive(ctx, ctx.new_cache())
    except SubjectRaised as exc:
        fail_subject_raised(ctx, exc, "reorder_cache() does not handle this state (e.g. an emptied residual after a flush)"
                + _reorder_history())
    if ctx.kind.target == FRESH:
        verdict = judge(ctx, steps)
        record_verdict(ctx, verdict, len(steps))
        if not verdict.passed:
            fail_verdict(ctx, verdict, lambda step, cmp: verdict.cause, driver=drive)
        return
    failed, worst = judge_twin(ctx, steps)
    _, cmp = failed or worst
    ctx.metrics.update(max_abs=cmp.max_abs, tolerance=cmp.tol, noise_floor=cmp.floor, steps=len(steps),
                       compared_with="fake-quant twin")
    if failed:
        fail_twin(ctx, failed, "reorder_cache() moved part of the cache but not all of it: the quantized part "
                   "(or the residual) kept the old row order" + _reorder_history())


def _reorder_history() -> str:
    if compat.quantized_reorder_fixed():
        return ""
    return (f" — transformers {compat.transformers_version()} has this fault: QuantizedLayer.reorder_cache "
            f"reorders only the exact residual (fixed in 5.19)")
