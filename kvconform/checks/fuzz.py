"""Family ``fuzz``: random sequences of cache ops, compared with the oracle after every forward.

Hypothesis draws programs — a prefill, then up to ``params.max_ops`` ops among decode, chunk, crop, fork (deepcopy),
reorder, repeat, select and reset, limited to the capabilities the subject declares and to the ops that work on
their own (each op is probed once; one that fails alone is its own family's finding, not rediscovered here) — and
runs each through the engine on a fresh cache. The fuzzer behaves like a careful caller: it calls
``activate_past_recording()`` first (as assisted decoding does), crops only when ``is_croppable`` says it can and
never more than the cache holds, and keeps the batch at most 8 rows and the sequence below ``max_cache_len``.

A program fails when the subject raises or its logits leave the tolerance *and* ``ReferenceCache`` on the same
program does not (otherwise the model's code is at fault: such programs are counted, not reported; for the
reference subject itself every failure is reported, naming the model as the culprit). Hypothesis then
shrinks it, and the message prints the shrunk program as the reproducer, in case-file syntax.

Profiles (``params``): a default-tier case draws ``max_examples`` (default 8) programs of at most ``max_ops``
(default 6) ops (a few seconds per subject); a full-tier case (run only under ``--kvconform-full``, i.e.
``ctx.full``; CI) draws ``full_examples`` (default 60). Both are derandomized by a fixed seed per case: the same
programs every run and for every subject. ``--kvconform-fuzz-seed N`` (``ctx.fuzz_seed``) draws other programs,
replayable with the same N; ``random`` picks N and prints it in the header.
"""

from __future__ import annotations

import contextlib
import os

from kvconform.ops import OP_CAPABILITY, OPS as OP_SPECS, OPS_WITH_COUNT, Op
from kvconform.checks import IGNORES_OPS, OP_PARAMS, CheckSkipped, Param, register
from kvconform.checks._drive import SubjectRaised
from kvconform.checks._interpreter import Runner
from kvconform.checks._judge import judge
from kvconform.checks._diagnosis import describe_exception
from kvconform.outcomes import KVConformError
from kvconform.subjects import kind_of

MAX_BATCH = 8
OPS = tuple(name for name, s in OP_SPECS.items() if s.fuzz is not None and name != "prefill")
"""The ops a program draws after its prefill: those with fuzz bounds (``OpSpec.fuzz``), in table order."""
NEEDS = OP_CAPABILITY


class ProgramFailed(KVConformError):
    """A program on which the subject fails and the reference does not. ``lines``: the message body."""

    def __init__(self, program, lines, metrics):
        super().__init__("\n".join(lines))
        self.program, self.lines, self.metrics = program, lines, metrics


def program_text(program) -> str:
    """``prefill(5) → crop(-2) → reorder → decode×1`` (the ops labels)."""
    return " → ".join(Op(name, n).label for name, n in program)


def program_case_syntax(program) -> str:
    """The program as a case file's ``ops`` list: ``["prefill 5", "crop 2", "reorder", "decode 1"]``."""
    items = [f'"{name} {n}"' if name in OPS_WITH_COUNT else f'"{name}"' for name, n in program]
    return "[" + ", ".join(items) + "]"


def run_program(ctx, cache, program, info=None):
    """Run ``program`` (a list of ``(op, n)``) on ``cache`` as a careful caller; return the steps.

    ``info["done"]`` lists the ops actually started, in order (others were skipped: a crop the flag forbids, a
    repeat past ``MAX_BATCH`` rows, a feed past the capacity, a batch op on an empty cache).

    Raises:
        SubjectRaised: the subject raised (names the op).
    """
    runner = Runner(ctx, cache, position_mode="explicit")
    done = [] if info is None else info.setdefault("done", [])
    limit = ctx.max_cache_len - 1
    if "crop" in {name for name, _ in program} and hasattr(cache, "activate_past_recording"):
        runner._call("activate_past_recording()", lambda: cache.activate_past_recording())

    def plan(runner, op, i):
        """Skip what a careful caller would not do in this state; clamp a crop to the tokens held."""
        name, n, spec = op.name, op.n, op.spec
        if spec.feeds:
            skip = runner.length + n > limit
        elif spec.held == "removes":
            skip = runner.length == 0 or not bool(getattr(runner.cache, "is_croppable", False))
            n = min(n, runner.length)
            image = ctx.model.image
            if image is not None:  # a VLM caller crops whole images or none: never inside an image block
                from kvconform import vision

                n = runner.length - vision.uncut_length(image, runner.seq, runner.length - n)
                skip = skip or n == 0
            op = Op(name, n)
        elif spec.held == "empties":
            skip = False
        else:
            skip = runner.length == 0 or (spec.rows == "resize" and n and runner.batch * n > MAX_BATCH)
        if skip:
            return None
        done.append((op.name, op.n))
        if spec.feeds and not spec.per_token:  # a feed into an empty cache is a prefill, whatever the program says
            return Op("prefill" if runner.length == 0 else name, n)
        return op

    return runner.run([Op(name, n) for name, n in program], plan=plan)


def _outcome(ctx, spec, program):
    """None if ``spec`` passes ``program``, else ``(lines, metrics, info)`` describing the failure (``info["done"]``:
    the ops executed, the failing one last)."""
    sctx = ctx.replace(subject=spec, metrics={})
    info: dict = {}
    try:
        steps = run_program(sctx, sctx.new_cache(), program, info)
    except CheckSkipped:
        return None  # a clear refusal of the program's prefill the contract allows (a press's too-short prompt)
    except SubjectRaised as exc:
        return ([f"the subject raised {describe_exception(exc.cause)} at {exc.where}"],
                {"raised": type(exc.cause).__name__, "failed_at": exc.where}, info)

    def driver(c, cache):
        return run_program(c, cache, program)

    verdict = judge(sctx, steps, spec, driver)
    if verdict.passed:
        return None
    step, cmp = verdict.first_fail  # type: ignore[misc]  # set where the verdict did not pass
    observed = "NaN/inf" if cmp.max_abs == float("inf") else f"{cmp.max_abs:.1e}"
    versus = f" vs {verdict.target}" if verdict.target else ""
    return ([f"max|Δlogit| = {observed}{versus}, but should be ≤ {cmp.tol:.1e} "
             f"({sctx.tolerance().describe(cmp.floor)}), worst at batch={cmp.worst[0]} "
             f"position={step.start + cmp.worst[1]} [failed at {step.label}]",
             f"diverged from the fresh instance: {verdict.cause}" if verdict.cause else ""],
            {"max_abs": cmp.max_abs, "tolerance": cmp.tol, "noise_floor": cmp.floor, "failed_at": step.label},
            info)


def _program_cause(exc) -> str:
    """The likely cause of a failing program: a failure at its first op (the prefill, before any other op ran) is
    that op's own fault, not an interaction; otherwise the interaction of its ops."""
    failed_at = str(exc.metrics.get("failed_at") or "")
    first = exc.program[0] if exc.program else None
    if first is not None and (failed_at.startswith("prefill") or failed_at == f"{first[0]}({first[1]})"):
        return (f"the program fails at its first op, {failed_at}, before any other op ran: no interaction — the "
                f"cache fails a plain prefill of {first[1]} tokens on its own (a case with ops = "
                f"[\"prefill {first[1]}\", \"decode 1\"] reproduces it; see the logits family)")
    return ("an interaction between these ops that no single-op case covers (replay the program as a case to "
            "bisect it)")


def _strategy(ctx, ops, max_ops):
    from hypothesis import strategies as st

    def draw(name):
        low, high = OP_SPECS[name].fuzz  # type: ignore[misc]  # the fuzzer draws only ops with fuzz bounds
        return st.tuples(st.just(name), st.just(low) if low == high else st.integers(low, high))

    choices = [draw(name) for name in ops]
    prefill = draw("prefill")
    body = st.lists(st.one_of(*choices), min_size=1, max_size=max_ops)
    # a final decode step shows the state the last op left behind
    return st.builds(lambda p, b: [p, *b, ("decode", 1)], prefill, body)


def _available_ops(ctx):
    """Ops the subject declares (capabilities), minus those that fail on their own.

    Each non-feed op is probed once — ``prefill 6 → op → decode 1`` on a fresh cache, judged like any program —
    and left out if the subject fails it while the reference does not: a single broken op is its family's finding
    (batch, crop, prefix, lifecycle, contract), and would otherwise be all the fuzzer ever reports. Returns
    ``(ops, left_out)`` with a reason for each op left out.
    """
    ops, left_out = [], []
    for name in OPS:
        need = NEEDS.get(name)
        if need and need not in ctx.subject.capabilities:
            left_out.append(f"{name} (capability '{need}' not declared)")
            continue
        if not OP_SPECS[name].feeds:
            probe = [("prefill", 6), (name, OP_SPECS[name].fuzz[0]), ("decode", 1)]  # type: ignore[index]
            outcome = _outcome(ctx, ctx.subject, probe)
            if outcome is not None and (ctx.reference is None or ctx.reference.name == ctx.subject.name
                                        or _outcome(ctx, ctx.reference, probe) is None):
                left_out.append(f"{name} (fails on its own: {outcome[0][0][:90]}; see its family)")
                continue
        ops.append(name)
    return ops, left_out


def _applies(subject, model, case, **_):
    """Needs hypothesis (an optional dependency: ``pip install hypothesis`` or ``kvconform[dev]``). Lossy subjects
    are judged against their fake-quant twin, replayed twice per program: fuzz them only in the full tier, where the
    time is budgeted."""
    import importlib.util

    if importlib.util.find_spec("hypothesis") is None:
        return "requires hypothesis (pip install hypothesis) for op-sequence fuzzing"
    if kind_of(subject).has_twin and case.tier != "full":
        return (f"{subject.name} is lossy: each program replays its fake-quant twin twice, so it is fuzzed in the "
                f"full tier only (--kvconform-full)")
    return None


@contextlib.contextmanager
def _hypothesis_storage_outside_the_folder():
    """Hypothesis writes a ``.hypothesis/`` folder into the working directory (a cache of constants found in local
    code, even with ``database=None``). A conformance run must leave nothing in the user's folder: for the duration
    of the fuzz run its storage is a folder under the system temp dir, then back to hypothesis' default
    (``$HYPOTHESIS_STORAGE_DIRECTORY`` or ``./.hypothesis``) for the user's own tests."""
    import tempfile

    from hypothesis.configuration import set_hypothesis_home_dir

    set_hypothesis_home_dir(os.path.join(tempfile.gettempdir(), "kvconform-hypothesis"))
    try:
        yield
    finally:
        set_hypothesis_home_dir(None)


def _longest_program(case) -> int:
    """The most tokens per row a program of ``case`` makes a cache hold: a prefill of ≤ 10, ``max_ops`` chunks of
    ≤ 5, a final decode (``@register(tokens_held=...)``)."""
    return 10 + 5 * case.params.max_ops + 1


@register("fuzz", cost=2.0, needs=("forward",), applies=_applies, tokens_held=_longest_program, params={
    **OP_PARAMS,
    "max_examples": Param(int, default=8, min=1, doc="programs drawn by a default-tier case"),
    "max_ops": Param(int, default=6, min=1, doc="ops after the prefill, at most"),
    "full_examples": Param(int, default=60, min=1, doc="programs drawn by a full-tier case"),
}, ops=IGNORES_OPS)
def check_op_sequences(ctx):
    """Random op programs (hypothesis), limited to the subject's capabilities, compared with the oracle after every
    forward; a failure prints the shrunk program as the reproducer."""
    import zlib

    from hypothesis import HealthCheck, Phase, given, seed, settings

    params = ctx.case.params
    ops, left_out = _available_ops(ctx)
    max_ops = params.max_ops
    long_profile = ctx.case.tier == "full"  # full-tier cases run only under --kvconform-full (ctx.full)
    examples = params.full_examples if long_profile else params.max_examples
    reference = ctx.reference
    stats = {"programs": 0, "model_faults": 0}

    # an item matching a known upstream fault is expected to fail: its program is reported as found, not shrunk
    # (shrinking re-runs the subject and the reference dozens of times; the fault is described in known_faults.toml)
    phases = [p for p in Phase if p is not Phase.shrink or not ctx.known_fault]

    # Both profiles are derandomized with a fixed seed per case (the same programs for every subject and run, and
    # unlike settings(derandomize=True), which hashes this function's source, unchanged by edits to this file).
    # --kvconform-fuzz-seed N (printed in the header, random with "random") mixes N in: other programs, replayable.
    salt = "" if ctx.fuzz_seed is None else f"/{ctx.fuzz_seed}"
    fixed = seed(zlib.crc32(f"{ctx.case.id}/{ctx.case.seed}{salt}".encode()))

    @fixed
    @settings(max_examples=examples, deadline=None, database=None, print_blob=False,
              suppress_health_check=list(HealthCheck), report_multiple_bugs=False, phases=phases)
    @given(_strategy(ctx, ops, max_ops))
    def programs_conform(program):
        stats["programs"] += 1
        outcome = _outcome(ctx, ctx.subject, program)
        if outcome is None:
            return
        if reference is not None and reference.name != ctx.subject.name and \
                _outcome(ctx, reference, program) is not None:
            stats["model_faults"] += 1  # the reference fails too: the model's code, not the subject
            return
        lines, metrics, info = outcome
        raise ProgramFailed(program, lines, {**metrics, "executed": info.get("done", [])})

    try:
        with _hypothesis_storage_outside_the_folder():
            programs_conform()
    except ProgramFailed as exc:
        executed = exc.metrics.get("executed") or exc.program
        headline = (f"a random op program fails (shrunk by hypothesis to {len(exc.program)} ops):"
                    if not ctx.known_fault else
                    f"a random op program of {len(exc.program)} ops fails (not shrunk: a known upstream fault):")
        ctx.fail([headline,
                  f"program: {program_text(exc.program)}",
                  *exc.lines,
                  f"ran (ops skipped as a careful caller would, failing op last): {program_text(executed)}"
                  if executed != exc.program else "",
                  "" if reference is None else
                  f"oracle: {reference.name} is kvconform's reference cache → the fault is in the model, not the cache"
                  if reference.name == ctx.subject.name else
                  f"oracle: {reference.name} on the same program conforms → the fault is in the subject",
                  f"as a case: ops = {program_case_syntax(exc.program)}",
                  "likely cause: " + _program_cause(exc)],
                 {**exc.metrics, "program": program_case_syntax(exc.program), "ops_drawn_from": ops,
                  "left_out": left_out, **stats})
    ctx.metrics.update(ops_drawn_from=ops, left_out=left_out, examples=examples, **stats)
