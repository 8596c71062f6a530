"""Twin targets: the judge's target for a lossy subject, its fake-quant twin run on the same ops.

The bottom of the checks package's private modules: it imports nothing from ``kvconform.checks``. The op runner
that replays a case on the twin is passed in (``driver``) by the caller — ``_judge.judge`` passes
``_interpreter.run_ops`` —
so that this module stays below the engine (see ARCHITECTURE.md and the import contract in pyproject.toml).
"""

from __future__ import annotations


import torch

from kvconform.subjects import kind_of


def twin_targets(ctx, spec, steps, driver) -> dict:
    """``{step.index: (target, floor_reference)}`` for judging a lossy subject, both ``[B, length, V]`` float64.

    ``driver``: ``fn(ctx, cache) -> steps``, how the twin replays the ops that produced ``steps`` (the checks pass
    ``_interpreter.run_ops`` or their own driver).

    ``target``: the twin's logits from the same ops (``driver``) on a fresh twin, with
    the same model in the same dtype on the same device — a faithful subject reproduces them (measured: bit for bit
    for quanto, HQQ and fp8 on CPU). ``floor_reference = target + (uncached − oracle)``, so that
    ``compare_logits`` takes the *exact path's* noise floor ``|uncached − oracle|`` of the step's sequence:
    ``max|subject − twin| ≤ max(k · floor, abs_min)``, as tight as an exact cache against the oracle.

    Why not the twin on the float64 model as the target: float32 and float64 quantization round a few elements
    across a bin boundary differently, and such a flip moves logits by 1e-3 … 2e-1 (measured on the zoo, HQQ
    most), which would inflate the floor — and the tolerance — far above the faults the twin is there to see. A
    lossy subject whose own arithmetic differs from its twin (another kernel) declares a larger
    ``CacheSpec.tolerance_factor``.

    Raises:
        RuntimeError: the twin run does not replay ``steps`` (different count, lengths or tokens): the calling check
            feeds tokens some other way than ``driver`` and cannot judge a lossy subject.
    """
    twin_spec = kind_of(spec).twin_spec()
    tctx = ctx.replace(subject=twin_spec, metrics={})
    twin_steps = driver(tctx, tctx.new_cache())
    enc = tctx.encoder_ids
    out = {}
    for step in steps:
        twin = twin_steps[step.index] if step.index < len(twin_steps) else None
        if twin is None or (twin.start, twin.length) != (step.start, step.length) or not torch.equal(twin.seq,
                                                                                                       step.seq):
            raise RuntimeError(f"kvconform: {ctx.check_name} cannot judge the lossy subject {spec.name}: its step "
                               f"{step.index} ({step.label}) is not reproduced by replaying case {ctx.case.id} on "
                               f"the fake-quant twin")
        sl = slice(step.start, step.start + step.length)
        noise = (ctx.oracle.uncached(step.seq, encoder_ids=enc)[:, sl] - ctx.oracle.logits(step.seq,
                                                                                           encoder_ids=enc)[:, sl])
        out[step.index] = (twin.logits, twin.logits + noise)
    return out
