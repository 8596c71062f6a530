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

import copy

from kvconform import compat
from kvconform.checks import (EXACT, FRESH_KINDS, IGNORES_OPS, LOSSY_FRESH, LOSSY_KINDS, OP_PARAMS, CheckSkipped,
                              OpRule, Param, register)
from kvconform.checks._drive import (SubjectRaised, case_generator, encoder_features, encoder_input, forward,
                                     generate, image_prompt, prefill_refusal, random_tokens, seq_length)
from kvconform.checks._interpreter import run_ops
from kvconform.checks._judge import judge, record_verdict
from kvconform.checks._diagnosis import describe_exception, fail_raised, fail_verdict, token_mismatch
from kvconform.checks._lossy import LOSSY_OPS, TWIN_ONLY, drive, fail_subject_raised, fail_twin, judge_twin
from kvconform.ops import op_names
from kvconform.subjects import FRESH, kind_of


def _run_batch_case(ctx, names):
    """Run the case's ops, judge every step against the oracle; a failure after the first op of ``names`` (in
    the case) is blamed on that op (its ``OpSpec.method`` and ``OpSpec.fault``, ``kvconform.ops``)."""
    op_index = next((i for i, op in enumerate(ctx.case.ops) if op.name in names), None)
    if op_index is None:
        raise ValueError(f"case {ctx.case.id}: this check needs one of the ops {', '.join(names)}")
    spec = ctx.case.ops[op_index].spec
    if ctx.case.batch < max(spec.min_batch, 2 if spec.rows == "permute" else 1):
        raise ValueError(f"case {ctx.case.id}: a non-identity {spec.name} needs batch ≥ 2")
    method, cause_text = spec.method, spec.fault
    try:
        steps = run_ops(ctx, ctx.new_cache())
    except SubjectRaised as exc:
        fail_raised(ctx, exc, _raised_cause(ctx, exc, op_index, method))
    verdict = judge(ctx, steps)
    record_verdict(ctx, verdict, len(steps))
    if not verdict.passed:
        def cause(step, cmp):
            if step.op_index < op_index:
                return "the batch is wrong before the op: rows or padding are not kept apart (see the logits family)"
            if spec.name == "repeat" and _copies_share_storage(ctx, op_index):
                return (f"{method}() left the copies of each row sharing storage (a page, a block or a buffer taken "
                        f"by reference, without copy-on-write): measured, a decode that feeds every copy of a row "
                        f"the same token right after it is exact, so the rows were repeated right; the copies go "
                        f"wrong once they write different tokens into what they share")
            return cause_text

        fail_verdict(ctx, verdict, cause)


def _copies_share_storage(ctx, op_index: int) -> bool:
    """Whether the case's ops up to its ``repeat`` (at ``op_index``), then one decode feeding every copy of a row
    the same token, equal the oracle (measured on a fresh cache): the repeat itself was right, and a failure after
    it comes from copies that share what they write (a raise or a failure here: False)."""
    import torch

    from kvconform.checks._drive import SubjectRaised as Raised
    from kvconform.checks._interpreter import Runner

    ops = ctx.case.ops[:op_index + 1]
    repeats = int(ops[-1].n or 1)
    runner = Runner(ctx, ctx.new_cache())
    try:
        runner.run(ops, parked=False)
        groups = runner.batch // max(repeats, 1)
        tokens = ((torch.arange(groups) * 7 + 3) % ctx.model.vocab_size).repeat_interleave(repeats)[:, None]
        runner.feed(1, "decode (each row's copies fed one token)", tokens=tokens.to(torch.long))
    except Raised:
        return False
    return bool(judge(ctx, runner.steps).passed)


def _raised_cause(ctx, exc, op_index, method) -> str:
    """The likely cause of a raise in a batch case, from where it raised relative to the batch op (``exc.op_index``
    against the op's index in the case) — ``fail_raised`` prefers what was measured at the raise when it explains
    it (a layer count, a key length, the tensors' batch sizes)."""
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


BEAM_OPS = op_names(rows="permute")
"""The beam reorders (``reorder``, ``swap_rows``, ...: every op of ``kvconform.ops`` that permutes the rows)."""


def _beam_case(case):
    """Load-time rule of ``check_reorder_then_decode``: at least one beam reorder op (``BEAM_OPS``)."""
    if not any(op.name in BEAM_OPS for op in case.ops):
        given = "[" + ", ".join(repr(f"{op.name} {op.n}" if op.n else op.name) for op in case.ops) + "]"
        return "ops", (f"check_reorder_then_decode needs at least one beam reorder op ({', '.join(BEAM_OPS)}); "
                       f"got ops = {given}: add one")
    return None


@register("batch", needs=("forward", "reorder"), params=OP_PARAMS, validate=_beam_case,
          ops=OpRule(min_batch=2, why="a non-identity reorder needs two rows"))
def check_reorder_then_decode(ctx):
    """Left-padded distinct prompts, decode, ``reorder_cache`` with a non-identity permutation (any beam reorder
    op of the case: ``BEAM_OPS``), decode: every row equals the oracle row of the permuted batch."""
    _run_batch_case(ctx, BEAM_OPS)


@register("batch", needs=("forward", "batch_repeat"), params=OP_PARAMS, ops=OpRule(required=("repeat",)))
def check_repeat_then_decode(ctx):
    """Left-padded distinct prompts, ``batch_repeat_interleave(r)``, decode: rows ``b·r … b·r+r−1`` each equal the
    oracle of prompt ``b``."""
    _run_batch_case(ctx, ("repeat",))


@register("batch", needs=("forward", "batch_select"), params=OP_PARAMS,
          ops=OpRule(required=("select",), min_batch=2, why="select keeps every row but the first"))
def check_select_then_decode(ctx):
    """Left-padded distinct prompts, ``batch_select_indices`` dropping row 0, decode: the kept rows equal their
    oracle rows."""
    _run_batch_case(ctx, ("select",))


def _beam(m, prompt, mask, n, beams, cache_kwargs):
    """Beam search with ``m`` (a ``PreTrainedModel``) through ``_drive.generate``; returns (sequences, sequence
    scores float64) on CPU."""
    import torch

    seq, _, out = generate(m, prompt, n, cache_kwargs, mask, num_beams=beams, early_stopping=False,
                           length_penalty=1.0, output_scores=True)
    return seq, out.sequences_scores.detach().to("cpu", torch.float64)


@register("batch", needs=("generate", "reorder"), judges=(EXACT,),
          params={**OP_PARAMS, "beams": Param(int, default=2, min=2, doc="num_beams of generate()")},
          ops=IGNORES_OPS, unjudged={
              LOSSY_FRESH: "{subject} is lossy: its beam search is not compared with the exact model's but with a "
                           "fresh instance fed each beam's tokens (check_beam_search_self_consistent)"},
          transformers_only="beam search is transformers' generate(num_beams > 1); kvconform decodes a from-scratch "
                            "model greedily")
def check_beam_search(ctx):
    """``generate(num_beams=params.beams)`` on distinct, left-padded prompts with the subject's cache equals uncached
    beam search: the same sequences, and sequence scores within the tolerance (noise floor: uncached beam search in
    the case dtype vs in float64)."""
    import torch

    case, model = ctx.case, ctx.model
    beams = case.params.beams
    if beams < 2:
        raise ValueError(f"case {case.id}: params.beams must be ≥ 2")
    prompt, mask, text = _beam_prompts(ctx)
    n = case.max_new_tokens
    ops_text = f"generate(num_beams={beams}, {text}, max_new_tokens={n})"
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
    exact_scores = torch.cat([_beam(model.oracle_model(), prompt[b:b + 1] if mask is None
                                    else prompt[b:b + 1, mask[b].bool()], None, n, beams,
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
    without = _wrong_without_reorder(ctx, prompt, mask, n)
    lines += [f"ops: {ops_text}",
              "likely cause: " + (without or "reorder_cache() does not move every layer's tensors with the surviving "
                                  "beams (or the padding of the rows leaks into other rows)")]
    ctx.fail(lines, {"wrong_without_reorder": without is not None})


FRESH_ONLY = ("applies to lossy subjects without a fake-quant twin (kind='lossy' or 'press'), whose beam search is "
              "compared with a fresh instance of their class; an exact subject's is compared with uncached beam "
              "search (check_beam_search)")
"""The skip reason of ``check_beam_search_self_consistent`` (``judges=FRESH_KINDS``) on the other kinds."""


def cache_before_any_token(cache) -> bool:
    """Whether ``cache`` holds no token yet (``get_seq_length()`` 0 or undefined): a raise inside ``generate`` then came
    at its first forward, the prefill."""
    return not seq_length(cache)


def _beam_prompts(ctx):
    """The seeded, left-padded prompts ``[B, P]`` and their mask of ``check_beam_search`` (``params.padding``; a VLM's
    image first), and the ops text's prompt part. An encoder-decoder's prompt is its encoder input, unpadded
    (``encoder_input``; whisper's float features ``[B, mel, frames]`` with no mask: None)."""
    import torch

    case, model = ctx.case, ctx.model
    gen = case_generator(case, model.name)
    features = encoder_features(model)
    if features is not None:
        return (encoder_input(model, gen, case.batch, case.encoder_len), None,
                f"encoder features {features[0]}x{features[1]}")
    length = case.encoder_len if model.is_encoder_decoder else case.prompt
    prompt = random_tokens(gen, case.batch, length, model.vocab_size)
    mask = torch.ones_like(prompt)
    padding = case.params.get("padding") if not model.is_encoder_decoder else None
    for b, p in enumerate(padding or ()):
        if b < case.batch:
            prompt[b, :p], mask[b, :p] = 0, 0
    if not model.is_encoder_decoder:
        prompt = image_prompt(model, prompt, [(padding or [])[b] if b < len(padding or []) else 0
                                              for b in range(case.batch)])
    text = f"prompts {length} tokens" + (f" left-padded by {list(padding)[:case.batch]}" if padding else "")
    return prompt, mask, text


@register("batch", needs=("generate", "reorder"), judges=FRESH_KINDS, unjudged=FRESH_ONLY,
          params={**OP_PARAMS, "beams": Param(int, default=2, min=2, doc="num_beams of generate()")},
          ops=IGNORES_OPS, transformers_only="beam search is transformers' generate(num_beams > 1)")
def check_beam_search_self_consistent(ctx):
    """Beam search with a lossy subject without a twin (``generate(num_beams=params.beams, num_return_sequences=
    beams, length_penalty=0)`` on distinct, left-padded prompts): the score of every returned beam — the sum of the
    log-probabilities beam search computed, step by step, from a cache that ``reorder_cache`` rearranged at every
    step — equals the sum of the log-probabilities of the same tokens from a fresh instance of the subject's class
    fed each beam's tokens directly (kvconform's own loop: the prompts as one prefill, one token a step, the same
    batch of rows × beams), within the tolerance of each step times the tokens generated. A reorder that leaves
    part of the cache behind gives a beam another history than its tokens."""
    import torch

    from kvconform.checks._interpreter import Runner
    from kvconform.checks._observe import at_batch

    case, model = ctx.case, ctx.model
    beams, n = case.params.beams, case.max_new_tokens
    prompt, mask, text = _beam_prompts(ctx)
    ops_text = f"generate(num_beams={beams}, {text}, max_new_tokens={n}, length_penalty=0)"
    cache = ctx.subject.build(model, max_cache_len=ctx.max_cache_len, batch_size=case.batch * beams,
                              encoder_len=case.encoder_len)
    try:
        seq, _, out = generate(model, prompt, n, compat.generate_cache_kwargs(cache, model.model), mask,
                               num_beams=beams, num_return_sequences=beams, early_stopping=False, length_penalty=0.0,
                               output_scores=True)
    except Exception as exc:  # noqa: BLE001
        refusal = cache_before_any_token(cache) and prefill_refusal(ctx, SubjectRaised("prefill (generate)", exc))
        if refusal:  # a clear refusal of the padded prompts, as the contract allows: nothing to judge here
            raise CheckSkipped(refusal) from None
        missing = isinstance(exc, (AttributeError, NotImplementedError))
        ctx.fail([f"beam search raised {describe_exception(exc)}", f"ops: {ops_text}",
                  "likely cause: " + ("the cache has no working reorder_cache() (beam search calls it every step)"
                                      if missing else "the cache cannot follow beam search (see the exception)")],
                 {"raised": type(exc).__name__})
    scores = out.sequences_scores.detach().to("cpu", torch.float64)
    rows = case.batch * beams
    one = at_batch(ctx, rows)
    runner = Runner(one, one.new_cache(), position_mode="explicit", padding=[])
    P = prompt.shape[1]
    want = torch.zeros(rows, dtype=torch.float64)
    try:
        logits = runner.feed(P, f"prefill({P}) (own loop)", tokens=prompt.repeat_interleave(beams, 0),
                             tokens_mask=mask.repeat_interleave(beams, 0)).logits[:, -1]
        for i in range(n):
            token = seq[:, P + i]
            want += torch.log_softmax(logits, dim=-1).gather(-1, token[:, None])[:, 0]
            if i + 1 < n:
                logits = runner.feed(1, f"decode {i + 1} (own loop)", tokens=token[:, None]).logits[:, -1]
    except SubjectRaised as exc:
        fail_subject_raised(ctx, exc, "the cache does not take the forwards of a greedy loop (see the exception)")
    bound = ctx.tolerance().bound(0.0) * n
    delta = (scores - want).abs()
    worst = int(delta.argmax())
    ctx.metrics.update(max_abs=float(delta.max()), tolerance=bound, beams=beams,
                       compared_with="own loop on a fresh instance fed each beam's tokens")
    if float(delta.max()) <= bound:
        return
    ctx.fail([f"beam {worst % beams} of prompt {worst // beams}: sequence score = {float(scores[worst]):.4f} from "
              f"beam search, but a fresh {ctx.subject.name} fed the same tokens gives {float(want[worst]):.4f} "
              f"(|Δ| = {float(delta[worst]):.1e}, should be ≤ {bound:.1e}: the tolerance × {n} tokens)",
              f"beams off: {int((delta > bound).sum())} of {rows}",
              f"ops: {ops_text} vs prefill({P}) → decode×{n - 1} of each beam's tokens",
              "likely cause: reorder_cache() does not move every part of the cache with the surviving beams (a "
              "layer, a residual or a codec state left behind, or rows shared between beams), so a beam continues "
              "from another beam's history"], {"failed_at": f"beam {worst}"})


def _wrong_without_reorder(ctx, prompt, mask, n) -> str | None:
    """Measured before blaming ``reorder_cache()`` for a beam-search failure: greedy ``generate()`` on the same
    prompts (no beams, so no reorder) with a fresh subject cache against uncached greedy. Returns the cause when the
    cache is already wrong there (raises, other tokens, or logits beyond the case tolerance), else None. Exact
    subjects only (a lossy cache differs from uncached greedy by design)."""
    if ctx.kind.budgeted:
        return None
    model = ctx.model
    try:
        cache = ctx.subject.build(model, max_cache_len=ctx.max_cache_len, batch_size=ctx.case.batch,
                                  encoder_len=ctx.case.encoder_len)
        seq, logits, _ = generate(model, prompt, n, compat.generate_cache_kwargs(cache, model.model), mask)
    except Exception as exc:  # noqa: BLE001 - the subject's own failure, described
        return (f"the cache fails without any reorder: greedy generate() on the same prompts raised "
                f"{describe_exception(exc)}, so the fault is not in reorder_cache() (see the generate and logits "
                f"families)")
    ref_seq, ref_logits, _ = generate(model, prompt, n, {"use_cache": False}, mask)
    bound = ctx.tolerance().bound(0.0)
    if tuple(seq.shape) != tuple(ref_seq.shape) or not bool((seq == ref_seq).all()):
        return ("the cache is wrong without any reorder: greedy generate() on the same prompts already gives other "
                "tokens than uncached greedy, so the fault is not in reorder_cache() (see the generate and logits "
                "families)")
    delta = float((logits - ref_logits).abs().max())
    if delta > bound:
        return (f"the cache is wrong without any reorder: greedy generate() on the same prompts is off by "
                f"max|Δlogit| = {delta:.1e} (> {bound:.1e}) from uncached greedy, so the fault is not in "
                f"reorder_cache() (see the generate and logits families)")
    return None


# ------------------------------------------------------------------------------------------ reorder after a flush
QUANTIZED_ONLY = {"quantized": TWIN_ONLY["has_twin"]}
"""``facts=`` of ``check_reorder_after_flush``: quantized subjects, with a fake-quant twin or judged by
self-consistency (``kind="lossy"``; ``Kind.quantized``)."""


@register("batch", needs=("reorder",), facts=QUANTIZED_ONLY,
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
        fail_subject_raised(ctx, exc, "reorder_cache() does not handle this state "
                "(e.g. an emptied residual after a flush)"
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


# ======================================================================================================================
# Exactness owed by every kind but exact: identity ops, a padded row alone
# Exact where exactness is owed, even for a cache that is not exact (family ``batch``).
#
# A lossy, evicting or press subject is judged by self-consistency: after an op, a fresh instance of its class fed
# the equivalent history. That comparison shares whatever the class does on every run — a fresh instance fed a
# left-padded batch has the same padding bug, and after a batch-size change the comparison is widened to the class's
# own compression error. Two properties need no such target, because the exact answer is known:
#
# * ``check_identity_ops``: an identity op — ``reorder_cache`` by the identity permutation, ``batch_select_indices``
#   of every row, ``batch_repeat_interleave(1)``, ``copy.deepcopy`` (the copy continues) — changes nothing, so the
#   next logits must equal those of the same cache left untouched, within the exact noise floor. A cache that decodes
#   and re-quantizes its store on every batch op moves them by its quantization error.
# * ``check_padded_row_alone``: a left-padded row of a batch must give the logits of the same row run alone (batch 1,
#   no pads) in a fresh instance of the class, within the exact noise floor of the case dtype (the built-in case runs
#   in float64, where batch shape cannot move a quantization level). A compressing cache that keeps pads, or reads
#   held slots under the mask columns of other positions, fails here while a fresh padded instance would agree. A
#   clear refusal of the padded prefill (an error naming the padding, not a raw tensor error) passes, with a note.
#
# Both apply to every kind but ``exact`` (the exact families already hold an exact cache to the oracle).


RAW_ERRORS = (IndexError, KeyError, AttributeError, ZeroDivisionError, RuntimeError)
"""What a tensor op raises by itself; a clear refusal of a padded batch is another error naming the padding."""
PAD_WORDS = ("pad", "attention mask", "attention_mask")

IDENTITY_OPS = {
    "reorder": ("reorder", "reorder_cache(identity permutation)"),
    "select": ("batch_select", "batch_select_indices(every row)"),
    "repeat": ("batch_repeat", "batch_repeat_interleave(1)"),
    "fork": ("deepcopy", "copy.deepcopy (the copy continues)"),
}
"""``{op: (capability, label)}`` of ``check_identity_ops``."""

CAUSES = {
    "reorder": "reorder_cache() rebuilds the store instead of permuting it (it decodes and re-quantizes, re-scores "
               "or re-compresses what it holds): a permutation of the rows must move the stored data untouched",
    "select": "batch_select_indices() rebuilds the store instead of indexing it (it decodes and re-quantizes, or "
              "re-compresses what it holds): keeping rows must keep their data untouched",
    "repeat": "batch_repeat_interleave() rebuilds the store instead of repeating it (it decodes and re-quantizes, or "
              "re-compresses what it holds): repeating rows must copy their data untouched",
    "fork": "copy.deepcopy does not copy the cache as it is (a custom __deepcopy__ that rebuilds, re-quantizes or "
            "drops part of the store, or state left shared with the original)",
}


NON_EXACT = LOSSY_KINDS
"""The kinds the exactness checks judge: every kind but ``exact`` (lossy with or without a twin, evicting, press)."""
NOT_FOR_EXACT = ("applies to lossy, evicting and press subjects: an exact subject is held to the float64 oracle by "
                 "every family already")


def _tokens(ctx, gen, n):
    return random_tokens(gen, ctx.case.batch, n, ctx.model.vocab_size)


def _floor_target(ctx, seq, target, length):
    """``target + (uncached − oracle)`` over the last ``length`` positions of ``seq``: the exact path's noise floor
    around ``target`` (as ``_judge.judge`` does for a fresh instance)."""
    oracle = ctx.oracle.logits(seq)[:, -length:]
    uncached = ctx.oracle.uncached(seq)[:, -length:]
    return target + (uncached - oracle)


@register("batch", needs=("forward",), judges=NON_EXACT, unjudged=NOT_FOR_EXACT, params={
    "identity": Param(list, default=list(IDENTITY_OPS), items=str, doc="identity ops checked, each on its own run: "
                      "reorder, select, repeat, fork"),
    "prefill": Param(int, default=24, min=2, doc="prefill length (an evicting subject: at least tokens_max + 5)"),
    "decode": Param(int, default=3, min=1, doc="decode steps compared after the op"),
}, ops=IGNORES_OPS)
def check_identity_ops(ctx):
    """For each identity op of ``params.identity`` (those the subject declares the capability of): prefill →
    decode 1 → the op → decode N on the subject; every decode step after the op equals a second instance fed the
    same tokens without the op, within the exact noise floor."""

    params = ctx.case.params
    unknown = [op for op in params.identity if op not in IDENTITY_OPS]
    if unknown:
        raise ValueError(f"case {ctx.case.id}: params.identity {unknown} not among {list(IDENTITY_OPS)}")
    ops = [op for op in params.identity if IDENTITY_OPS[op][0] in ctx.subject.capabilities]
    if not ops:
        raise CheckSkipped(f"{ctx.subject.name} declares none of the capabilities of the identity ops "
                           f"({', '.join(c for c, _ in IDENTITY_OPS.values())})")
    kind = kind_of(ctx.subject)
    P = max(params.prefill, (kind.tokens_max or 0) + 5)
    steps = params.decode
    gen = case_generator(ctx.case, ctx.model.name)
    program = [_tokens(ctx, gen, P), _tokens(ctx, gen, 1)] + [_tokens(ctx, gen, 1) for _ in range(steps)]
    untouched = _run_identity(ctx, None, program, P, steps)
    for op in ops:
        _run_identity(ctx, op, program, P, steps, untouched)
    ctx.metrics.update(identity_ops=ops, prefill=P)


def _run_identity(ctx, op, program, P, steps, untouched=None):
    """Run ``program`` (token tensors ``[B, n]``) on a fresh subject cache, applying the identity ``op`` after the
    second forward (None: no op). Returns the logits of every forward; with ``untouched`` (the no-op run's), fails
    the item at the first step after the op that differs from it beyond the exact noise floor."""
    import torch

    from kvconform.oracle import compare_logits

    B = ctx.case.batch
    op_label = IDENTITY_OPS[op][1] if op else "no op"
    ops_text = f"prefill({P}) → decode×1 → {op_label} → decode×{steps}"
    subject = ctx.new_cache()
    seq = torch.zeros(B, 0, dtype=torch.long)
    tol = ctx.tolerance()
    out = []
    for i, tokens in enumerate(program):
        start = seq.shape[1]
        label = f"prefill({P})" if i == 0 else f"decode {i}" if i == 1 else f"decode {i - 1} after the op"
        if i == 2 and op is not None:
            try:
                if op == "reorder":
                    subject.reorder_cache(torch.arange(B))
                elif op == "select":
                    subject.batch_select_indices(torch.arange(B))
                elif op == "repeat":
                    subject.batch_repeat_interleave(1)
                else:
                    subject = copy.deepcopy(subject)
            except Exception as exc:  # noqa: BLE001 - the subject's failure
                ctx.fail([f"{op_label} raised {describe_exception(exc)}", f"ops: {ops_text}   [raised at {op}]",
                          f"likely cause: the cache has no working {op_label.split('(')[0]}"],
                         {"raised": type(exc).__name__, "failed_at": op})
        seq = torch.cat([seq, tokens], dim=1)
        try:
            got = forward(ctx.model, subject, tokens, start, "explicit", first=start == 0)
        except Exception as exc:  # noqa: BLE001 - the subject's failure
            ctx.fail([f"{label} raised {describe_exception(exc)}", f"ops: {ops_text}   [raised at {label}]",
                      "likely cause: " + (CAUSES[op] if op and i >= 2 else "the cache fails on this sequence (see "
                                                                            "the exception)")],
                     {"raised": type(exc).__name__, "failed_at": label})
        out.append(got)
        if untouched is None or i < 2:
            continue
        want = untouched[i]
        cmp = compare_logits(got, want, _floor_target(ctx, seq, want, tokens.shape[1]), tol)
        ctx.metrics.update(max_abs=max(cmp.max_abs, ctx.metrics.get("max_abs", 0.0)), tolerance=cmp.tol,
                           noise_floor=cmp.floor)
        if not cmp.passed:
            ctx.fail([f"max|Δlogit| = {cmp.max_abs:.1e} after {op_label} vs the same cache without it, but should be "
                      f"≤ {cmp.tol:.1e} ({tol.describe(cmp.floor)}): an identity op changes nothing",
                      f"worst at batch={cmp.worst[0]} position={start + cmp.worst[1]}",
                      f"ops: {ops_text}   [failed at {label}]",
                      "likely cause: " + CAUSES[op]],
                     {"failed_at": label, "op": op})
    return out


PADDED_PREFILLS = (12, 13, 14, 15)
"""The prefill lengths of ``check_padded_row_alone`` by default: four consecutive lengths, so that a press keeping a
share of each row's prompt, rounded, keeps another count for the padded row than for the row alone at one of them at
least (KnormPress at 25 % with pads [0, 3]: 3 and 3 tokens dropped at 12, 4 and 3 at 13) — at 12 alone such a press
dropped the same tokens in both and passed at 4e-16."""


@register("batch", needs=("forward",), judges=NON_EXACT, unjudged=NOT_FOR_EXACT, params={
    "pads": Param(list, required=True, items=int, min=0, doc="left pad tokens per row (one per row of batch)"),
    "prefill": Param((int, list), default=list(PADDED_PREFILLS), items=int, min=2,
                     doc="prefill length(s), pads included: each is run on its own (a compressing cache keeps a share "
                         "of the prompt rounded per length, so consecutive lengths meet every rounding)"),
    "decode": Param(int, default=3, min=1, doc="decode steps after the prefill"),
}, ops=IGNORES_OPS)
def check_padded_row_alone(ctx):
    """A left-padded batch (``params.pads``) run through the subject: each row's logits at every real position
    equal those of the same row run alone (batch 1, no pads, a fresh instance of the class), within the exact
    noise floor of the case dtype — at each prefill length of ``params.prefill`` in turn."""
    params = ctx.case.params
    pads = list(params.pads)
    prefills = params.prefill
    prefills = [prefills] if isinstance(prefills, int) else list(prefills)
    if len(pads) != ctx.case.batch or not prefills or max(pads) >= min(prefills):
        raise ValueError(f"case {ctx.case.id}: params.pads needs one count per row, each < prefill")
    ctx.metrics.update(prefills=prefills)
    for P in prefills:
        if _padded_row_run(ctx, pads, P, params.decode):
            return  # a clear refusal of the padded prefill: noted, nothing more to compare


def _padded_row_run(ctx, pads, P: int, steps: int) -> bool:
    """One run of ``check_padded_row_alone`` at prefill length ``P``; True when the subject refused the padded
    prefill clearly (a note, not a failure). Raises ``ConformanceError`` on a difference or a raw error."""
    import torch

    from kvconform.oracle import compare_logits

    B = ctx.case.batch
    gen = case_generator(ctx.case, ctx.model.name)
    program = [_tokens(ctx, gen, P)] + [_tokens(ctx, gen, 1) for _ in range(steps)]
    mask = torch.ones(B, P, dtype=torch.long)
    for b, p in enumerate(pads):
        program[0][b, :p], mask[b, :p] = 0, 0
    ops_text = f"prefill({P}, rows left-padded by {pads}) → decode×{steps}"
    cache = ctx.new_cache()
    batch_logits = []
    seq = torch.zeros(B, 0, dtype=torch.long)
    for i, tokens in enumerate(program):
        start = seq.shape[1]
        full = mask if i == 0 else torch.cat([mask, torch.ones(B, start + 1 - P, dtype=torch.long)], dim=1)
        label = f"prefill({P})" if i == 0 else f"decode {i}"
        try:
            batch_logits.append(forward(ctx.model, cache, tokens, start, "explicit", mask=full, first=start == 0))
        except Exception as exc:  # noqa: BLE001 - the subject's failure, unless a clear refusal of the padding
            if i == 0 and not isinstance(exc, RAW_ERRORS) and any(w in str(exc).lower() for w in PAD_WORDS):
                ctx.metrics.update(note=f"refused a left-padded prefill clearly: {describe_exception(exc)}",
                                   refused=type(exc).__name__)
                return True
            ctx.fail([f"{label} raised {describe_exception(exc)}", f"ops: {ops_text}   [raised at {label}]",
                      "likely cause: the cache does not take a left-padded batch with its attention mask"],
                     {"raised": type(exc).__name__, "failed_at": label})
        if i == 0:
            held_batch = _first_layer_slots(cache)
        seq = torch.cat([seq, tokens], dim=1)
    tol = ctx.tolerance()
    worst = float(ctx.metrics.get("max_abs") or 0.0)
    for b, p in enumerate(pads):
        alone = ctx.subject.build(ctx.model, max_cache_len=ctx.max_cache_len, batch_size=1)
        row = seq[b:b + 1, p:]
        pos = 0
        held_alone = None
        for i, tokens in enumerate(program):
            n = P - p if i == 0 else 1
            label = f"prefill({P})" if i == 0 else f"decode {i}"
            try:
                want = forward(ctx.model, alone, row[:, pos:pos + n], pos, "explicit", first=pos == 0)
                if i == 0:
                    held_alone = _first_layer_slots(alone)
            except Exception as exc:  # noqa: BLE001 - the subject's failure on an unpadded row
                ctx.fail([f"row {b} alone: {label} raised {describe_exception(exc)}",
                          f"ops: {ops_text}   [raised at {label}]",
                          "likely cause: the cache fails on an unpadded batch of one row (see the exception)"],
                         {"raised": type(exc).__name__, "failed_at": label})
            got = batch_logits[i][b:b + 1, -n:]
            pos += n
            cmp = compare_logits(got, want, _floor_target(ctx, row[:, :pos], want, n), tol)
            worst = max(worst, cmp.max_abs)
            ctx.metrics.update(max_abs=worst, tolerance=cmp.tol, noise_floor=cmp.floor)
            if not cmp.passed:
                padded = p > 0
                ctx.fail([f"row {b} ({'left-padded by ' + str(p) if padded else 'unpadded'}) of the batch: "
                          f"max|Δlogit| = {cmp.max_abs:.1e} vs the same row run alone, but should be ≤ {cmp.tol:.1e} "
                          f"({tol.describe(cmp.floor)})",
                          f"worst at position={pos - n + cmp.worst[1]} (of the row without its pads)",
                          f"ops: {ops_text}   [failed at {label}]",
                          "likely cause: " + (
                              f"after prefill({P}) the padded batch holds {held_batch} slots per row and the row "
                              f"alone {held_alone} (of {P - p} real tokens): the cache keeps a share of the padded "
                              f"length, its {p} pads counted as prompt, so the padded row loses other tokens than "
                              f"the same row alone — compute what a row keeps from its own tokens (the attention "
                              f"mask), not from the batch's width"
                              if padded and held_batch is not None and held_alone is not None
                              and held_batch < P and held_batch - p != held_alone else
                              "the left-padded row reads what it holds under the wrong mask columns or keeps its "
                              "pads: after the cache drops or compresses tokens, get_mask_sizes() must map each "
                              "held slot to its own position (the 2-D mask has one column per position seen), and a "
                              "press must not keep pad tokens in place of real ones"
                              if padded else
                              "the row's logits depend on the other rows of the batch (a score, scale or selection "
                              "computed over the whole batch instead of per row)")],
                         {"failed_at": label, "row": b, "pads": p, "prefill": P})
    return False


def _first_layer_slots(cache) -> int | None:
    """The key slots the first attention layer of ``cache`` holds per row (``keys.shape[-2]``), or None where it
    cannot be read (no layers, no key tensor)."""
    import torch

    try:
        for layer in getattr(cache, "layers", None) or ():
            keys = getattr(layer, "keys", None)
            if isinstance(keys, torch.Tensor) and keys.dim() == 4:
                return int(keys.shape[-2])
    except Exception:  # noqa: BLE001 - nothing measured
        return None
    return None
