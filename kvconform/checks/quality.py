"""Lossy subjects (quantized caches): quality budget, generate and beam reorder against the fake-quant twin, crop.

A lossy subject is a ``CacheSpec`` with a ``twin`` (``kvconform.quant``). The exact families compare it with its
twin (``_engine.judge``); the checks here cover what only lossy subjects need:

* ``check_quality_budget`` (quality): KL divergence and top-1 agreement against the exact oracle, within the
  budget the case declares (``params = {kl_max = ..., top1_min = ...}``), measured values in the metrics.
* ``check_generate_vs_twin`` (generate): greedy ``generate(cache=subject)`` equals ``generate(cache=twin)``.
* ``check_reorder_after_flush`` (batch): beam ``reorder_cache`` with distinct rows around a residual flush, then
  decode, equals the twin (transformers 5.5–5.18 left the quantized part in the old order).
* ``check_deepcopy_refused`` (prefix): a subject that does not declare ``deepcopy`` copies into an independent
  cache or refuses clearly.
* ``check_crop_refused`` (contract): a subject that does not declare ``crop`` (``is_croppable`` False) refuses
  ``crop`` with a clear error instead of an unrelated exception or a silent, wrong crop.

``drive`` is the op driver of these checks: ``_engine.run_ops``' manual loop plus ``reorder`` (rows reversed, so
every row moves) and ``crop``.
"""

from __future__ import annotations

from kvconform import compat
from kvconform.checks import register
from kvconform.checks._engine import (SubjectRaised, Step, case_generator, describe_raise, encoder_ids_for,
                                      forward, random_tokens, seq_length)
from kvconform.oracle import compare_logits

CLEAR_ERRORS = (ValueError, NotImplementedError, RuntimeError, TypeError)
"""Exception types a refused operation may raise (a bare IndexError/AttributeError is an accident, not a refusal)."""


def lossy_only(subject, model, case, device="cpu"):
    """``kvconform_applies`` rule: only subjects with a fake-quant twin."""
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


def _twin_line(ctx) -> str:
    twin = ctx.subject.twin
    qc = getattr(twin, "quant_config", None)
    what = qc.describe(ctx.model.config) if qc is not None else "the declared quantization"
    return f"twin: {getattr(twin, '__name__', 'twin')} ({what}), exact bookkeeping"


def _judge_twin(ctx, steps):
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


def _fail_twin(ctx, failed, cause):
    step, cmp = failed
    b, offset = cmp.worst
    observed = "NaN/inf" if cmp.max_abs == float("inf") else f"{cmp.max_abs:.1e}"
    ctx.fail([
        f"max|Δlogit| = {observed} vs its fake-quant twin, but should be ≤ {cmp.tol:.1e} "
        f"({ctx.tolerance().describe(cmp.floor)})",
        f"worst at batch={b} step={step.index} position={step.start + offset}",
        f"ops: {ctx.case.ops_label()}   [failed at {step.label}]",
        _twin_line(ctx),
        "likely cause: " + cause,
    ], {"max_abs": cmp.max_abs, "tolerance": cmp.tol, "noise_floor": cmp.floor, "failed_at": step.label,
        "compared_with": "fake-quant twin"})


def _raised(ctx, exc: SubjectRaised, cause: str):
    ctx.fail([f"the subject raised {describe_raise(exc)}",
              f"ops: {ctx.case.ops_label()}   [raised at {exc.where}]",
              "likely cause: " + cause], {"raised": type(exc.cause).__name__, "failed_at": exc.where})


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


def _cache_positions(steps):
    """Logits ``[B, N, V]`` of every position fed after the first forward (the ones that read the cache)."""
    import torch

    return torch.cat([s.logits for s in steps[1:]], dim=1)


@register("quality", needs=("forward",))
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
        _raised(ctx, exc, "the cache does not support this sequence of calls (see the exception)")
    if len(steps) < 2:
        raise ValueError(f"case {ctx.case.id}: check_quality_budget needs ops after the first forward")
    exact = oracle_slices(ctx, steps)
    oracle = torch.cat([exact[s.index][0] for s in steps[1:]], dim=1)
    q = quality_metrics(_cache_positions(steps), oracle)
    twin_steps = drive(ctx, ctx.new_cache(_twin_spec(ctx)))  # the twin's own quality, same model and dtype
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


check_quality_budget.kvconform_applies = lossy_only


# ------------------------------------------------------------------------------------------ generate vs twin
def _generate(ctx, cache):
    import torch

    model, case = ctx.model, ctx.case
    gen = case_generator(case, model.name)
    prompt = random_tokens(gen, case.batch, case.prompt, model.vocab_size)
    device = next(model.model.parameters()).device
    with torch.no_grad():
        out = model.model.generate(
            prompt.to(device), attention_mask=torch.ones_like(prompt).to(device),
            max_new_tokens=case.max_new_tokens, min_new_tokens=case.max_new_tokens, do_sample=False,
            return_dict_in_generate=True, output_logits=True, **compat.generate_cache_kwargs(cache, model.model))
    logits = torch.stack([x.detach().to("cpu", torch.float64) for x in out.logits], dim=1)  # [B, N, V]
    return prompt, out.sequences.cpu(), logits


@register("generate", needs=("generate",))
def check_generate_vs_twin(ctx):
    """Greedy ``generate(cache=subject)`` produces the tokens of ``generate(cache=twin)`` and, at every step,
    logits within the tolerance of the twin's (same model, same dtype); noise floor: the oracle's on the generated
    sequence."""
    from kvconform.quant import quality_metrics

    case = ctx.case
    try:
        prompt, seq, logits = _generate(ctx, ctx.new_cache())
    except Exception as exc:  # noqa: BLE001
        _raised(ctx, SubjectRaised("generate", exc), "the cache lacks something generate() calls")
    twin_spec = _twin_spec(ctx)
    _, twin_seq, twin_logits = _generate(ctx, ctx.new_cache(twin_spec))
    first = prompt.shape[1] - 1
    sl = slice(first, first + case.max_new_tokens)
    oracle = ctx.oracle.logits(seq[:, :-1])[:, sl]
    uncached = ctx.oracle.uncached(seq[:, :-1])[:, sl]
    floor = float((uncached - oracle).abs().max())
    same = seq.shape == twin_seq.shape and bool((seq == twin_seq).all())
    cmp = compare_logits(logits, twin_logits, twin_logits + (uncached - oracle), ctx.tolerance()) if same else None
    q = quality_metrics(logits, oracle)
    ctx.metrics.update(tokens_equal=same, noise_floor=floor, kl_mean=q["kl_mean"], top1=q["top1"],
                       new_tokens=case.max_new_tokens, compared_with="fake-quant twin")
    if cmp is not None:
        ctx.metrics.update(max_abs=cmp.max_abs, tolerance=cmp.tol)
        if cmp.passed:
            return
    lines = []
    if cmp is not None:
        b, s = cmp.worst
        lines += [f"max|Δlogit| = {cmp.max_abs:.1e} vs its fake-quant twin, but should be ≤ {cmp.tol:.1e} "
                  f"({ctx.tolerance().describe(cmp.floor)})", f"worst at batch={b} step={s} position={first + s}"]
    else:
        n = min(seq.shape[1], twin_seq.shape[1])
        diff = (seq[:, :n] != twin_seq[:, :n]).nonzero()
        b, i = diff[0].tolist() if len(diff) else (0, n)
        lines.append(f"generated tokens differ from generate(cache=twin) at batch={b} index={i}: "
                     f"{seq[b, i].item() if i < seq.shape[1] else '-'} vs "
                     f"{twin_seq[b, i].item() if i < twin_seq.shape[1] else '-'}")
    lines += [f"ops: generate(prompt {prompt.shape[1]}, greedy, max_new_tokens={case.max_new_tokens})",
              _twin_line(ctx),
              "likely cause: the cache stores or returns something else between generate() steps than its "
              "declared quantization would (reorder, flush or residual bookkeeping)"]
    ctx.fail(lines)


check_generate_vs_twin.kvconform_applies = lossy_only


def _twin_spec(ctx):
    import dataclasses

    return dataclasses.replace(ctx.subject, name=f"{ctx.subject.name}.twin", factory=ctx.subject.twin, twin=None)


# ------------------------------------------------------------------------------------------ reorder after a flush
@register("batch", needs=("reorder",))
def check_reorder_after_flush(ctx):
    """Beam ``reorder_cache`` (rows reversed) around a residual flush, then decode: every step equals the twin,
    which reorders its quantized part and its residual together."""
    if not any(op.name == "reorder" for op in ctx.case.ops) or ctx.case.batch < 2:
        raise ValueError(f"case {ctx.case.id}: check_reorder_after_flush needs a 'reorder' op and batch ≥ 2")
    try:
        steps = drive(ctx, ctx.new_cache())
    except SubjectRaised as exc:
        _raised(ctx, exc, "reorder_cache() does not handle this state (e.g. an emptied residual after a flush)"
                + _reorder_history())
    failed, worst = _judge_twin(ctx, steps)
    _, cmp = failed or worst
    ctx.metrics.update(max_abs=cmp.max_abs, tolerance=cmp.tol, noise_floor=cmp.floor, steps=len(steps),
                       compared_with="fake-quant twin")
    if failed:
        _fail_twin(ctx, failed, "reorder_cache() moved part of the cache but not all of it: the quantized part "
                   "(or the residual) kept the old row order" + _reorder_history())


def _reorder_history() -> str:
    if compat.quantized_reorder_fixed():
        return ""
    return (f" — transformers {compat.transformers_version()} has this fault: QuantizedLayer.reorder_cache "
            f"reorders only the exact residual (fixed in 5.19)")


check_reorder_after_flush.kvconform_applies = lossy_only


# ------------------------------------------------------------------------------------------ crop refusal
def _not_croppable(subject, model, case, device="cpu"):
    if "crop" in subject.capabilities:
        return f"{subject.name} declares crop: the crop family checks it"
    return None


@register("contract", needs=("forward",))
def check_crop_refused(ctx):
    """A subject that does not declare ``crop`` refuses ``crop(-n)`` with a clear error (ValueError,
    NotImplementedError, RuntimeError or TypeError), whatever state it is in (e.g. right after a residual flush);
    an unrelated exception or a crop that is silently accepted fails."""
    ops = ctx.case.ops
    crop_at = next((i for i, op in enumerate(ops) if op.name == "crop"), None)
    if crop_at is None:
        raise ValueError(f"case {ctx.case.id}: check_crop_refused needs a 'crop N' op")
    cache = ctx.new_cache()
    try:
        steps = drive(ctx, cache, stop_before=crop_at)
    except SubjectRaised as exc:
        _raised(ctx, exc, "the cache does not support the ops before the crop (see the exception)")
    before = seq_length(cache)
    n = ops[crop_at].n
    croppable = getattr(cache, "is_croppable", None)
    ctx.metrics.update(is_croppable=croppable, length_before=before, steps=len(steps))
    try:
        compat.crop(cache, n, steps[-1].start + steps[-1].length if steps else 0)
    except CLEAR_ERRORS as exc:
        ctx.metrics.update(raised=type(exc).__name__)
        return
    except Exception as exc:  # noqa: BLE001 - an accident, not a refusal
        err = SubjectRaised(ops[crop_at].label, exc)
        ctx.metrics.update(raised=type(exc).__name__)
        ctx.fail([f"crop(-{n}) raised {describe_raise(err)}, but should refuse with a clear error "
                  f"(ValueError / NotImplementedError naming crop)",
                  f"ops: {ctx.case.ops_label()}   [raised at {ops[crop_at].label}]",
                  f"is_croppable = {croppable}",
                  "likely cause: crop() is inherited from a layer class that does not know this layer's storage "
                  "(e.g. DynamicLayer.crop slicing an emptied residual) instead of being refused"])
    after = seq_length(cache)
    ctx.metrics.update(length_after=after)
    ctx.fail([f"crop(-{n}) was accepted (get_seq_length() {before} → {after}), but should raise: the subject does "
              f"not declare crop and is_croppable = {croppable}",
              f"ops: {ctx.case.ops_label()}   [at {ops[crop_at].label}]",
              "likely cause: crop() is inherited from a layer class that only sees part of the storage (e.g. "
              "the exact residual of a quantized layer), so it cannot crop correctly and should refuse"])


check_crop_refused.kvconform_applies = _not_croppable


# ------------------------------------------------------------------------------------------ undeclared deepcopy
def _undeclared_deepcopy(subject, model, case, device="cpu"):
    if "deepcopy" in subject.capabilities:
        return f"{subject.name} declares deepcopy: the prefix family checks prefix reuse"
    return None


@register("prefix", needs=("forward",))
def check_deepcopy_refused(ctx):
    """A subject that does not declare ``deepcopy`` either copies into an independent cache (extending the copy
    leaves the original's length alone) or refuses ``copy.deepcopy`` with a clear error (ValueError,
    NotImplementedError, RuntimeError or TypeError); an unrelated exception or an aliased copy fails."""
    import copy

    import torch

    cache = ctx.new_cache()
    try:
        steps = drive(ctx, cache)
    except SubjectRaised as exc:
        _raised(ctx, exc, "the cache does not support the ops before the copy (see the exception)")
    before = seq_length(cache)
    try:
        clone = copy.deepcopy(cache)
    except CLEAR_ERRORS as exc:
        ctx.metrics.update(raised=type(exc).__name__, copied=False)
        return
    except Exception as exc:  # noqa: BLE001 - an accident, not a refusal
        ctx.metrics.update(raised=type(exc).__name__)
        err = SubjectRaised("deepcopy", exc)
        ctx.fail([f"copy.deepcopy(cache) raised {describe_raise(err)}, but should copy or refuse with a clear error",
                  f"ops: {ctx.case.ops_label()} → deepcopy",
                  "likely cause: a tensor subclass or handle in the cache cannot be copied, and nothing says so"])
    last = steps[-1]
    new = torch.full((ctx.case.batch, 1), 5, dtype=torch.long)
    try:
        forward(ctx.model, clone, new, last.start + last.length, ctx.case.position_ids,
                getattr(ctx, "encoder_ids", None))
    except Exception as exc:  # noqa: BLE001
        err = SubjectRaised("decode on the copy", exc)
        ctx.fail([f"copy.deepcopy(cache) succeeded, but decoding on the copy raised {describe_raise(err)}",
                  f"ops: {ctx.case.ops_label()} → deepcopy → decode on the copy",
                  "likely cause: the copy misses state the original has (declare deepcopy only once it works)"])
    after = seq_length(cache)
    ctx.metrics.update(copied=True, length_before=before, length_after=after, copy_length=seq_length(clone))
    if after != before:
        ctx.fail([f"extending the deepcopy changed the original: get_seq_length() {before} → {after}",
                  f"ops: {ctx.case.ops_label()} → deepcopy → decode on the copy",
                  "likely cause: __deepcopy__ shares tensors or counters between the copy and the original"])


check_deepcopy_refused.kvconform_applies = _undeclared_deepcopy
