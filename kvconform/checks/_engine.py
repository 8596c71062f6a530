"""Drive a model with a cache through a case's ops, the way a manual decode loop does, and compare every step
with the oracle.

A run keeps the token sequence the cache is supposed to hold (``seq``, ``[B, T]`` int64). Every forward feeds new
tokens (random, seeded, distinct per batch row) and records the subject's logits for them; afterwards each step
is compared with the oracle logits of the sequence as it was at that step (causality makes one oracle forward
valid for every prefix).
"""

from __future__ import annotations

import traceback
import zlib
from dataclasses import dataclass

from kvconform import compat
from kvconform.oracle import compare_logits

FIRST_TOKEN = 3  # ids 0..2 are pad / bos / eos in the zoo


@dataclass
class Step:
    """One forward: ``logits`` float64 ``[B, length, V]`` for positions ``start .. start+length-1`` of ``seq``."""

    index: int
    op_index: int
    label: str
    start: int
    length: int
    logits: object
    seq: object
    reported_length: int | None


class SubjectRaised(Exception):
    """The subject (or the model through it) raised; ``where`` is the op label, ``cause`` the exception."""

    def __init__(self, where, cause):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.where = where
        self.cause = cause


def case_generator(case, model_name: str):
    """A ``torch.Generator`` seeded from the case id, the model name and ``case.seed`` (stable across runs)."""
    import torch

    seed = zlib.crc32(f"{case.id}/{model_name}/{case.seed}".encode())
    return torch.Generator().manual_seed(seed)


def random_tokens(gen, batch: int, n: int, vocab: int):
    """``[batch, n]`` int64 tokens in ``[FIRST_TOKEN, vocab)``."""
    import torch

    return torch.randint(FIRST_TOKEN, vocab, (batch, n), generator=gen)


def encoder_ids_for(ctx, gen):
    return random_tokens(gen, ctx.case.batch, ctx.case.encoder_len, ctx.model.vocab_size) \
        if ctx.model.is_encoder_decoder else None


def seq_length(cache):
    """``cache.get_seq_length()``, or None where it is undefined (an all-linear-attention cache raises)."""
    try:
        return int(cache.get_seq_length())
    except Exception:  # noqa: BLE001
        return None


def forward(model, cache, new_tokens, start: int, position_mode: str, encoder_ids=None):
    """One cached forward of ``new_tokens`` ``[B, k]`` at absolute positions ``start..start+k-1``.

    Returns float64 logits ``[B, k, V]`` on CPU.
    """
    import torch

    m = model.model
    device = next(m.parameters()).device
    kwargs = {compat.cache_kwarg(m): cache, "use_cache": True}
    if model.is_encoder_decoder:
        kwargs.update(input_ids=encoder_ids.to(device), decoder_input_ids=new_tokens.to(device))
    else:
        kwargs["input_ids"] = new_tokens.to(device)
    if position_mode in ("explicit", "auto") and compat.accepts_position_ids(m):
        k = new_tokens.shape[1]
        kwargs["position_ids"] = torch.arange(start, start + k, device=device).expand(new_tokens.shape[0], k)
    with torch.no_grad():
        out = m(**kwargs)
    return out.logits.detach().to("cpu", torch.float64)


def run_ops(ctx, cache, position_mode: str | None = None) -> list[Step]:
    """Execute ``ctx.case.ops`` on ``cache``; return the recorded steps.

    Raises:
        SubjectRaised: any exception during an op (names the op).
        ValueError: an op this engine does not implement.
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
        except Exception as exc:  # noqa: BLE001 - the subject's failure, reported on its item
            raise SubjectRaised(label, exc) from exc
        seq = torch.cat([seq, new], dim=1)
        steps.append(Step(len(steps), op_index, label, start, n, logits, seq.clone(), seq_length(cache)))

    for i, op in enumerate(case.ops):
        if op.name in ("prefill", "chunk"):
            feed(i, op.label, op.n)
        elif op.name == "decode":
            for s in range(op.n):
                feed(i, f"decode {s + 1}", 1)
        else:
            raise ValueError(f"op {op.name!r} is not supported by this check (case {case.id})")
    ctx.encoder_ids = encoder_ids
    return steps


@dataclass
class Verdict:
    """Comparison of all steps: ``first_fail`` (step, Comparison) or None, and the ``worst`` pair overall."""

    first_fail: tuple | None
    worst: tuple

    @property
    def passed(self) -> bool:
        return self.first_fail is None


def judge(ctx, steps) -> Verdict:
    """Compare every step with the oracle under ``ctx.tolerance()``."""
    tol = ctx.tolerance()
    first_fail = worst = None
    enc = getattr(ctx, "encoder_ids", None)
    for step in steps:
        sl = slice(step.start, step.start + step.length)
        oracle = ctx.oracle.logits(step.seq, encoder_ids=enc)[:, sl]
        uncached = ctx.oracle.uncached(step.seq, encoder_ids=enc)[:, sl]
        cmp = compare_logits(step.logits, oracle, uncached, tol)
        if worst is None or cmp.max_abs > worst[1].max_abs:
            worst = (step, cmp)
        if first_fail is None and not cmp.passed:
            first_fail = (step, cmp)
    return Verdict(first_fail, worst)


def verdict_metrics(verdict: Verdict) -> dict:
    step, cmp = verdict.first_fail or verdict.worst
    return {"max_abs": cmp.max_abs, "tolerance": cmp.tol, "noise_floor": cmp.floor, "steps": len_or_none(step)}


def len_or_none(step):
    return None if step is None else step.index + 1


def run_and_judge(ctx, spec=None, position_mode=None) -> Verdict:
    """Build a fresh cache of ``spec`` (default: the subject), run the case, judge it."""
    cache = ctx.new_cache(spec)
    return judge(ctx, run_ops(ctx, cache, position_mode))


def describe_raise(exc: SubjectRaised) -> str:
    """``"IndexError: ... (at cache_utils.py:512 in update)"`` — the innermost frame of the subject's exception."""
    tb = traceback.extract_tb(exc.cause.__traceback__)
    where = f" (at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno} in {tb[-1].name})" if tb else ""
    text = str(exc.cause).strip().splitlines()
    first = text[0][:200] if text else ""
    return f"{type(exc.cause).__name__}: {first}{where}"


def oracle_line(ctx, position_mode=None) -> tuple[str, bool]:
    """Run the same case on the reference subject; return (message line, model_at_fault)."""
    ref = ctx.reference
    if ref is None:
        return "", False
    if ref.name == ctx.subject.name:
        # The reference cache is the simplest correct cache (proven by kvconform's own tests): when it fails,
        # the model's code is at fault.
        return (f"oracle: {ref.name} is kvconform's reference cache → the fault is in the model, "
                f"not the cache"), True
    try:
        v = run_and_judge(ctx, ref, position_mode)
    except SubjectRaised as exc:
        return f"oracle: {ref.name} on the same case raised {describe_raise(exc)}", False
    _, cmp = v.first_fail or v.worst
    if v.passed:
        return f"oracle: {ref.name} on the same case: {cmp.max_abs:.1e} → the fault is in the subject", False
    return (f"oracle: {ref.name} on the same case fails too ({cmp.max_abs:.1e}) → the fault is in the model, "
            f"not the cache"), True


def fail_verdict(ctx, verdict: Verdict, cause_fn, position_mode=None):
    """Raise the DESIGN §7 message for a failed verdict. ``cause_fn(step, cmp, model_at_fault) -> str``."""
    step, cmp = verdict.first_fail
    b, offset = cmp.worst
    position = step.start + offset
    ref_line, model_at_fault = oracle_line(ctx, position_mode)
    observed = "NaN/inf" if cmp.max_abs == float("inf") else f"{cmp.max_abs:.1e}"
    tol_text = ctx.tolerance().describe(cmp.floor)
    ctx.fail([
        f"max|Δlogit| = {observed}, but should be ≤ {cmp.tol:.1e} ({tol_text})",
        f"worst at batch={b} step={step.index} position={position}",
        f"ops: {ctx.case.ops_label()}   [failed at {step.label}]"
        + f"; {positions_label(ctx)}",
        ref_line,
        "likely cause: " + cause_fn(step, cmp, model_at_fault),
    ], {"max_abs": cmp.max_abs, "tolerance": cmp.tol, "noise_floor": cmp.floor, "failed_at": step.label,
        "position": position, "model_at_fault": model_at_fault})


def positions_label(ctx) -> str:
    """How positions were given: explicit ``position_ids`` or derived by the model from the cache."""
    explicit = ctx.case.position_ids != "implicit" and compat.accepts_position_ids(ctx.model.model)
    return "explicit position_ids" if explicit else "no position_ids (derived from the cache)"


def fail_raised(ctx, exc: SubjectRaised, cause: str):
    ctx.fail([
        f"the subject raised {describe_raise(exc)}",
        f"ops: {ctx.case.ops_label()}   [raised at {exc.where}]",
        "likely cause: " + cause,
    ], {"raised": type(exc.cause).__name__, "failed_at": exc.where})
