"""Family ``prefix``: reusing a cache — forked with ``copy.deepcopy``, handed to ``generate`` already prefilled, or
carried from one ``generate`` turn to the next — behaves like computing everything from scratch.

* ``check_prefix_fork``: prefill a shared prefix, ``copy.deepcopy`` it, continue each copy with a different suffix
  (the case's ops after ``fork``: single steps or a chunk); every step equals the oracle, the original's tensors are
  bit-for-bit unchanged, and the original then continues correctly with a suffix of its own.
* ``check_prefix_generate``: prefill the prefix with a forward, then ``generate`` with the full prompt
  (``params.mode = "full_prompt"``: generate skips what the cache holds) or with the suffix only and the full
  attention mask (``"suffix_only"``); tokens equal ``generate(use_cache=False)`` on the full prompt and the step
  logits equal the oracle.
* ``check_multi_turn``: the cache returned by one ``generate`` is reused for a longer next turn (the previous
  output plus ``params.user`` new tokens); the second turn equals a fresh uncached run.
* ``check_deepcopy_refused``: a subject that does not declare ``deepcopy`` copies into an independent cache or
  refuses ``copy.deepcopy`` clearly.
"""

from __future__ import annotations

import copy

from kvconform import compat
from kvconform.checks import EXACT, IGNORES_OPS, OP_PARAMS, OpRule, Param, register
from kvconform.checks._drive import SubjectRaised, case_generator, generate, image_prompt, random_tokens
from kvconform.checks._interpreter import Runner
from kvconform.checks._judge import judge, record_verdict
from kvconform.checks._diagnosis import describe_exception, fail_raised, fail_verdict, token_mismatch
from kvconform.checks._drive import forward, seq_length
from kvconform.checks._diagnosis import describe_raise
from kvconform.checks._lossy import CLEAR_ERRORS, LOSSY_OPS, drive, fail_subject_raised
from kvconform.checks._refusal import changed, snapshot
from kvconform.ops import tokens_held
from kvconform.oracle import compare_logits


# ------------------------------------------------------------------------------------------------ fork
def _split_at_fork(case):
    names = [op.name for op in case.ops]
    if "fork" not in names or names.index("fork") == 0 or names.index("fork") == len(names) - 1:
        raise ValueError(f"case {case.id}: check_prefix_fork needs ops 'prefix ops, fork, suffix ops'")
    i = names.index("fork")
    return case.ops[:i], case.ops[i + 1:]


def _fork_case(case):
    """Load-time rule of ``check_prefix_fork`` (``register(validate=...)``): ops before and after the first fork."""
    names = [op.name for op in case.ops]
    if "fork" in names and (names.index("fork") == 0 or names.index("fork") == len(names) - 1):
        side = "before" if names.index("fork") == 0 else "after"
        return "ops", (f"check_prefix_fork needs ops 'prefix ops, fork, suffix ops' (e.g. ['prefill 8', 'fork', "
                       f"'decode 3']): the first fork has no ops {side} it")
    return None


def _in_turns(ops) -> list:
    """``ops`` with every ``decode N`` split into N ``decode 1`` (the steps the forks take in turns)."""
    from kvconform.ops import Op

    return [piece for op in ops for piece in ([Op("decode", 1)] * op.n if op.name == "decode" else [op])]


def run_fork_case(ctx, cache, info=None, in_turns=None):
    """Prefix ops, then ``params.forks`` (default 2) deep copies each continued with its own suffix, then the
    original with another suffix. Returns the steps; ``info["changed"]`` lists the original's tensors that the copies
    changed (names) and ``info["held"]`` its length at the fork.

    With ``params.interleave`` the copies and the original take the suffix in turns, one op (one decode step) each:
    copy 1, …, copy N, the original, then again. Storage shared by mistake between a copy and the original (a page
    pool whose allocator each copy duplicated) then shows in the logits, where running each to its end first hides
    it (the last writer of a shared page reads back only its own tokens). The original's tensors are not compared
    bit for bit then (it moves in turns with its copies). ``in_turns`` overrides the case's ``interleave``."""
    prefix_ops, suffix_ops = _split_at_fork(ctx.case)
    forks = ctx.case.params.forks
    runner = Runner(ctx, cache)
    runner.run(prefix_ops, parked=False)
    before = snapshot(runner.cache)
    branches = []
    for f in range(forks):
        copied = runner._call(f"copy.deepcopy #{f + 1}", copy.deepcopy, runner.cache)
        if info is not None and f == 0:
            try:
                info["copy_length"] = int(copied.get_seq_length())
                info["original_length"] = int(runner.cache.get_seq_length())
            except Exception:  # noqa: BLE001 - a cache without a readable length: nothing measured here
                pass
        branches.append(runner.branch(copied, f"copy {f + 1}",
                                      gen=case_generator(ctx.case, ctx.model.name, f"/copy{f}")))
    if ctx.case.params.interleave if in_turns is None else in_turns:
        original = runner.branch(runner.cache, "original", gen=case_generator(ctx.case, ctx.model.name, "/original"))
        if info is not None:
            info.update(changed=[], held=runner.length, before=before["get_seq_length()"])
        for op in _in_turns(suffix_ops):
            for branch in (*branches, original):
                branch.run([op], parked=False, index_ops=False)
        return runner.steps
    for branch in branches:
        branch.run(suffix_ops, parked=False, index_ops=False)
    diff = changed(before, snapshot(runner.cache))
    if info is not None:
        info.update(changed=diff, held=runner.length, before=before["get_seq_length()"])
    original = runner.branch(runner.cache, "original", gen=case_generator(ctx.case, ctx.model.name, "/original"))
    original.run(suffix_ops, parked=False, index_ops=False)
    return runner.steps


def _fork_ops_text(ctx):
    prefix_ops, suffix_ops = _split_at_fork(ctx.case)
    forks = ctx.case.params.forks
    suffix = " → ".join(op.label for op in suffix_ops)
    if ctx.case.params.interleave:
        return (f"{' → '.join(op.label for op in prefix_ops)} → deepcopy ×{forks} → the copies and the original in "
                f"turns, one step each: {suffix}")
    return (f"{' → '.join(op.label for op in prefix_ops)} → deepcopy ×{forks}, each: {suffix} → "
            f"original: {suffix}")


@register("prefix", needs=("forward", "deepcopy"),
          params={**OP_PARAMS, "forks": Param(int, default=2, min=1, doc="deep copies continued independently"),
                  "interleave": Param(bool, default=False, doc="the copies and the original take the suffix in "
                                      "turns, one op (one decode step) each, instead of each to its end")},
          ops=OpRule(required=("fork",)), validate=_fork_case)
def check_prefix_fork(ctx):
    """Prefill a shared prefix, deepcopy it, continue each copy with a different suffix (single steps or a chunk):
    every step equals the oracle and the original is untouched (bit for bit, and it still continues correctly)."""
    info: dict = {}
    try:
        steps = run_fork_case(ctx, ctx.new_cache(), info)
    except SubjectRaised as exc:
        fail_raised(ctx, exc, "copy.deepcopy of the cache, or a copy's update, fails (see the exception)",
                    _fork_ops_text(ctx))
    ctx.metrics.update(forks=ctx.case.params.forks)
    if info["changed"]:
        names = info["changed"]
        ctx.fail([f"the original cache changed while its deep copies were extended: {', '.join(names[:4])}"
                  + (f" (+{len(names) - 4} more)" if len(names) > 4 else ""),
                  f"ops: {_fork_ops_text(ctx)}",
                  "likely cause: __deepcopy__ shares tensors (key/value buffers, conv/recurrent states or a length "
                  "counter) between the copy and the original; whatever is written in place then corrupts both"],
                 {"changed": names[:10]})
    verdict = judge(ctx, steps, driver=run_fork_case)
    record_verdict(ctx, verdict, len(steps))
    if not verdict.passed:
        alone = _passes_one_after_the_other(ctx) if ctx.case.params.interleave else False

        def cause(step, cmp):
            if alone:
                return ("the copy and the original share storage the deep copy did not copy (a pool or a page both "
                        "write): the same ops pass when each runs to its end before the other (measured), and fail "
                        "when they decode in turns, where each reads what the other wrote")
            if "chunk(" in step.label and _fails_without_fork(ctx):
                return ("a chunk of several tokens into a warm cache is wrong without any copy: the same ops without "
                        "the fork (prefix, then the suffix on the one cache) fail too — a chunk fault (see the "
                        "chunked-continuation items), not the fork")
            if step.label.startswith("original"):
                return "the original no longer holds the prefix after its copies were extended (shared state)"
            copy_len, orig_len = info.get("copy_length"), info.get("original_length")
            if copy_len is not None and orig_len is not None and copy_len != orig_len:
                return (f"the deep copy counts its tokens wrong: right after copy.deepcopy its get_seq_length() = "
                        f"{copy_len}, the original's = {orig_len}; a length counter is not copied but recomputed "
                        f"(past a sliding window: from the stored window), so positions derived from the cache "
                        f"start wrong")
            return ("the deep copy does not hold the same state as the original (a layer, a length counter or a "
                    "conv/recurrent state was not copied)")

        fail_verdict(ctx, verdict, cause, ops_text=_fork_ops_text(ctx), driver=run_fork_case)


def _passes_one_after_the_other(ctx) -> bool:
    """Whether the case's ops pass on a fresh cache when each copy, then the original, runs its suffix to its end
    (``run_fork_case(in_turns=False)``): an interleaved fork case that fails only in turns has a copy and an original
    sharing storage. A raise there counts as not passing."""
    def one_after_the_other(c, cache, info=None):
        return run_fork_case(c, cache, info, in_turns=False)

    try:
        return judge(ctx, one_after_the_other(ctx, ctx.new_cache()), driver=one_after_the_other).passed
    except SubjectRaised:
        return False


def _fails_without_fork(ctx) -> bool:
    """Whether the fork case's prefix ops followed by its suffix ops, on one fresh cache and no fork, fail against
    the oracle too (measured: a fault of those ops, not of the copy). A raise counts as failing."""
    prefix_ops, suffix_ops = _split_at_fork(ctx.case)
    runner = Runner(ctx, ctx.new_cache())
    try:
        runner.run([*prefix_ops, *suffix_ops], parked=False)
    except SubjectRaised:
        return True
    return not judge(ctx, runner.steps).passed


# ------------------------------------------------------------------------------------------------ generate
def judge_generated(ctx, prompt_len, seq, logits, ref_seq, ops_text, cause_text, rerun=None):
    """Compare ``generate`` output with the uncached run (tokens) and the oracle (step logits).

    Args:
        prompt_len: length of the full prompt (decoder-only); ``seq`` ``[B, prompt_len + N]`` are the full
            sequences, ``logits`` ``[B, N, V]`` float64, ``ref_seq`` the ``generate(use_cache=False)`` sequences.
        rerun: ``fn(spec) -> (prompt_len, seq, logits)`` running the same procedure with another subject; used on
            failure to run the reference cache and tell a fault of the subject from one of generate()/the model.

    Raises:
        ConformanceError: logits beyond tolerance or tokens that differ (a near tie is named as such).
    """
    cmp = _compare_generated(ctx, prompt_len, seq, logits)
    n = logits.shape[1]
    same = tuple(seq.shape) == tuple(ref_seq.shape) and bool((seq == ref_seq).all())
    ctx.metrics.update(max_abs=cmp.max_abs, tolerance=cmp.tol, noise_floor=cmp.floor, new_tokens=n,
                       tokens_equal=same)
    if cmp.passed and same:
        return
    lines = []
    if not cmp.passed:
        b, s = cmp.worst
        observed = "NaN/inf" if cmp.max_abs == float("inf") else f"{cmp.max_abs:.1e}"
        lines += [f"max|Δlogit| = {observed}, but should be ≤ {cmp.tol:.1e} ({ctx.tolerance().describe(cmp.floor)})",
                  f"worst at batch={b} step={s} position={prompt_len - 1 + s}"]
    if not same:
        lines.append(token_mismatch(seq, ref_seq, "generated tokens", "generate(use_cache=False)"))
    lines.append(f"ops: {ops_text}")
    model_at_fault = False
    ref = ctx.reference
    if rerun is not None and ref is not None and not cmp.passed:
        if ref.name == ctx.subject.name:
            lines.append(f"oracle: {ref.name} is kvconform's reference cache → the fault is in generate() or the "
                         f"model, not the cache")
            model_at_fault = True
        else:
            try:
                r_len, r_seq, r_logits = rerun(ref)
                r_cmp = _compare_generated(ctx, r_len, r_seq, r_logits)
                model_at_fault = not r_cmp.passed
                lines.append(f"oracle: {ref.name} on the same case: {r_cmp.max_abs:.1e} → the fault is in "
                             + ("generate() or the model, not the cache" if model_at_fault else "the subject"))
            except Exception as exc:  # noqa: BLE001
                lines.append(f"oracle: {ref.name} on the same case raised {describe_exception(exc)}")
    lines.append("likely cause: " + (
        "a near tie flipped a greedy token although the logits are within tolerance" if cmp.passed else
        "transformers' generate() or modeling code mishandles this case, whatever the cache (see the known faults)"
        if model_at_fault else cause_text))
    ctx.fail(lines, {"tokens_equal": same, "model_at_fault": model_at_fault})


def _compare_generated(ctx, prompt_len, seq, logits):
    n = logits.shape[1]
    dec = seq[:, :-1]
    sl = slice(prompt_len - 1, prompt_len - 1 + n)
    return compare_logits(logits, ctx.oracle.logits(dec)[:, sl], ctx.oracle.uncached(dec)[:, sl], ctx.tolerance())


def _new_cache(ctx, spec):
    return spec.build(ctx.model, max_cache_len=ctx.max_cache_len, batch_size=ctx.case.batch,
                      encoder_len=ctx.case.encoder_len)


def _prefix_tokens(ctx):
    import torch

    case, model = ctx.case, ctx.model
    gen = case_generator(case, model.name)
    prefix = image_prompt(model, random_tokens(gen, case.batch, case.ops[0].n, model.vocab_size))
    suffix = random_tokens(gen, case.batch, case.params.suffix, model.vocab_size)
    return prefix, suffix, torch.cat([prefix, suffix], dim=1)


def _run_prefix_generate(ctx, spec, ops_text):
    """Prefill the prefix into a fresh ``spec`` cache, then generate; returns ``(prompt_len, seq, logits)``."""
    import torch

    mode = ctx.case.params["mode"]
    prefix, suffix, full = _prefix_tokens(ctx)
    cache = _new_cache(ctx, spec)
    sctx = ctx.replace(subject=spec)
    runner = Runner(sctx, cache)
    try:
        runner.feed(prefix.shape[1], "forward(prefix)", tokens=prefix)
    except SubjectRaised as exc:
        fail_raised(ctx, exc, "the cache cannot take the prefix (see the exception)", ops_text)
    kwargs = compat.generate_cache_kwargs(cache, ctx.model.model)
    n = ctx.case.max_new_tokens
    if mode == "full_prompt":
        seq, logits, _ = _generate_or_fail(ctx, ops_text, full, n, kwargs)
    else:
        seq, logits, _ = _generate_or_fail(ctx, ops_text, suffix, n, kwargs, attention_mask=torch.ones_like(full))
        seq = torch.cat([prefix, seq], dim=1)
    return full.shape[1], seq, logits


def _generate_or_fail(ctx, ops_text, *args, **kwargs):
    try:
        return generate(ctx.model, *args, **kwargs)
    except Exception as exc:  # noqa: BLE001
        ctx.fail([f"generate raised {describe_exception(exc)}", f"ops: {ops_text}",
                  "likely cause: the cache lacks something generate() calls, or holds a state it cannot continue "
                  "from (see the exception)"], {"raised": type(exc).__name__})


def _held_with_generate(case) -> int:
    """The most tokens per row ``case`` makes a cache hold where ``generate`` continues it
    (``@register(tokens_held=...)``): a case without ops ``prompt + max_new_tokens``; else its ops' most, or what it
    holds at the end plus the ``suffix`` (``user``) tokens and ``max_new_tokens``."""
    if not case.ops:
        return case.prompt + case.max_new_tokens
    counts = tokens_held(case.ops)
    extra = case.params.get("suffix") or case.params["user"]
    return max(max(counts), counts[-1] + int(extra) + case.max_new_tokens)


@register("prefix", needs=("forward", "generate"), judges=(EXACT,), tokens_held=_held_with_generate, params={
    **OP_PARAMS,
    "mode": Param(str, default="full_prompt", choices=("full_prompt", "suffix_only"),
                  doc="full_prompt: generate gets the whole prompt and skips the cached tokens; suffix_only: the "
                      "suffix and the full attention mask"),
    "suffix": Param(int, default=4, min=1, doc="prompt tokens after the cached prefix"),
}, ops=OpRule(shape=("prefill",), why="the prefix is prefilled by one forward, then generate() takes over"))
def check_prefix_generate(ctx):
    """Prefill a prefix with a forward, then ``generate`` from that cache with the full prompt or the suffix only:
    the same tokens as ``generate(use_cache=False)`` and step logits equal to the oracle."""
    case = ctx.case
    mode = case.params["mode"]
    if mode not in ("full_prompt", "suffix_only") or not case.ops or case.ops[0].name != "prefill":
        raise ValueError(f"case {case.id}: check_prefix_generate needs ops ['prefill N'] and params.mode "
                         f"'full_prompt' or 'suffix_only'")
    prefix, suffix, full = _prefix_tokens(ctx)
    n = case.max_new_tokens
    ops_text = (f"forward(prefix {prefix.shape[1]}) → generate({'full prompt' if mode == 'full_prompt' else 'suffix'}"
                f" {full.shape[1] if mode == 'full_prompt' else suffix.shape[1]} tokens, cache=prefilled, "
                f"max_new_tokens={n})")
    prompt_len, seq, logits = _run_prefix_generate(ctx, ctx.subject, ops_text)
    ref_seq, _, _ = generate(ctx.model, full, n, {"use_cache": False})
    judge_generated(ctx, prompt_len, seq, logits, ref_seq, ops_text,
                    "generate() fed the wrong tokens on top of the prefilled cache (it slices the prompt by "
                    "get_seq_length(); a cache that cannot report its length is fed the whole prompt again) or "
                    "the cache lost the prefix", rerun=lambda spec: _run_prefix_generate(ctx, spec, ops_text))


def _turn_tokens(ctx):
    gen = case_generator(ctx.case, ctx.model.name)
    prompt = image_prompt(ctx.model, random_tokens(gen, ctx.case.batch, ctx.case.prompt, ctx.model.vocab_size))
    user = random_tokens(gen, ctx.case.batch, ctx.case.params.user, ctx.model.vocab_size)
    return prompt, user


def _run_turns(ctx, spec, ops_text):
    """Two generate() turns sharing one ``spec`` cache; returns ``(turn-2 prompt length, seq, logits)``."""
    import torch

    prompt, user = _turn_tokens(ctx)
    n = ctx.case.max_new_tokens
    kwargs = compat.generate_cache_kwargs(_new_cache(ctx, spec), ctx.model.model)
    first, _, _ = _generate_or_fail(ctx, ops_text, prompt, n, kwargs)
    turn2 = torch.cat([first, user], dim=1)
    seq, logits, _ = _generate_or_fail(ctx, ops_text, turn2, n, kwargs)
    return turn2.shape[1], seq, logits


@register("prefix", needs=("forward", "generate"), judges=(EXACT,), tokens_held=_held_with_generate,
          params={"user": Param(int, default=3, min=1, doc="new tokens in the second turn")}, ops=IGNORES_OPS)
def check_multi_turn(ctx):
    """Turn 1: ``generate(prompt, cache=c)``; turn 2: ``generate(turn-1 output + new tokens, cache=c)`` equals a
    fresh ``generate(use_cache=False)`` of the same turn-2 prompt (tokens) and the oracle (step logits)."""
    prompt, user = _turn_tokens(ctx)
    n = ctx.case.max_new_tokens
    ops_text = (f"generate(prompt {prompt.shape[1]}, max_new_tokens={n}, cache=c) → generate(previous output + "
                f"{user.shape[1]} new tokens, max_new_tokens={n}, cache=c)")
    prompt_len, seq, logits = _run_turns(ctx, ctx.subject, ops_text)
    ref_seq, _, _ = generate(ctx.model, seq[:, :prompt_len], n, {"use_cache": False})
    judge_generated(ctx, prompt_len, seq, logits, ref_seq, ops_text,
                    "the cache returned by the first generate() does not hold exactly the first turn (generate "
                    "slices the next prompt by get_seq_length(); a cache that cannot report it is fed the whole "
                    "conversation again)", rerun=lambda spec: _run_turns(ctx, spec, ops_text))


# ------------------------------------------------------------------------------------------ undeclared deepcopy
def _undeclared_deepcopy(subject, model, case, device="cpu"):
    if "deepcopy" in subject.capabilities:
        return f"{subject.name} declares deepcopy: the prefix family checks prefix reuse"
    return None


@register("prefix", needs=("forward",), applies=_undeclared_deepcopy,
          ops=OpRule(allowed=LOSSY_OPS, first="prefill", why="it copies the cache after these ops"))
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
        fail_subject_raised(ctx, exc, "the cache does not support the ops before the copy (see the exception)")
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
                ctx.encoder_ids)
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
