"""Family ``lifecycle``: a cache object lives through several sequences and up to its capacity.

* ``check_reset_then_reuse``: ``reset()`` then a new sequence equals a fresh cache (the oracle); a cache that says
  ``is_compileable`` keeps the same data pointers for every tensor it held (CUDA graphs and ``torch.compile``
  captured those addresses). After ``reset B`` (the next sequence has batch size ``B``) the cache must work, or its
  first forward must raise a clear error naming the batch size (a raw tensor-op error fails) — and such a refusal
  passes only where the contract allows it: the subject declares it (``refuses={"reset_batch": why}``), or
  kvconform's reference refuses the same case too (``_refusal.allowed_refusal``); else it fails, naming the refusal
  and that the reference accepts it.
* ``check_capacity``: a cache built with ``max_cache_len = M`` and fed past ``M`` tokens either keeps working
  exactly (an unbounded or window-only cache) or raises a clear error *before writing anything* (a fixed-size cache);
  a raw ``IndexError`` from a tensor op, a write before the error, or silently wrong logits fail.
"""

from __future__ import annotations

from typing import Any

from kvconform.checks import OP_PARAMS, OpRule, Param, register
from kvconform.checks._drive import SubjectRaised
from kvconform.checks._measure import tensors_of
from kvconform.checks._interpreter import Runner
from kvconform.checks._judge import judge, record_verdict
from kvconform.checks._diagnosis import describe_exception, fail_raised, fail_verdict
from kvconform.checks._refusal import RAW_ERRORS, allowed_refusal, changed, clear_error, snapshot

BATCH_WORDS = ("batch",)
"""A clear refusal of reuse with another batch size names it."""


# ------------------------------------------------------------------------------------------------ reset
class ResetPointers:
    """Observer: ``{name: data_ptr}`` of the cache's tensors before every ``reset`` (``befores``) and the names of the
    ops begun so far (``done``)."""

    def __init__(self):
        self.befores, self.done = [], []

    def before_op(self, runner, op, op_index):
        """Record the pointers before a reset, and the op's name."""
        if op.name == "reset":
            self.befores.append({k: t.data_ptr() for k, t in tensors_of(runner.cache).items()})
        self.done.append(op.name)


def run_reset_case(ctx, cache, info=None):
    """Run the case's ops; around every ``reset`` record ``{name: data_ptr}`` of the cache's tensors before the
    reset and after the whole run (``info["pointers"] = [(before, after)]``). Returns the steps."""
    probe = ResetPointers()
    runner = Runner(ctx, cache, observers=[probe])
    if info is not None:
        info["done"] = probe.done
    runner.run()
    if info is not None:
        after = {k: t.data_ptr() for k, t in tensors_of(runner.cache).items()}
        info["pointers"] = [(b, after) for b in probe.befores]
        info["compileable"] = bool(getattr(runner.cache, "is_compileable", False))
    return runner.steps


@register("lifecycle", needs=("forward", "reset"), params=OP_PARAMS,
          ops=OpRule(required=("reset",), why="it reuses the cache after reset()"))
def check_reset_then_reuse(ctx):
    """Prefill and decode, ``reset()``, then a new (different) sequence: every step equals the oracle, as with a
    fresh cache; a compileable cache keeps its tensors' data pointers across the reset."""
    if not any(op.name == "reset" for op in ctx.case.ops):
        raise ValueError(f"case {ctx.case.id}: check_reset_then_reuse needs a 'reset' op")
    info: dict = {}
    try:
        steps = run_reset_case(ctx, ctx.new_cache(), info)
    except SubjectRaised as exc:
        after_reset = "reset" in info.get("done", [])[:-1] or exc.where == "reset"
        resized = after_reset and any(op.name == "reset" and op.n and op.n != ctx.case.batch for op in ctx.case.ops)
        if resized and exc.where != "reset" and clear_error(exc.cause, BATCH_WORDS):
            # reusing a cache object for a batch of another size may be refused, clearly, by the first forward —
            # where the contract allows it: the subject declares it, or the reference cannot do it either
            _judge_reset_refusal(ctx, exc)
            return
        fail_raised(ctx, exc, ("after reset() the cache still has buffers sized for the previous batch: reuse with "
                               "another batch size must work, or raise a clear error that names the batch size")
                    if resized else "reset() leaves the cache in a state its next update cannot handle"
                    if after_reset else "the cache does not support this sequence of calls (see the exception)")
    verdict = judge(ctx, steps, driver=run_reset_case)
    record_verdict(ctx, verdict, len(steps), compileable=info["compileable"])
    if not verdict.passed:
        reset_at = next(i for i, op in enumerate(ctx.case.ops) if op.name == "reset")

        def cause(step, cmp):
            if step.op_index > reset_at:
                return ("reset() did not clear everything: tokens, a length counter or a conv/recurrent state of "
                        "the previous sequence survive into the next one")
            return "the cache is wrong before the reset (see the logits family)"

        fail_verdict(ctx, verdict, cause, driver=run_reset_case)
    if info["compileable"]:
        for before, after in info["pointers"]:
            moved = sorted(k for k in before if k in after and before[k] != after[k])
            if moved:
                ctx.fail([f"is_compileable is True, but reset() and reuse moved {len(moved)} tensor(s) to new "
                          f"memory: {', '.join(moved[:4])}" + (" ..." if len(moved) > 4 else ""),
                          f"ops: {ctx.case.ops_label()}",
                          "likely cause: reset() (or the next update) reallocates tensors instead of zeroing them in "
                          "place; CUDA graphs and compiled decode steps keep reading the old addresses"],
                         {"moved": moved[:10]})


def _judge_reset_refusal(ctx, exc) -> None:
    """A clear refusal of reuse with another batch size (``exc``, at the first forward after ``reset B``) is the
    contract's only where it allows it (``_refusal.allowed_refusal``: the subject declares ``reset_batch`` in
    ``refuses``, or the reference refuses the same case too, or a model adapter, whose documented contract allows
    it); it is recorded in ``ctx.measured``. Otherwise the item fails, naming what was refused and that the
    reference accepts it."""
    refusal = describe_exception(exc.cause)
    allowed = allowed_refusal(ctx, "reset_batch", lambda ref_ctx: run_reset_case(ref_ctx, ref_ctx.new_cache()),
                              adapter_contract="docs/from-scratch.md: a reset cache may refuse another batch size")
    ctx.metrics.update(refused=refusal, refused_at=exc.where)
    if allowed.by is not None:
        ctx.measured.record(refusal=refusal, refused_by=allowed.by)
        ctx.metrics.update(refused_by=allowed.by)
        return
    batches = [op.n for op in ctx.case.ops if op.name == "reset" and op.n]
    ctx.fail([f"after reset() to a batch of {batches[0]} (first used with {ctx.case.batch}), the subject refused "
              f"the next forward ({exc.where}): {refusal}",
              f"but {allowed.reference} accepts it: the same case runs to the end on it, and {ctx.subject.name} "
              f"declares no such refusal (refuses={{'reset_batch': why}} / kvconform_refuses)",
              f"ops: {ctx.case.ops_label()}   [failed at {exc.where}]",
              "likely cause: after reset() the cache still has buffers sized for the previous batch (block tables, "
              "a batch dimension set once): reset() must forget the batch size, as a fresh cache does"],
             {"refused": refusal, "refused_at": exc.where, "failed_at": exc.where, "reference_accepts": True})


# ------------------------------------------------------------------------------------------------ capacity
CAPACITY_WORDS = ("max_cache_len", "capacity", "full", "exceed", "maximum", "too many", "too long", "overflow")


class Overflow:
    """Observer: at the first forward that would hold more than ``cap`` tokens, snapshot the cache (``before``) and
    remember the forward (``pending = (label, held)``); after it, record ``info["overflow"] = (label, held, None,
    [])``."""

    def __init__(self, cap: int, info):
        self.cap, self.info = cap, info
        self.pending: tuple | None = None
        self.before: Any = None  # the snapshot taken with pending

    def before_forward(self, runner, label, n):
        """Snapshot before the first overflowing forward."""
        if self.info is not None and "overflow" not in self.info and self.pending is None \
                and runner.length + n > self.cap:
            self.before, self.pending = snapshot(runner.cache), (label, runner.length)

    def after_forward(self, runner, step):
        """The overflowing forward went through: record it."""
        if self.pending is not None and "overflow" not in self.info:
            self.info["overflow"] = (*self.pending, None, [])


def run_capacity_case(ctx, cache=None, info=None):
    """Build the subject with ``max_cache_len = params.max_cache_len`` (default 12), run the ops; at the first
    forward that would hold more than that many tokens, snapshot the cache and record what happens
    (``info["overflow"] = (label, held, exception or None, changed tensor names)``). A refusal ends the run. Returns
    the steps."""
    cap = ctx.case.params.max_cache_len
    cache = ctx.subject.build(ctx.model, max_cache_len=cap, batch_size=ctx.case.batch,
                              encoder_len=ctx.case.encoder_len)
    probe = Overflow(cap, info)
    runner = Runner(ctx, cache, observers=[probe])
    try:
        runner.run(parked=False)
    except SubjectRaised as exc:
        if probe.pending is None or "overflow" in info or exc.where != probe.pending[0]:
            raise
        info["overflow"] = (*probe.pending, exc.cause, changed(probe.before, snapshot(runner.cache)))
    return runner.steps


def _capacity_case(case):
    """Load-time rule of ``check_capacity`` (``register(validate=...)``): the ops feed more than ``max_cache_len``."""
    cap = case.params.max_cache_len
    total = sum(op.new_tokens for op in case.ops)
    if total <= cap:
        return "ops", (f"check_capacity needs ops feeding more tokens than params.max_cache_len ({cap}); they feed "
                       f"{total}: add decode steps or lower max_cache_len")
    return None


@register("lifecycle", needs=("forward",),
          params={**OP_PARAMS,
                  "max_cache_len": Param(int, default=12, min=1, doc="capacity the subject is built with")},
          ops=OpRule(first="prefill"), validate=_capacity_case)
def check_capacity(ctx):
    """Past the ``max_cache_len`` it was built with, a cache either keeps working exactly or raises a clear error
    before any write — never a raw ``IndexError`` from a tensor op, never a partial write, never wrong logits."""
    cap = ctx.case.params.max_cache_len
    total = sum(op.new_tokens for op in ctx.case.ops)
    if total <= cap:
        raise ValueError(f"case {ctx.case.id}: the ops feed {total} tokens, not more than max_cache_len {cap}")
    info: dict = {}
    try:
        steps = run_capacity_case(ctx, None, info)
    except SubjectRaised as exc:
        fail_raised(ctx, exc, f"the cache fails before reaching its max_cache_len {cap}")
    label, held, refusal, diff = info["overflow"]
    ctx.metrics.update(max_cache_len=cap, refused=refusal is not None, get_max_length=_max_length(ctx))
    where = f"the forward at {label} would hold {held + (1 if label.startswith('decode') else 0)}+ tokens"
    if refusal is not None:
        text = f"{where} > max_cache_len {cap}; it raised {describe_exception(refusal)}"
        # a model written from scratch is judged by the state its refusal leaves (nothing written), not by its
        # message's words (torchtune refuses with a bare assert before writing anything)
        by_state = getattr(ctx.model.model, "adapter", None) is not None and not diff
        if not by_state and (not clear_error(refusal, CAPACITY_WORDS + (str(cap),)) or isinstance(refusal, RAW_ERRORS)):
            try:  # the failure chained to the refusal (__context__): the known-fault judge reads where it raised
                raise refusal
            except Exception:  # noqa: BLE001 - re-raised only to chain it
                ctx.fail([text, "but should raise a clear error naming the capacity before writing anything",
                          f"ops: {ctx.case.ops_label()}   (max_cache_len={cap})",
                          "likely cause: update() writes at index ≥ max_cache_len without checking the capacity "
                          "first" + (f"; it also changed {', '.join(diff[:3])} before raising" if diff else "")],
                         {"raised": type(refusal).__name__, "changed": diff[:10]})
        if diff:
            ctx.fail([text, f"but it changed {', '.join(diff[:4])} before raising",
                      f"ops: {ctx.case.ops_label()}   (max_cache_len={cap})",
                      "likely cause: the capacity check comes after a write (a length counter bumped, a layer "
                      "updated) — the cache is now inconsistent"], {"changed": diff[:10]})
        _judge_capacity_refusal(ctx, text, label, refusal)  # clear and clean: allowed where declared or shared
        return
    verdict = judge(ctx, steps, driver=run_capacity_case)
    record_verdict(ctx, verdict, len(steps))
    if not verdict.passed:
        def cause(step, cmp):
            if step.start + step.length > cap:
                return (f"past max_cache_len {cap} the cache accepted tokens but overwrote or dropped older ones "
                        f"silently: a fixed-size cache must raise a clear error instead")
            return "the cache is wrong before reaching its capacity (see the logits family)"

        fail_verdict(ctx, verdict, cause, ops_text=f"{ctx.case.ops_label()} (max_cache_len={cap})",
                     driver=run_capacity_case)


def _judge_capacity_refusal(ctx, text: str, label: str, refusal) -> None:
    """A refusal past ``max_cache_len`` is the contract's where the subject declares the capacity it enforces
    (``get_max_length()`` ≥ 0, read from a cache built with that ``max_cache_len``) or the reference refuses the same
    forward too (``_refusal.allowed_refusal``); recorded in ``ctx.measured``. A cache that says it is unbounded
    (``get_max_length()`` = -1) and refuses what the reference holds fails here, naming both."""
    declared = ctx.metrics.get("get_max_length")
    by: str | None
    if isinstance(declared, int) and not isinstance(declared, bool) and declared >= 0:
        by = f"subject, declared: get_max_length() = {declared}"
    else:
        def reference_run(ref_ctx):
            info: dict = {}
            run_capacity_case(ref_ctx, None, info)
            over = info.get("overflow")
            if over is not None and over[2] is not None:
                raise SubjectRaised(over[0], over[2])

        allowed = allowed_refusal(ctx, "capacity", reference_run)
        by = allowed.by
        if by is None:
            ctx.fail([text, f"but it declares no maximum (get_max_length() = {declared}) and {allowed.reference} "
                            f"holds those tokens: a refusal is clear only where the cache declares its capacity",
                      f"ops: {ctx.case.ops_label()}   (max_cache_len={ctx.case.params.max_cache_len})",
                      "likely cause: a capacity check the cache does not declare: get_max_length() must return the "
                      "capacity it enforces (or the cache must grow past max_cache_len)"],
                     {"raised": type(refusal).__name__, "failed_at": label, "reference_accepts": True})
    ctx.measured.record(refusal=describe_exception(refusal), refused_by=by)
    ctx.metrics.update(refused_by=by)


def _max_length(ctx):
    try:
        from kvconform.compat import max_length

        cap = ctx.case.params.max_cache_len
        return max_length(ctx.subject.build(ctx.model, max_cache_len=cap, batch_size=ctx.case.batch,
                                            encoder_len=ctx.case.encoder_len))
    except Exception:  # noqa: BLE001 - informational only
        return None

