"""``run_observed``: the interpreter over prefill / chunk / decode ops with a probe after every forward, shared by
``contract.check_encoder_decoder_subcaches`` (sub-cache lengths) and ``memory.check_offloaded_matches`` (GPU
peak); ``measured_at_batch_one``: a memory or compression check re-run at batch 1 where the subject raised at the
case's batch, shared by the memory and quality families."""

from __future__ import annotations

from kvconform.checks._interpreter import Runner
from kvconform.ops import FORWARD_OPS  # noqa: F401 - the ops run_observed accepts (re-exported)



class AfterForward:
    """Observer calling ``fn(step)`` after every forward of a ``Runner``."""

    def __init__(self, fn):
        self.fn = fn

    def after_forward(self, runner, step):
        """Call the probe with the ``Step`` just recorded."""
        self.fn(step)


def run_observed(ctx, cache, after_step):
    """The case's ops (prefill / chunk / decode only, no padding) on ``cache`` through the interpreter, calling
    ``after_step(step)`` after every forward (probes of the cache's state or of GPU memory); returns the steps and
    sets ``ctx.encoder_ids``.

    Raises:
        SubjectRaised: the subject's exceptions (names the op).
        ValueError: an op other than prefill / chunk / decode.
    """
    runner = Runner(ctx, cache, padding=[], observers=[AfterForward(after_step)], allowed_ops=FORWARD_OPS)
    steps = runner.run(parked=False)
    ctx.encoder_ids = runner.encoder_ids
    return steps


# ------------------------------------------------------------------------------------------ batch 1 as well
AT_BATCH_ONE = "_kvconform_at_batch_one"
"""Set on the context of a measurement re-run at batch 1 (``measured_at_batch_one``): it does not fall back again."""


def at_batch(ctx, batch: int):
    """A shallow copy of ``ctx`` whose case runs at ``batch`` rows (the caller's context is not changed; the copy
    shares its ``metrics``)."""
    import dataclasses

    return ctx.replace(case=dataclasses.replace(ctx.case, batch=batch))


def _with_line(err, line: str, **metrics):
    """``err`` (a ``ConformanceError``) with ``line`` inserted after its headline, same type, its metrics updated
    with ``metrics``."""
    text = str(err)
    head, _, rest = text.partition("\n")
    return type(err)(f"{head}\n  {line}\n{rest}" if rest else f"{head}\n  {line}",
                     {**dict(getattr(err, "metrics", {})), **metrics})


def measured_at_batch_one(ctx, exc, check, fail, summary) -> None:
    """Where a memory or compression case raised at batch ``B > 1`` (``exc``, a ``SubjectRaised``), the same check
    measured at batch 1, so that a subject that cannot run a batch still gets a verdict on its bytes. Always raises.

    Args:
        check: the check function, run again on ``at_batch(ctx, 1)``.
        fail: ``fail(ctx, exc)``, raising the batch-``B`` failure (the subject raised).
        summary: ``summary(metrics) -> str``, the batch-1 measurement in one phrase (for a batch-1 pass).

    Raises:
        ConformanceError: the batch-1 bytes' failure, with a line saying that batch ``B`` raised; or, when batch 1 is
            within its bound, the batch-``B`` failure with a line giving the batch-1 measurement; or, when batch 1
            raises too, the batch-``B`` failure saying so.
        SubjectRaised / CheckSkipped / ConformanceError: as ``fail`` when ``B`` is 1 or the context is already the
            batch-1 re-run.
    """
    B = int(ctx.case.batch)
    two_rows = any(op.spec.min_batch > 1 for op in ctx.case.ops)  # beam_fork, swap_rows: no batch-1 equivalent
    if B <= 1 or two_rows or getattr(ctx, AT_BATCH_ONE, False):
        fail(ctx, exc)
        return
    one = at_batch(ctx, 1)
    setattr(one, AT_BATCH_ONE, True)
    raised = f"{type(exc.cause).__name__} at {exc.where}"
    try:
        check(one)
    except AssertionError as err:
        if not hasattr(err, "metrics"):
            raise
        if err.metrics.get("raised"):  # it raises at batch 1 too: no bytes to judge; the batch-B raise stands
            again = f"{err.metrics['raised']} at {err.metrics.get('failed_at', '?')}"
            try:
                fail(ctx, exc)
            except AssertionError as first:
                if not hasattr(first, "metrics"):
                    raise
                raise _with_line(first, f"at batch 1 it raises too ({again}): no bytes measured") from None
        ctx.metrics.update(measured_batch=1, raised_at_batch=B)
        raise _with_line(err, f"measured at batch 1: at batch {B} the subject raised {raised} (its failure at batch "
                              f"{B} is this item's too; the bytes below are measured where it runs)",
                         measured_batch=1, raised_at_batch=B) from None
    ctx.metrics["measured_batch_one"] = summary(ctx.metrics)
    try:
        fail(ctx, exc)
    except AssertionError as err:
        if not hasattr(err, "metrics"):
            raise
        raise _with_line(err, f"at batch 1 it runs, and its bytes are within the bound: {summary(ctx.metrics)}") \
            from None


def up_to_undeclared_op(ctx):
    """``ctx``, or a view of it whose case stops before the first op needing a capability the subject does not
    declare (``ops.OP_CAPABILITY``: ``crop``, ``reset``, ``reorder``, ...), for the checks that measure what a subject
    does with the ops it has (memory bytes, poisoned capacity) rather than whether it has them. The view shares the
    caller's metrics and gets a ``note`` saying where it stopped; the context itself is not changed."""
    import dataclasses

    from kvconform.ops import OP_CAPABILITY

    capabilities = ctx.subject.capabilities
    stop = next((i for i, op in enumerate(ctx.case.ops)
                 if OP_CAPABILITY.get(op.name) and OP_CAPABILITY[op.name] not in capabilities), None)
    if stop is None:
        return ctx
    op = ctx.case.ops[stop]
    view = ctx.replace(case=dataclasses.replace(ctx.case, ops=ctx.case.ops[:stop]))
    view.metrics["note"] = (f"{ctx.subject.name} does not declare {OP_CAPABILITY[op.name]!r}: measured up to the "
                            f"first {op.name}")
    return view
