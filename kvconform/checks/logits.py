"""Family ``logits``: cached forward logits equal the uncached float64 oracle at every step.

``check_prefill_then_decode`` and ``check_chunked_continuation`` drive ``model.forward(..., cache=subject)`` in a
manual loop, as callers outside ``generate`` do, with explicit ``position_ids`` or without them (then the model
derives positions from ``cache.get_seq_length()``). ``check_mamba_kernel_paths`` (CUDA + ``[mamba]``): Mamba /
Mamba2 through the mamba-ssm / causal-conv1d kernels and through transformers' torch fallbacks both match the
oracle.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import sys
from typing import Any

from kvconform.checks import OP_PARAMS, OpRule, Param, register
from kvconform.checks._drive import SubjectRaised
from kvconform.checks._interpreter import run_ops
from kvconform.checks._judge import judge, record_verdict
from kvconform.checks._diagnosis import (describe_raise, fail_raised, fail_verdict, positions_label,
                                         sliding_window_slots)
from kvconform.outcomes import CheckSkipped


def _length_note(steps, upto) -> str | None:
    for step in steps[: upto.index + 1]:
        fed = step.start + step.length
        if step.reported_length is not None and step.reported_length != fed:
            return (f"get_seq_length() returned {step.reported_length} after {fed} tokens were fed "
                    f"(at {step.label}), so positions derived from it are off")
    return None


def _twin_cause(ctx, step) -> str:
    """The likely cause of a lossy subject that departs from its fake-quant twin (the quantization it declares) at
    ``step``: from the first tokens it reads back (another quantization), or only later (another flush schedule)."""
    qc = ctx.kind.quant_config
    residual = getattr(qc, "residual_length", None)
    if step.label.startswith("prefill") or step.index == 1:
        return ("the subject's keys/values differ from its declared quantization (its fake-quant twin) as soon as "
                "it reads stored tokens back: another bit width, group size, axis or scale than it declares")
    return (f"the subject matches its fake-quant twin for the first {step.start} positions and departs from it at "
            f"position {step.start}: it quantizes at other steps than it declares — its residual flush"
            + (f" (residual_length {residual})" if residual else "") + " comes earlier or later, or other tokens "
            "are kept exact")


def _narrow_cause(ctx, cache) -> str | None:
    """The likely cause when the cache stores floating tensors narrower than the model's dtype (measured)."""
    if cache is None:
        return None
    from kvconform.checks._measure import narrow_stored

    narrow = narrow_stored(cache, ctx.model.dtype)
    if not narrow:
        return None
    kinds = sorted({str(d).removeprefix("torch.") for _, d in narrow})
    paths = ", ".join(p for p, _ in narrow[:2]) + (", ..." if len(narrow) > 2 else "")
    return (f"the cache stores keys/values as {'/'.join(kinds)} ({paths}), narrower than the model's "
            f"{str(ctx.model.dtype).removeprefix('torch.')}: every read gives them back rounded — store them in the "
            f"dtype update() receives. Only if the narrow dtype is the design (a memory saving: the memory items "
            f"then measure fewer bytes than full-precision keys/values) declare the cache lossy (kvconform_lossy); "
            f"a cache meant to be exact has a bug here that a declaration would hide")


def _decode_cause(ctx, steps, cache=None):
    def cause(step, cmp):
        note = _length_note(steps, step)
        if note and not positions_label(ctx).startswith("explicit"):
            return note
        if ctx.kind.has_twin:
            return _twin_cause(ctx, step)
        narrow = _narrow_cause(ctx, cache)
        if narrow:
            return narrow
        ring = _window_cause(ctx, steps, cache)
        if ring:
            return ring
        if step.label in ("decode 1",) or step.label.startswith("chunk") and step.index == 1:
            return "the prefill's keys/values (or states) were not stored intact: a dropped, shifted or stale token"
        if step.label.startswith("prefill"):
            return "the prefill itself is wrong: update() returns keys/values that differ from the ones passed in"
        good = step.start
        window = ctx.model.sliding_window
        if window and good >= window - 1:
            return (f"correct up to position {good - 1}, wrong after: the sliding window (size {window}) keeps the "
                    f"wrong number of past tokens")
        return (f"correct for the first {good} positions, wrong from position {good}: older tokens are being "
                f"evicted or overwritten (a hidden window or a capacity bug)")

    return cause


def run_recorded(ctx, cache):
    """``run_ops`` after ``activate_past_recording()`` when the case asks for it (``params.record``), as
    speculative-decoding callers do before any crop; the same driver replays the case on the reference and twins."""
    if ctx.case.params.get("record"):
        if not hasattr(cache, "activate_past_recording"):
            raise CheckSkipped(f"{type(cache).__name__} has no activate_past_recording() (the installed "
                               f"transformers has no past recording)")
        try:
            cache.activate_past_recording()
        except Exception as exc:  # noqa: BLE001 - the subject's failure, reported on its item
            raise SubjectRaised("activate_past_recording()", exc) from exc
    return run_ops(ctx, cache)


def _run(ctx, cause_for):
    cache = ctx.new_cache()
    try:
        steps = run_recorded(ctx, cache)
    except SubjectRaised as exc:
        fail_raised(ctx, exc, "the cache does not support this sequence of calls (see the exception)")
    verdict = judge(ctx, steps, driver=run_recorded)
    record_verdict(ctx, verdict, len(steps))
    if not verdict.passed:
        fail_verdict(ctx, verdict, cause_for(ctx, steps, cache), driver=run_recorded)
    _judge_half_store(ctx, cache, verdict)


def _judge_half_store(ctx, cache, verdict) -> None:
    """At a 16-bit case dtype, an exact subject that holds its keys/values less precisely than the model computes
    (bfloat16 storage on a float16 model: 3 mantissa bits fewer) fails even within the logit tolerance: there its
    rounding (measured 2.7× the fp16 noise floor on llama) is too close to the dtype's own noise for the logits to
    resolve, yet every read returns rounded keys. float32 and float64 cases judge it by the logits alone (there the
    same fault is 1e4× the noise floor)."""
    if ctx.kind.lossy or ctx.model.dtype.itemsize != 2:  # a 16-bit dtype of oracle.DTYPES (bfloat16, float16)
        return
    cause = _narrow_cause(ctx, cache)
    if cause is None:
        return
    cmp = verdict.worst[1] if verdict.worst else None
    within = (f"max|Δlogit| = {cmp.max_abs:.1e} is within the {ctx.case.dtype} tolerance {cmp.tol:.1e} (noise floor "
              f"{cmp.floor:.1e}), " if cmp is not None else "")
    ctx.fail([f"{within}but an exact cache must give back the keys/values update() was given, and this one holds them "
              f"less precisely than the model's {str(ctx.model.dtype).removeprefix('torch.')}",
              f"ops: {ctx.case.ops_label()}",
              "likely cause: " + cause],
             {"max_abs": cmp.max_abs if cmp is not None else None,
              "tolerance": cmp.tol if cmp is not None else None,
              "noise_floor": cmp.floor if cmp is not None else None, "narrow_store": True})


RECORD = Param(bool, default=False, doc="call activate_past_recording() before the first op (no crop follows)")


@register("logits", reads_position_ids=True, needs=("forward",), params={**OP_PARAMS, "record": RECORD},
          ops=OpRule(first="prefill", why="it compares every step after a prefill"))
def check_prefill_then_decode(ctx):
    """Prefill, then single-token decode steps: every step's logits equal the oracle's."""
    if not ctx.case.ops or ctx.case.ops[0].name != "prefill":
        raise ValueError(f"case {ctx.case.id}: check_prefill_then_decode needs ops starting with 'prefill N'")
    _run(ctx, _decode_cause)


def _window_cause(ctx, steps, cache) -> str | None:
    """What the sliding layers hold after the run (``_diagnosis.sliding_window_slots``), for an exact subject on an
    unpadded run of a model with a sliding window; None otherwise."""
    if cache is None or not steps or not ctx.model.sliding_window or steps[-1].mask is not None:
        return None
    return sliding_window_slots(ctx, cache, steps[-1].seq)


def _chunk_cause(ctx, steps, cache=None):
    base = _decode_cause(ctx, steps, cache)

    def cause(step, cmp):
        ring = None if ctx.kind.has_twin else _window_cause(ctx, steps, cache)
        if ring:
            return ring
        if step.label.startswith("chunk") and step.index > 0:
            return (f"feeding {step.length} tokens at once into a warm cache loses or misplaces state: "
                    f"update() with k>1 new tokens after the prefill is wrong")
        return base(step, cmp)

    return cause


@register("logits", reads_position_ids=True, needs=("forward",), params=OP_PARAMS,
          ops=OpRule(required=("chunk",), why="it checks chunked continuation"))
def check_chunked_continuation(ctx):
    """Prefill, then chunks of k>1 tokens into the warm cache (incl. chunks straddling the sliding window)."""
    if not any(op.name == "chunk" for op in ctx.case.ops):
        raise ValueError(f"case {ctx.case.id}: check_chunked_continuation needs at least one 'chunk N' op")
    _run(ctx, _chunk_cause)


# ------------------------------------------------------------------------------------------ mamba-ssm kernels (CUDA)
MAMBA_REASON = "mamba-ssm kernels need CUDA and the [mamba] extra (pip install kvconform[mamba])"


def _kernels_available(device) -> bool:
    from kvconform.compat import on_cuda

    return (on_cuda(device)
            and importlib.util.find_spec("mamba_ssm") is not None
            and importlib.util.find_spec("causal_conv1d") is not None)


def _mamba_row(subject, model, case, device="cpu"):
    return None if _kernels_available(device) else MAMBA_REASON


def _dispatch_function(obj, module_name: str):
    """The function behind a module-level kernel dispatcher ``obj`` of the module ``module_name``, or None: ``obj``
    itself when it is a plain function of that module; the function a ``kernels`` function module wraps when
    ``obj`` is one (with the ``kernels`` package installed, transformers' ``use_kernel_forward_from_hub`` turns each
    dispatcher into an instance of an ``nn.Module`` class whose ``forward`` calls the function, ``func``, from its
    closure)."""
    if inspect.isfunction(obj):
        return obj if obj.__module__ == module_name else None
    forward = getattr(type(obj), "forward", None)
    if not inspect.isfunction(forward) or not forward.__closure__:
        return None
    inner = inspect.getclosurevars(forward).nonlocals.get("func")
    return inner if inspect.isfunction(inner) and inner.__module__ == module_name else None


def _dispatchers(module) -> dict:
    """``{name: (dispatcher, torch fallback, uses a kernel)}`` of the kernel-dispatching names of a modeling module
    (``use_kernel_func_from_hub_with_fallback``: the kernel was bound at import when its package imported), whether
    a name holds the dispatching function itself or, with ``kernels`` installed, the ``nn.Module`` wrapping it
    (``_dispatch_function``). The dispatcher is what the module holds (rebound by ``_torch_path``)."""
    out = {}
    for name, obj in vars(module).items():
        fn = _dispatch_function(obj, module.__name__)
        if fn is None:
            continue
        fallback = inspect.unwrap(fn)
        if fallback is fn:
            continue
        uses_kernel = False
        f: Any = fn
        while f is not None:
            free = inspect.getclosurevars(f).nonlocals if f.__closure__ else {}
            if "is_new_implementation" in free:
                uses_kernel = bool(free["is_new_implementation"])
                break
            f = getattr(f, "__wrapped__", None)
        out[name] = (obj, fallback, uses_kernel)
    return out


@contextlib.contextmanager
def _torch_path(module, dispatchers):
    """Temporarily rebind the module's kernel dispatchers to transformers' torch fallbacks."""
    saved = {name: fn for name, (fn, _, _) in dispatchers.items()}
    try:
        for name, (_, fallback, _) in dispatchers.items():
            setattr(module, name, fallback)
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


@register("logits", reads_position_ids=True, needs=("forward",), applies=_mamba_row, params=OP_PARAMS,
          ops=OpRule(min_forwards=1), transformers_only="transformers' Mamba kernels")
def check_mamba_kernel_paths(ctx):
    """Mamba / Mamba2 on CUDA with mamba-ssm and causal-conv1d installed: the run through the kernels and the run
    through transformers' torch fallbacks (same cache subject, same ops) both match the oracle."""
    module = sys.modules[type(ctx.model.model).__module__]
    dispatchers = _dispatchers(module)
    kernels = sorted(name for name, (_, _, uses) in dispatchers.items() if uses)
    ctx.metrics.update(kernels=kernels)
    if not kernels:
        ctx.fail([f"{module.__name__} bound no mamba-ssm / causal-conv1d kernel although both import",
                  "likely cause: transformers could not import the kernels it expects from these packages "
                  "(version mismatch); the torch fallback is all that runs"])
    for label, patch in (("kernels", contextlib.nullcontext()), ("torch fallback", _torch_path(module, dispatchers))):
        with patch:
            try:
                steps = run_ops(ctx, ctx.new_cache())
            except SubjectRaised as exc:
                ctx.fail([f"the {label} path raised {describe_raise(exc)}", f"ops: {ctx.case.ops_label()}",
                          f"likely cause: the cache does not give the {label} path the states it expects"])
        verdict = judge(ctx, steps)
        _, cmp = verdict.first_fail or verdict.worst  # type: ignore[misc]  # judge() of one step or more sets worst
        ctx.metrics[f"max_abs_{label.split()[0]}"] = cmp.max_abs
        if not verdict.passed:
            step, bad = verdict.first_fail  # type: ignore[misc]  # set where the verdict did not pass
            ctx.fail([f"{label} path: max|Δlogit| = {bad.max_abs:.1e} at {step.label}, but should be ≤ "
                      f"{bad.tol:.1e} ({ctx.tolerance().describe(bad.floor)})",
                      f"ops: {ctx.case.ops_label()}; kernels: {', '.join(kernels)}",
                      f"likely cause: the {label} path reads or writes the conv / recurrent state differently "
                      "from what the cache holds"])
