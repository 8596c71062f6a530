"""Exact where exactness is owed, even for a cache that is not exact (family ``batch``).

A lossy, evicting or press subject is judged by self-consistency: after an op, a fresh instance of its class fed
the equivalent history. That comparison shares whatever the class does on every run — a fresh instance fed a
left-padded batch has the same padding bug, and after a batch-size change the comparison is widened to the class's
own compression error. Two properties need no such target, because the exact answer is known:

* ``check_identity_ops``: an identity op — ``reorder_cache`` by the identity permutation, ``batch_select_indices``
  of every row, ``batch_repeat_interleave(1)``, ``copy.deepcopy`` (the copy continues) — changes nothing, so the
  next logits must equal those of the same cache left untouched, within the exact noise floor. A cache that decodes
  and re-quantizes its store on every batch op moves them by its quantization error.
* ``check_padded_row_alone``: a left-padded row of a batch must give the logits of the same row run alone (batch 1,
  no pads) in a fresh instance of the class, within the exact noise floor of the case dtype (the built-in case runs
  in float64, where batch shape cannot move a quantization level). A compressing cache that keeps pads, or reads
  held slots under the mask columns of other positions, fails here while a fresh padded instance would agree. A
  clear refusal of the padded prefill (an error naming the padding, not a raw tensor error) passes, with a note.

Both apply to every kind but ``exact`` (the exact families already hold an exact cache to the oracle).
"""

from __future__ import annotations

import copy

from kvconform.checks import ALL_KINDS, IGNORES_OPS, CheckSkipped, Param, register
from kvconform.checks._diagnosis import describe_exception
from kvconform.checks._drive import case_generator, forward, random_tokens
from kvconform.subjects import kind_of

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


def non_exact(subject, model, case, device="cpu"):
    """Applicability rule: every kind but ``exact`` (lossy with or without a twin, evicting, press)."""
    if kind_of(subject).exact:
        return ("applies to lossy, evicting and press subjects: an exact subject is held to the float64 oracle by "
                "every family already")
    return None


def _tokens(ctx, gen, n):
    return random_tokens(gen, ctx.case.batch, n, ctx.model.vocab_size)


def _floor_target(ctx, seq, target, length):
    """``target + (uncached − oracle)`` over the last ``length`` positions of ``seq``: the exact path's noise floor
    around ``target`` (as ``_judge.judge`` does for a fresh instance)."""
    oracle = ctx.oracle.logits(seq)[:, -length:]
    uncached = ctx.oracle.uncached(seq)[:, -length:]
    return target + (uncached - oracle)


@register("batch", needs=("forward",), judges=ALL_KINDS, applies=non_exact, params={
    "identity": Param(list, default=list(IDENTITY_OPS), items=str, doc="identity ops checked, each on its own run: "
                      "reorder, select, repeat, fork"),
    "prefill": Param(int, default=24, min=2, doc="prefill length (an evicting subject: at least tokens_max + 5)"),
    "decode": Param(int, default=3, min=1, doc="decode steps compared after the op"),
}, ops=IGNORES_OPS)
def check_identity_ops(ctx):
    """For each identity op of ``params.identity`` (those the subject declares the capability of): prefill →
    decode 1 → the op → decode N on the subject; every decode step after the op equals a second instance fed the
    same tokens without the op, within the exact noise floor."""
    import torch

    params = ctx.case.params
    unknown = [op for op in params.get("identity", list(IDENTITY_OPS)) if op not in IDENTITY_OPS]
    if unknown:
        raise ValueError(f"case {ctx.case.id}: params.identity {unknown} not among {list(IDENTITY_OPS)}")
    ops = [op for op in params.get("identity", list(IDENTITY_OPS)) if IDENTITY_OPS[op][0] in ctx.subject.capabilities]
    if not ops:
        raise CheckSkipped(f"{ctx.subject.name} declares none of the capabilities of the identity ops "
                           f"({', '.join(c for c, _ in IDENTITY_OPS.values())})")
    kind = kind_of(ctx.subject)
    P = max(int(params.get("prefill", 24)), (kind.tokens_max or 0) + 5)
    steps = int(params.get("decode", 3))
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


@register("batch", needs=("forward",), judges=ALL_KINDS, applies=non_exact, params={
    "pads": Param(list, required=True, items=int, min=0, doc="left pad tokens per row (one per row of batch)"),
    "prefill": Param(int, default=12, min=2, doc="prefill length, pads included"),
    "decode": Param(int, default=3, min=1, doc="decode steps after the prefill"),
}, ops=IGNORES_OPS)
def check_padded_row_alone(ctx):
    """A left-padded batch (``params.pads``) run through the subject: each row's logits at every real position
    equal those of the same row run alone (batch 1, no pads, a fresh instance of the class), within the exact
    noise floor of the case dtype."""
    import torch

    from kvconform.oracle import compare_logits

    params = ctx.case.params
    pads = [int(p) for p in params["pads"]]
    P, steps, B = int(params.get("prefill", 12)), int(params.get("decode", 3)), ctx.case.batch
    if len(pads) != B or max(pads) >= P:
        raise ValueError(f"case {ctx.case.id}: params.pads needs one count per row, each < prefill")
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
                return
            ctx.fail([f"{label} raised {describe_exception(exc)}", f"ops: {ops_text}   [raised at {label}]",
                      "likely cause: the cache does not take a left-padded batch with its attention mask"],
                     {"raised": type(exc).__name__, "failed_at": label})
        seq = torch.cat([seq, tokens], dim=1)
    tol = ctx.tolerance()
    worst = 0.0
    for b, p in enumerate(pads):
        alone = ctx.subject.build(ctx.model, max_cache_len=ctx.max_cache_len, batch_size=1)
        row = seq[b:b + 1, p:]
        pos = 0
        for i, tokens in enumerate(program):
            n = P - p if i == 0 else 1
            label = f"prefill({P})" if i == 0 else f"decode {i}"
            try:
                want = forward(ctx.model, alone, row[:, pos:pos + n], pos, "explicit", first=pos == 0)
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
                              "the left-padded row reads what it holds under the wrong mask columns or keeps its "
                              "pads: after the cache drops or compresses tokens, get_mask_sizes() must map each "
                              "held slot to its own position (the 2-D mask has one column per position seen), and a "
                              "press must not keep pad tokens in place of real ones"
                              if padded else
                              "the row's logits depend on the other rows of the batch (a score, scale or selection "
                              "computed over the whole batch instead of per row)")],
                         {"failed_at": label, "row": b, "pads": p})
