"""Family ``generate``: ``model.generate(cache=subject)`` behaves like ``generate(use_cache=False)``.

Greedy decoding must produce the same tokens, and the logits ``generate`` saw at every step must match the float64
oracle of the generated sequence within the tolerance (so a near-tie flip is told apart from a real fault).
For a lossy subject (``check_generate_vs_twin``) the reference is ``generate(cache=twin)``, its fake-quant twin.
"""

from __future__ import annotations

from kvconform import compat
from kvconform.checks import EXACT, IGNORES_OPS, register
from kvconform.checks._drive import SubjectRaised, generate, generate_prompt
from kvconform.checks._diagnosis import describe_raise, token_mismatch
from kvconform.checks._lossy import fail_subject_raised, lossy_only, twin_line, twin_spec
from kvconform.oracle import compare_logits


def _generate(ctx, cache_kwargs, prompt_len=None):
    """Greedy ``generate`` (``_drive.generate``) of ``case.max_new_tokens`` after a seeded prompt of ``prompt_len``
    tokens (default: ``case.encoder_len`` for encoder-decoder models, else ``case.prompt``); returns ``(prompt
    [B, S], sequences [B, L], step logits [B, N, V] float64)``."""
    model, case = ctx.model, ctx.case
    prompt = generate_prompt(model, case, prompt_len)
    seq, logits, _ = generate(model, prompt, case.max_new_tokens, cache_kwargs)  # logits [B, N, V]
    return prompt, seq, logits


@register("generate", needs=("generate",), ops=IGNORES_OPS, judges=(EXACT,))
def check_generate_greedy(ctx):
    """Greedy ``generate(cache=subject)`` equals ``generate(use_cache=False)`` token for token; its step logits
    equal the oracle's."""
    model, case = ctx.model, ctx.case
    try:
        prompt, seq, logits = _generate(ctx, compat.generate_cache_kwargs(ctx.new_cache(), ctx.model.model))
    except Exception as exc:  # noqa: BLE001
        err = SubjectRaised("generate", exc)
        ctx.fail([f"generate(cache=subject) raised {describe_raise(err)}",
                  f"ops: generate(prompt {case.prompt}, max_new_tokens={case.max_new_tokens})",
                  "likely cause: the cache lacks something generate() calls (see the exception)"],
                 {"raised": type(exc).__name__})
    _, ref_seq, _ = _generate(ctx, {"use_cache": False})
    n = case.max_new_tokens
    if model.is_encoder_decoder:
        enc, dec, first = prompt, seq[:, :-1], 0
    else:
        enc, dec, first = None, seq[:, :-1], prompt.shape[1] - 1
    sl = slice(first, first + n)
    oracle = ctx.oracle.logits(dec, encoder_ids=enc)[:, sl]
    uncached = ctx.oracle.uncached(dec, encoder_ids=enc)[:, sl]
    cmp = compare_logits(logits, oracle, uncached, ctx.tolerance())
    ctx.metrics.update(max_abs=cmp.max_abs, tolerance=cmp.tol, noise_floor=cmp.floor, new_tokens=n)
    same = bool((seq == ref_seq).all()) if seq.shape == ref_seq.shape else False
    if cmp.passed and same:
        return
    lines = []
    if not cmp.passed:
        b, s = cmp.worst
        lines += [f"max|Δlogit| = {cmp.max_abs:.1e}, but should be ≤ {cmp.tol:.1e} "
                  f"({ctx.tolerance().describe(cmp.floor)})",
                  f"worst at batch={b} step={s} position={first + s}"]
    if not same:
        lines.append(token_mismatch(seq, ref_seq, "generated tokens", "generate(use_cache=False)"))
    lines.append(f"ops: generate(prompt {prompt.shape[1]}, greedy, max_new_tokens={n})")
    lines.append("likely cause: " + ("the cache corrupts what generate() feeds it between steps"
                                     if not cmp.passed else
                                     "a near-tie flipped the greedy token although the logits are within tolerance"))
    ctx.fail(lines, {"tokens_equal": same})


# ------------------------------------------------------------------------------------------ generate vs twin
def _generate_with(ctx, cache):
    """``_generate`` with ``cache`` and a ``case.prompt``-token prompt."""
    return _generate(ctx, compat.generate_cache_kwargs(cache, ctx.model.model), ctx.case.prompt)


@register("generate", needs=("generate",), applies=lossy_only, ops=IGNORES_OPS)
def check_generate_vs_twin(ctx):
    """Greedy ``generate(cache=subject)`` produces the tokens of ``generate(cache=twin)`` and, at every step,
    logits within the tolerance of the twin's (same model, same dtype); noise floor: the oracle's on the generated
    sequence."""
    from kvconform.quant import quality_metrics

    case = ctx.case
    try:
        prompt, seq, logits = _generate_with(ctx, ctx.new_cache())
    except Exception as exc:  # noqa: BLE001
        fail_subject_raised(ctx, SubjectRaised("generate", exc), "the cache lacks something generate() calls")
    _, twin_seq, twin_logits = _generate_with(ctx, ctx.new_cache(twin_spec(ctx)))
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
              twin_line(ctx),
              "likely cause: the cache stores or returns something else between generate() steps than its "
              "declared quantization would (reorder, flush or residual bookkeeping)"]
    ctx.fail(lines)
