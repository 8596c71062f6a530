"""Judging recorded steps against the oracle: ``PrefixOracle`` (many steps, few oracle forwards), ``compare_step``
(one step, pad positions excluded), ``judge`` → ``Verdict``, ``record_verdict`` (the item's metrics) and
``run_and_judge`` (a fresh cache of a subject through the interpreter, judged).
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass, field

from kvconform.checks._interpreter import run_ops
from kvconform.oracle import compare_logits
from kvconform.subjects import FRESH, TWIN, kind_of


@dataclass
class Verdict:
    """Comparison of all steps: ``first_fail`` (step, Comparison) or None, and the ``worst`` pair overall.

    For a lossy subject judged by self-consistency (``Kind.target`` ``FRESH``): ``target`` names what the steps were
    compared with (``"a fresh <Class> fed the equivalent history"``), ``cause`` is the likely cause of the first
    failure (the op after which the subject diverged, ``_consistency.divergence_cause``) and ``own_error`` maps each
    step index to the fresh instance's max|logit − oracle| there: the class's own compression error on that history,
    for scale."""

    first_fail: tuple | None
    worst: tuple | None
    target: str = ""
    cause: str = ""
    own_error: dict = field(default_factory=dict)
    widened: frozenset = frozenset()
    """Indices of steps whose tolerance was widened to the fresh instance's compression error (``Step.same_shapes``
    False: the replay's forwards differ in shape from the subject's)."""

    @property
    def passed(self) -> bool:
        return self.first_fail is None


class PrefixOracle:
    """The oracle of many steps with few forwards: by causality the logits of a sequence's first ``T`` positions
    are those of any longer sequence that starts with it (same rows, same mask prefix, same encoder input), so each
    query is answered from the longest known sequence extending it (``ctx.oracle`` memoises that one forward).

    Args:
        oracle: the model's ``Oracle``.
        queries: ``(tokens [B, T], mask [B, T] or None, encoder_ids or None)`` the comparisons will ask for.
    """

    def __init__(self, oracle, queries):
        self.oracle = oracle
        self.known = sorted(queries, key=lambda q: -q[0].shape[1])

    @staticmethod
    def _extends(longer, query) -> bool:
        import torch

        (lt, lm, le), (qt, qm, qe) = longer, query
        t = qt.shape[1]
        if lt.shape[0] != qt.shape[0] or lt.shape[1] < t or not torch.equal(lt[:, :t], qt):
            return False
        if (lm is None) != (qm is None) or (qm is not None and not torch.equal(lm[:, :t], qm)):
            return False
        return (le is None and qe is None) or (le is not None and qe is not None and torch.equal(le, qe))

    def _longest(self, query):
        return next((k for k in self.known if self._extends(k, query)), query)

    def logits(self, tokens, attention_mask=None, encoder_ids=None):
        """float64 oracle logits ``[B, T, V]`` of ``tokens`` (sliced from the longest known extension)."""
        lt, lm, le = self._longest((tokens, attention_mask, encoder_ids))
        return self.oracle.logits(lt, attention_mask=lm, encoder_ids=le)[:, :tokens.shape[1]]

    def uncached(self, tokens, attention_mask=None, encoder_ids=None):
        """Case-dtype uncached logits ``[B, T, V]`` (as float64), the noise-floor reference, sliced likewise."""
        lt, lm, le = self._longest((tokens, attention_mask, encoder_ids))
        return self.oracle.uncached(lt, attention_mask=lm, encoder_ids=le)[:, :tokens.shape[1]]


def _encoder_of(ctx, step):
    return step.encoder_ids if step.encoder_ids is not None else ctx.encoder_ids


def prefix_oracle(ctx, steps) -> PrefixOracle:
    """A ``PrefixOracle`` over every sequence the ``steps`` will be compared on (the whole batch, or each row of a
    left-padded step without its pads; see ``compare_step``)."""
    queries = []
    for step in steps:
        if step.mask is None or bool(step.mask.all()):
            queries.append((step.seq, step.mask, _encoder_of(ctx, step)))
        else:
            queries += [(step.seq[b][step.mask[b].bool()].unsqueeze(0), None, None)
                        for b in range(step.seq.shape[0])]
    return PrefixOracle(ctx.oracle, queries)


def compare_step(ctx, step, tol, oracle=None, uncached=None, source=None):
    """Compare one step with the oracle (or the given ``oracle`` / ``uncached`` targets), pad positions excluded.

    A left-padded row is compared with the oracle of the same row *without* its pads (its valid tokens at positions
    0, 1, ...): a padded batch row must equal the prompt run alone. This also keeps the float64 oracle away from
    fully masked pad rows, which some models' eager attention turns into NaN in float64 (gemma2 computes its
    softmax in float32, where float64's mask minimum becomes -inf). ``source``: where oracle logits come from
    (default ``ctx.oracle``; ``judge`` passes a ``PrefixOracle``).
    """
    if oracle is None:
        oracle, uncached = oracle_pair(ctx, step, source)
    observed = step.logits
    sl = slice(step.start, step.start + step.length)
    padded = step.mask is not None and not bool(step.mask.all())
    if padded and not bool(step.mask[:, sl].all()):
        pad = ~step.mask[:, sl].bool()
        observed, oracle, uncached = observed.clone(), oracle.clone(), uncached.clone()
        oracle[pad] = 0.0
        observed[pad] = 0.0
        uncached[pad] = 0.0
    return compare_logits(observed, oracle, uncached, tol)


def oracle_pair(ctx, step, source=None):
    """``(oracle, uncached)`` float64 logits ``[B, length, V]`` of ``step``'s positions (see ``compare_step``: a
    left-padded row from the oracle of the row without its pads, zeros at pad positions)."""
    import torch

    source = source or ctx.oracle
    sl = slice(step.start, step.start + step.length)
    enc = _encoder_of(ctx, step)
    padded = step.mask is not None and not bool(step.mask.all())
    oracle = uncached = None
    if not padded:
        oracle = source.logits(step.seq, attention_mask=step.mask, encoder_ids=enc)[:, sl]
        uncached = source.uncached(step.seq, attention_mask=step.mask, encoder_ids=enc)[:, sl]
    else:
        rows_o, rows_u = [], []
        for b in range(step.seq.shape[0]):
            valid = step.mask[b].bool()
            toks = step.seq[b][valid].unsqueeze(0)
            full_o = torch.zeros(1, step.seq.shape[1], step.logits.shape[-1], dtype=torch.float64)
            full_u = full_o.clone()
            full_o[:, valid] = source.logits(toks)
            full_u[:, valid] = source.uncached(toks)
            rows_o.append(full_o[:, sl])
            rows_u.append(full_u[:, sl])
        oracle, uncached = torch.cat(rows_o), torch.cat(rows_u)
    return oracle, uncached


def judge(ctx, steps, spec=None, driver=None) -> Verdict:
    """Compare every step with the oracle under ``ctx.tolerance()``.

    ``spec`` is the subject that produced ``steps`` (default: ``ctx.subject``). A lossy subject with a fake-quant
    twin (``Kind.target`` ``TWIN``) is compared with its twin run on the same ops instead (``_twin.twin_targets``);
    ``driver`` (``fn(ctx, cache) -> steps``, default ``run_ops``) is how the twin replays them. A lossy subject
    without a twin (``Kind.target`` ``FRESH``) is compared with a fresh instance of its own class fed each step's
    equivalent history (``_consistency.consistency_targets``), with the exact path's noise floor: the target plus
    ``uncached − oracle`` is the floor reference, as for a twin.

    Raises:
        SubjectRaised: the fresh instance of a lossy subject raised on the equivalent history.
    """
    tol = ctx.tolerance()
    first_fail = worst = None
    spec = spec or ctx.subject
    twin = fresh = None
    own, widened = {}, set()
    target = kind_of(spec).target
    if target == TWIN:  # lossy subject: the twin's float64 run is the target
        from kvconform.checks._interpreter import run_ops
        from kvconform.checks._twin import twin_targets

        twin = twin_targets(ctx, spec, steps, driver or run_ops)
    elif target == FRESH:
        from kvconform.checks._consistency import consistency_targets

        fresh = consistency_targets(ctx, spec, steps)
    source = prefix_oracle(ctx, steps) if twin is None else None
    for step in steps:
        if twin is not None:
            cmp = compare_step(ctx, step, tol, *twin[step.index])
        elif fresh is not None:
            oracle, uncached = oracle_pair(ctx, step, source)
            target = fresh[step.index]
            cmp = compare_step(ctx, step, tol, target, target + (uncached - oracle))
            # the class's own compression error on this history (the fresh instance vs the oracle), for scale
            own[step.index] = compare_step(ctx, dataclasses.replace(step, logits=target), tol, oracle,
                                           uncached).max_abs
            if not getattr(step, "same_shapes", True) and own[step.index] > cmp.tol:
                # the replay ran forwards of other shapes (a crop cut a forward, the batch size changed): float
                # rounding differs in the last bits and quantization may turn that into a level; allow up to the
                # class's own compression error on this history, far below a fault that loses or mixes tokens
                cmp = dataclasses.replace(cmp, tol=own[step.index])
                widened.add(step.index)
        else:
            cmp = compare_step(ctx, step, tol, source=source)
        if getattr(step, "nonfinite", None) and cmp.passed:
            # NaN/inf stored in the cache fail the step even where the attention kernel hid them from the logits
            cmp = dataclasses.replace(cmp, max_abs=float("inf"))
        if worst is None or cmp.max_abs > worst[1].max_abs:
            worst = (step, cmp)
        if first_fail is None and not cmp.passed:
            first_fail = (step, cmp)
    if fresh is None:
        return Verdict(first_fail, worst)
    from kvconform.checks._consistency import divergence_cause, fresh_label

    cause = divergence_cause(steps, first_fail[0]) if first_fail else ""
    return Verdict(first_fail, worst, fresh_label(spec), cause, own, frozenset(widened))


def record_verdict(ctx, verdict: Verdict, steps: int, **extra) -> None:
    """Put a verdict's numbers in the item's metrics (JSON report): ``max_abs``, ``tolerance`` and ``noise_floor``
    (logit units) of the first failing step, else of the worst one, ``steps`` judged, plus ``extra``."""
    step, cmp = verdict.first_fail or verdict.worst  # type: ignore[misc]  # a judged run has a worst step
    ctx.metrics.update(max_abs=cmp.max_abs, tolerance=cmp.tol, noise_floor=cmp.floor, steps=steps, **extra)
    if verdict.target:
        ctx.metrics.update(compared_with=verdict.target, distance_to_oracle=verdict.own_error.get(step.index),
                           max_distance_to_oracle=max(verdict.own_error.values(), default=None))



def run_and_judge(ctx, spec=None, position_mode=None, driver=None) -> Verdict:
    """Build a fresh cache of ``spec`` (default: the subject), run the case (or ``driver(ctx, cache)``), judge it."""

    spec = spec or ctx.subject
    if driver is None:
        cache = ctx.new_cache(spec)
        return judge(ctx, run_ops(ctx, cache, position_mode), spec)
    sctx = ctx.replace(subject=spec, metrics={})
    return judge(sctx, driver(sctx, sctx.new_cache()), spec, driver)
