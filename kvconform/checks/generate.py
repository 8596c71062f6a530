"""Family ``generate``: ``model.generate(cache=subject)`` behaves like ``generate(use_cache=False)``.

Greedy decoding must produce the same tokens, and the logits ``generate`` saw at every step must match the float64
oracle of the generated sequence within the tolerance (so a near-tie flip is told apart from a real fault).
For a lossy subject (``check_generate_vs_twin``) the reference is ``generate(cache=twin)``, its fake-quant twin;
for a lossy subject without a twin (``check_generate_self_consistent``: ``kind="lossy"`` or ``"press"``) it is
kvconform's own greedy loop on a fresh instance of the subject's class, fed the tokens ``generate`` produced.
"""

from __future__ import annotations

from kvconform import compat
from kvconform.checks import EXACT, FRESH_KINDS, IGNORES_OPS, LOSSY_FRESH, LOSSY_TWIN, Param, register
from kvconform.checks._drive import SubjectRaised, case_generator, generate, generate_prompt, seq_length
from kvconform.checks._diagnosis import describe_raise, token_mismatch
from kvconform.checks._lossy import TWIN_ONLY, fail_subject_raised, twin_line, twin_spec
from kvconform.oracle import compare_logits


def _generate(ctx, cache_kwargs, prompt_len=None):
    """Greedy ``generate`` (``_drive.generate``) of ``case.max_new_tokens`` after a seeded prompt of ``prompt_len``
    tokens (default: ``case.encoder_len`` for encoder-decoder models, else ``case.prompt``); returns ``(prompt
    [B, S], sequences [B, L], step logits [B, N, V] float64)``."""
    model, case = ctx.model, ctx.case
    prompt = generate_prompt(model, case, prompt_len)
    seq, logits, _ = generate(model, prompt, case.max_new_tokens, cache_kwargs)  # logits [B, N, V]
    return prompt, seq, logits


UNJUDGED = {
    LOSSY_TWIN: "{subject} is lossy: its greedy generate() is compared with its fake-quant twin "
                "(check_generate_vs_twin), not token for token with the exact model",
    LOSSY_FRESH: "{subject} is lossy: its greedy generate() is not compared token for token with the exact "
                 "model (a near-tie would flip a greedy token) but with kvconform's own greedy loop on a fresh "
                 "instance fed the same tokens (check_generate_self_consistent); its cache operations are "
                 "judged by self-consistency (logits, crop, prefix, batch, lifecycle, fuzz) and its outputs by "
                 "the quality family (check_quality_budget against the float64 oracle)",
}
"""Why a check of this family skips a lossy subject it does not judge: what judges its generate() instead."""


def raised_cause(exc: BaseException, cache, caller: str = "generate()") -> str:
    """The likely cause of ``exc``, raised while ``caller`` ran with ``cache``, from where it was raised (measured
    on its traceback): inside a method of the cache or of one of its layers (its ``self`` is one of them: "the
    cache's own update() raised ..."), or elsewhere (the caller reached for something the cache lacks or gave it a
    state it cannot take)."""
    owners = {id(cache)} | {id(layer) for layer in (getattr(cache, "layers", None) or ())}
    tb, inside = exc.__traceback__, None
    while tb is not None:
        if id(tb.tb_frame.f_locals.get("self")) in owners:
            inside = tb  # the innermost frame of the cache's own code
        tb = tb.tb_next
    if inside is not None:
        code = inside.tb_frame.f_code
        where = f"{code.co_name}() at {code.co_filename.rsplit('/', 1)[-1]}:{inside.tb_lineno}"
        return (f"the cache's own {where} raised on what {caller} passed it (see the exception): its code fails "
                f"on this call, not a method {caller} looks for and the cache lacks")
    return f"the cache lacks something {caller} calls (see the exception)"


@register("generate", cost=1.5, needs=("generate",), ops=IGNORES_OPS, judges=(EXACT,), unjudged=UNJUDGED)
def check_generate_greedy(ctx):
    """Greedy ``generate(cache=subject)`` equals ``generate(use_cache=False)`` token for token; its step logits
    equal the oracle's."""
    model, case = ctx.model, ctx.case
    cache = ctx.new_cache()
    try:
        prompt, seq, logits = _generate(ctx, compat.generate_cache_kwargs(cache, ctx.model.model))
    except Exception as exc:  # noqa: BLE001
        err = SubjectRaised("generate", exc)
        ctx.fail([f"generate(cache=subject) raised {describe_raise(err)}",
                  f"ops: generate(prompt {case.prompt}, max_new_tokens={case.max_new_tokens})",
                  "likely cause: " + raised_cause(exc, cache)],
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


@register("generate", cost=1.5, needs=("generate",), facts=TWIN_ONLY, ops=IGNORES_OPS, unjudged=UNJUDGED)
def check_generate_vs_twin(ctx):
    """Greedy ``generate(cache=subject)`` produces the tokens of ``generate(cache=twin)`` and, at every step,
    logits within the tolerance of the twin's (same model, same dtype); noise floor: the oracle's on the generated
    sequence."""
    from kvconform.quant import quality_metrics

    case = ctx.case
    cache = ctx.new_cache()
    try:
        prompt, seq, logits = _generate_with(ctx, cache)
    except Exception as exc:  # noqa: BLE001
        fail_subject_raised(ctx, SubjectRaised("generate", exc), raised_cause(exc, cache))
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


# ------------------------------------------------------------------------------------------ generate vs own loop
SELF_CONSISTENT_ONLY = ("applies to lossy subjects without a fake-quant twin (kind='lossy' or 'press'); exact subjects "
                        "are judged by check_generate_greedy, subjects with a twin by check_generate_vs_twin")
"""The skip reason of ``check_generate_self_consistent`` (``judges=FRESH_KINDS``) on the other kinds."""


def replay_greedy(ctx, turns):
    """kvconform's own greedy loop on a fresh instance of the subject, fed the tokens ``generate`` produced, turn by
    turn: ``turns`` is ``[(new tokens [B, k], generated [B, n])]`` — each turn feeds its new tokens as one forward
    (the prompt as a prefill; later turns a chunk of the previous turn's last generated token and the user's
    tokens, as ``generate`` continuing a warm cache does), then each generated token but the last as a decode step,
    with explicit positions (``_interpreter.Runner``: every forward through ``Runner.feed``). Returns the logits
    ``[B, Σn, V]`` float64 of the positions that chose the generated tokens.

    Raises:
        SubjectRaised: the fresh instance raised.
    """
    import torch

    from kvconform.checks._interpreter import Runner

    runner = Runner(ctx, ctx.new_cache(), position_mode="explicit", padding=[])
    out = []
    for t, (new, generated) in enumerate(turns):
        k, n = new.shape[1], generated.shape[1]
        label = f"prefill({k})" if t == 0 else f"chunk({k}) of turn {t + 1}"
        out.append(runner.feed(k, f"{label} (own loop)", tokens=new).logits[:, -1:])
        for i in range(1, n):
            out.append(runner.feed(1, f"decode {i} of turn {t + 1} (own loop)",
                                   tokens=generated[:, i - 1:i]).logits[:, -1:])
    return torch.cat(out, dim=1)


@register("generate", cost=1.5, needs=("generate",), judges=FRESH_KINDS, ops=IGNORES_OPS,
          unjudged=SELF_CONSISTENT_ONLY,
          params={"user": Param(int, default=4, min=1, doc="tokens of the second turn's user message")})
def check_generate_self_consistent(ctx):
    """Greedy ``generate(cache=subject)`` of a lossy subject without a twin, over two turns (a prompt, then the same
    cache continued with the first turn's output and ``params.user`` more tokens, as a chat does), gives at every
    step the logits of kvconform's own greedy loop on a fresh instance of its class fed the same tokens
    (``replay_greedy``: explicit positions), within the tolerance (noise floor: the oracle's on the generated
    sequence). What ``generate`` reads of the cache besides the forwards — ``get_seq_length()``, from which a
    continued turn takes the tokens still to feed, the mask from ``get_mask_sizes()`` — must agree with what the
    cache holds."""
    import torch

    from kvconform.checks._drive import random_tokens
    from kvconform.quant import quality_metrics

    case = ctx.case
    n, user = case.max_new_tokens, case.params.user
    cache = ctx.new_cache()
    kwargs = compat.generate_cache_kwargs(cache, ctx.model.model)
    try:
        prompt, seq1, logits1 = _generate_with(ctx, cache)
        gen = case_generator(case, ctx.model.name, salt="user")
        message = random_tokens(gen, case.batch, user, ctx.model.vocab_size)
        seq2, logits2, _ = generate(ctx.model, torch.cat([seq1, message], dim=1), n, kwargs)
    except Exception as exc:  # noqa: BLE001
        fail_subject_raised(ctx, SubjectRaised("generate", exc), raised_cause(exc, cache))
    P, L1 = prompt.shape[1], seq1.shape[1]
    turns = [(prompt, seq1[:, P:]), (torch.cat([seq1[:, -1:], message], dim=1), seq2[:, L1 + user:])]
    try:
        want = replay_greedy(ctx, turns)
    except SubjectRaised as exc:
        fail_subject_raised(ctx, exc, "the cache does not take the forwards of a greedy loop (see the exception)")
    logits = torch.cat([logits1, logits2], dim=1)
    positions = [P - 1 + i for i in range(n)] + [L1 + user - 1 + i for i in range(n)]
    oracle = ctx.oracle.logits(seq2[:, :-1])[:, positions]
    uncached = ctx.oracle.uncached(seq2[:, :-1])[:, positions]
    cmp = compare_logits(logits, want, want + (uncached - oracle), ctx.tolerance())
    q = quality_metrics(logits, oracle)
    ctx.metrics.update(max_abs=cmp.max_abs, tolerance=cmp.tol, noise_floor=cmp.floor, kl_mean=q["kl_mean"],
                       top1=q["top1"], new_tokens=2 * n, compared_with="own greedy loop on a fresh instance")
    if cmp.passed:
        return
    b, s = cmp.worst
    turn, step = (1, s) if s < n else (2, s - n)
    own_error = float((want - oracle).abs().max())
    reported, held = seq_length(cache), _held(cache)
    ctx.fail([
        f"max|Δlogit| = {cmp.max_abs:.1e} vs kvconform's greedy loop on a fresh {ctx.subject.name} fed the same "
        f"tokens, but should be ≤ {cmp.tol:.1e} ({ctx.tolerance().describe(cmp.floor)})",
        f"worst at batch={b} turn {turn} step={step} position={positions[s]}; the loop's own distance to the oracle "
        f"(its compression error, for scale): {own_error:.1e}",
        f"ops: generate(prompt {P}, greedy, max_new_tokens={n}) → generate(+{user} user tokens, max_new_tokens={n}) "
        f"on the same cache, vs prefill({P}) → decode×{n - 1} → chunk({user + 1}) → decode×{n - 1} with explicit "
        f"positions   [failed at turn {turn} step {step}]",
        f"after both turns: get_seq_length() = {reported}, keys held per row = {held if held is not None else '?'}, "
        f"tokens generate() should have fed = {seq2.shape[1] - 1}",
        "likely cause: " + _self_consistent_cause(turn, step, reported, held, seq2.shape[1] - 1),
    ], {"failed_at": f"turn {turn} step {step}", "reported": reported})


def _held(cache) -> int | None:
    """Tokens per row the first layer of ``cache`` holds (its ``keys`` ``[B, H, T, D]``), or None where unreadable."""
    import torch

    try:
        layers = getattr(cache, "layers", None)
        first = layers[0] if isinstance(layers, (list, tuple)) and layers else None
        keys = getattr(first, "keys", None)
        return int(keys.shape[-2]) if isinstance(keys, torch.Tensor) and keys.dim() == 4 else None
    except Exception:  # noqa: BLE001 - only a reading for the message
        return None


def _self_consistent_cause(turn: int, step: int, reported, held, fed: int) -> str:
    if held is not None and held != fed and turn == 2:
        return (f"the cache holds {held} tokens where generate() should have fed {fed}: continuing a warm cache, "
                f"generate() feeds the tokens past get_seq_length() — which reports {reported} for the {held} "
                f"tokens held now — so it fed {abs(held - fed)} token(s) {'twice' if held > fed else 'too few'}; "
                f"get_seq_length() must count every token the cache was fed")
    if reported is not None and reported != fed:
        return (f"get_seq_length() = {reported} where the cache was fed {fed} tokens: generate() takes the tokens "
                f"still to feed from it when it continues a warm cache (and the mask its length); count every "
                f"token fed")
    if turn == 1 and step == 0:
        return ("the first step already differs: generate() builds its first forward from the cache's "
                "get_seq_length() / get_mask_sizes() before any token")
    if turn == 2 and step == 0:
        return ("the second turn's first forward differs: continuing a warm cache, generate() feeds the tokens past "
                "get_seq_length(), which must count every token the cache has seen (not the tokens it still holds "
                "after compressing or evicting), and builds the mask from get_mask_sizes()")
    return ("generate() reads the cache between steps and gets another answer than the forwards: get_seq_length() "
            "(from which a continued turn takes the tokens still to feed: it must count the tokens seen, not those "
            "still held) or get_mask_sizes() (its mask) do not describe the cache, or the cache changes when "
            "generate() calls it between forwards")
