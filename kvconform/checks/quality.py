"""Family ``quality``: a lossy subject's next-token distributions stay within a budget of the exact oracle.

* ``check_quality_budget``: KL divergence and top-1 agreement against the exact oracle, within the budget the case
  declares (``params = {kl_max = ..., top1_min = ...}``), measured values in the metrics.

The other checks of lossy subjects live in their families' modules; their shared helpers in ``_lossy``.
"""

from __future__ import annotations

from kvconform.checks import OpRule, Param, register
from kvconform.checks._drive import SubjectRaised
from kvconform.checks._lossy import LOSSY_OPS, drive, fail_subject_raised, lossy_only, oracle_slices, twin_spec


# ------------------------------------------------------------------------------------------ quality budget
def _bits(subject) -> int | None:
    qc = getattr(subject.twin, "quant_config", None)
    if qc is None:
        return None
    return 8 if qc.backend == "fp8" else qc.nbits


def _budget(ctx) -> tuple[float, float]:
    """``(kl_max, top1_min)`` from the case params: numbers, or tables keyed by the subject's declared bits
    (``"8"`` for fp8) with an optional ``"default"``."""
    params, bits = ctx.case.params, _bits(ctx.subject)

    def pick(key):
        value = params.get(key)
        if isinstance(value, dict):
            value = value.get(str(bits), value.get("default"))
        return float(value)

    try:
        return pick("kl_max"), pick("top1_min")
    except (TypeError, ValueError):
        raise ValueError(f"case {ctx.case.id}: check_quality_budget needs params kl_max and top1_min (numbers, or "
                         f"tables keyed by bits with a 'default'); none applies to {ctx.subject.name} "
                         f"({bits} bits): {params!r}") from None


def _budget_case(case):
    """Load-time rule of ``check_quality_budget`` (``register(validate=...)``): a budget table is keyed by bit widths
    (``"8"``, ``"4"``...) and has a ``default`` (the subjects' bits are known only at run time)."""
    for key in ("kl_max", "top1_min"):
        value = case.params.get(key)
        if isinstance(value, dict):
            bad = [k for k in value if k != "default" and not k.isdigit()]
            if bad:
                return f"params.{key}", f"table keys are bit widths (\"8\", \"4\") or 'default'; got {bad[0]!r}"
            if "default" not in value:
                return f"params.{key}", (f"a budget table needs a 'default' entry for the bit widths it does not list "
                                         f"(a subject's bits are known only when it runs); got keys {sorted(value)}")
    return None


def _cache_positions(steps):
    """Logits ``[B, N, V]`` of every position fed after the first forward (the ones that read the cache)."""
    import torch

    return torch.cat([s.logits for s in steps[1:]], dim=1)


@register("quality", needs=("forward",), applies=lossy_only, params={
    "kl_max": Param((float, dict), required=True, items=float, min=0,
                    doc="mean KL(oracle ‖ subject) budget in nats: a number, or a table keyed by bits with a default"),
    "top1_min": Param((float, dict), required=True, items=float, min=0, max=1,
                      doc="top-1 agreement budget: a number, or a table keyed by bits with a default"),
}, ops=OpRule(allowed=LOSSY_OPS, min_forwards=2, why="it judges every position after the first forward"),
   validate=_budget_case)
def check_quality_budget(ctx):
    """A lossy subject's next-token distributions stay within the case's budget of the exact oracle: mean
    KL(oracle ‖ subject) ≤ ``kl_max`` nats and top-1 agreement ≥ ``top1_min``, over every position that read the
    cache (all forwards after the first)."""
    import torch

    from kvconform.quant import quality_metrics

    kl_max, top1_min = _budget(ctx)
    try:
        steps = drive(ctx, ctx.new_cache())
    except SubjectRaised as exc:
        fail_subject_raised(ctx, exc, "the cache does not support this sequence of calls (see the exception)")
    if len(steps) < 2:
        raise ValueError(f"case {ctx.case.id}: check_quality_budget needs ops after the first forward")
    exact = oracle_slices(ctx, steps)
    oracle = torch.cat([exact[s.index][0] for s in steps[1:]], dim=1)
    q = quality_metrics(_cache_positions(steps), oracle)
    twin_steps = drive(ctx, ctx.new_cache(twin_spec(ctx)))  # the twin's own quality, same model and dtype
    tq = quality_metrics(_cache_positions(twin_steps), oracle)
    ctx.metrics.update(kl_mean=q["kl_mean"], kl_worst=q["kl_worst"], top1=q["top1"], positions=q["positions"],
                       kl_max=kl_max, top1_min=top1_min, twin_kl_mean=tq["kl_mean"], twin_top1=tq["top1"])
    if q["kl_mean"] <= kl_max and q["top1"] >= top1_min:
        return
    inherent = tq["kl_mean"] > kl_max or tq["top1"] < top1_min
    ctx.fail([
        f"KL(oracle ‖ subject) = {q['kl_mean']:.2e} nats (mean of {q['positions']} positions, worst "
        f"{q['kl_worst']:.2e}), but should be ≤ {kl_max:.2e}",
        f"top-1 agreement = {q['top1']:.3f}, but should be ≥ {top1_min:.3f}",
        f"ops: {ctx.case.ops_label()}",
        f"fake-quant twin on the same case: KL {tq['kl_mean']:.2e}, top-1 {tq['top1']:.3f}",
        "likely cause: " + ("the declared quantization itself loses this much on this model: the budget is "
                            "too tight for it" if inherent else
                            "the subject loses more than its declared quantization does: the fault is in the "
                            "subject (its twin meets the budget)"),
    ])
