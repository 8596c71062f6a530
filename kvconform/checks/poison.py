"""Family ``logits``, poisoned capacity: every slot a cache holds storage for but must not read is filled with NaN
(or a large finite value) after every op, and the logits must stay finite and equal the oracle (the unpoisoned run).

A cache that reads a static buffer's tail, a ring's stale entries, the unused slots of its last page or pages freed
by ``crop()`` / ``reset()`` passes every other case whenever those slots hold zeros or plausible old values; here they
hold NaN (``params.value = "nan"``) or ``1e4`` (any number), as vLLM's kernel tests fill them.

Who fills them (``poison_cache``), in this order:

* **the cache's hook**: a cache (or one of its layers) that defines ``kvconform_poison(value: float) -> int`` fills
  every slot it holds no token in — the tail of a preallocated buffer, the rest of a partly filled page, pages on a
  free list, a ring's overwritten entries — with ``value`` and returns how many token slots (summed over rows and
  layers) it filled. Defining it promises that those slots are never read, not even under a mask;
* **kvconform itself**, finite values only, on transformers' fixed-size layers without a hook of their own:
  ``StaticLayer`` keys/values past ``get_seq_length()`` and ``StaticSlidingWindowLayer`` ones while the ring is not
  full, and (``params.pad_slots``) the left-pad positions of each padded row of a ``DynamicLayer`` / ``StaticLayer``.
  Transformers' attention reads a static layer's whole buffer under a mask, where a NaN slot times its zero weight is
  NaN: so those get NaN from no one but their own hook.

An item where nothing could be filled (no hook, no such layer, or a NaN case without a hook) is skipped with the
reason; one whose run never found a slot to fill is skipped too (it would be blind). A lossy subject is compared with
its usual target (its twin or a fresh instance), run without poison.
"""

from __future__ import annotations

import math

from kvconform.checks import OP_PARAMS, OpRule, Param, register
from kvconform.checks._drive import SubjectRaised
from kvconform.checks._diagnosis import fail_raised
from kvconform.checks._interpreter import Runner
from kvconform.checks._judge import judge, record_verdict
from kvconform.checks._measure import layer_list, self_half
from kvconform.checks._observe import up_to_undeclared_op
from kvconform.outcomes import CheckSkipped

HOOK = "kvconform_poison"
"""The optional method a cache or a layer defines: ``kvconform_poison(value: float) -> int`` (see the module
docstring)."""


def _value(ctx) -> float:
    raw = ctx.case.params.value
    return float("nan") if raw == "nan" else float(raw)


def _static_tail(layer) -> tuple[int, int] | None:
    """``(held, capacity)`` of a transformers static layer whose slots ``held … capacity−1`` hold no token, or None
    (not a static layer, not allocated yet, or a full ring)."""
    from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

    if not isinstance(layer, StaticLayer) or not getattr(layer, "is_initialized", False):
        return None
    keys = getattr(layer, "keys", None)
    if keys is None or keys.dim() != 4:
        return None
    capacity = keys.shape[-2]
    if isinstance(layer, StaticSlidingWindowLayer):
        held = int(layer.cumulative_length_int)  # a ring past its window keeps no empty slot (and is rolled)
    else:
        held = int(layer.cumulative_length)
    return (held, capacity) if held < capacity else None


def _pad_counts(mask) -> list[int]:
    """Leading zeros of each row of a ``[B, T]`` attention mask (its left pads)."""
    out = []
    for row in mask.tolist():
        n = 0
        while n < len(row) and row[n] == 0:
            n += 1
        out.append(n)
    return out


def poison_cache(cache, value: float, mask=None) -> tuple[int, str]:
    """Fill the slots ``cache`` must not read with ``value`` (see the module docstring); returns ``(token slots
    filled, who filled them)``: ``"hook"`` (the cache's or its layers' ``kvconform_poison``), ``"static"``
    (kvconform, transformers' static layers and pad slots) or ``""`` (nothing to fill). ``mask``: the run's
    ``[B, T]`` attention mask, or None; its left pads are filled only in layers kvconform fills itself.

    Raises:
        SubjectRaised: the cache's ``kvconform_poison`` raised or returned something else than an int ≥ 0.
    """
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, StaticLayer

    target = self_half(cache)
    hook = getattr(target, HOOK, None)
    if callable(hook):
        return _call_hook(hook, value, type(target).__name__), "hook"
    total, who = 0, ""
    for i, layer in enumerate(layer_list(target)):
        own = getattr(layer, HOOK, None)
        if callable(own):
            total += _call_hook(own, value, f"layers[{i}]")
            who = "hook"
            continue
        if not math.isfinite(value):
            continue
        tail = _static_tail(layer)
        if tail is not None:
            held, capacity = tail
            layer.keys[:, :, held:].fill_(value)
            layer.values[:, :, held:].fill_(value)
            total += (capacity - held) * layer.keys.shape[0]
            who = who or "static"
        plain = (type(layer) is DynamicLayer and not isinstance(layer, DynamicSlidingWindowLayer)) or (
            isinstance(layer, StaticLayer) and not getattr(layer, "is_sliding", False))
        keys = getattr(layer, "keys", None) if plain else None
        if mask is not None and keys is not None and keys.dim() == 4 and keys.shape[-2] >= mask.shape[1]:
            for row, pads in enumerate(_pad_counts(mask)):
                if pads and row < keys.shape[0]:
                    layer.keys[row, :, :pads].fill_(value)
                    layer.values[row, :, :pads].fill_(value)
                    total += pads
                    who = who or "static"
    return total, who


def _call_hook(hook, value: float, where: str) -> int:
    try:
        filled = hook(value)
    except Exception as exc:  # noqa: BLE001 - the subject's own hook: its failure, reported on its item
        raise SubjectRaised(f"{where}.{HOOK}({value})", exc) from exc
    if isinstance(filled, bool) or not isinstance(filled, int) or filled < 0:
        raise SubjectRaised(f"{where}.{HOOK}({value})",
                            TypeError(f"{HOOK}() must return the number of slots it filled (an int ≥ 0), got "
                                      f"{filled!r}"))
    return filled


def can_poison(cache, value: float, padded: bool = False) -> str | None:
    """None when ``poison_cache`` has something to fill in ``cache`` (a hook, or a finite ``value`` and a
    transformers ``StaticLayer``, or a ``DynamicLayer`` on a ``padded`` run), else why not (the skip reason)."""
    from transformers.cache_utils import DynamicLayer, StaticLayer

    target = self_half(cache)
    if callable(getattr(target, HOOK, None)):
        return None
    layers = layer_list(target)
    if any(callable(getattr(layer, HOOK, None)) for layer in layers):
        return None
    name = type(cache).__name__
    adapter = getattr(target, "adapter", None)
    if adapter is not None and hasattr(target, "state"):  # a model adapter's cache: say it in its terms
        return (f"the model adapter {type(adapter).__name__} defines no poison(cache, start, value) method: kvconform "
                f"cannot reach an adapter's unused slots without it (fill every slot the cache holds no token in, "
                f"e.g. a preallocated buffer's tail past start, with value; return how many slots, rows × blocks)")
    if not math.isfinite(value):
        return (f"{name} has no {HOOK}(value) hook: NaN goes only where a cache promises never to read "
                f"(transformers' static layers are read under a mask, where NaN × 0 is NaN); the finite-value "
                f"cases fill its static layers' unused slots instead")
    if any(isinstance(layer, StaticLayer) or (padded and type(layer) is DynamicLayer) for layer in layers):
        return None
    return (f"{name} has no {HOOK}(value) hook and no transformers StaticLayer whose unused slots kvconform could "
            f"fill{'' if padded else ' (a DynamicLayer holds no unused slot outside a left-padded run)'}")


class _Poisoner:
    """A runner observer: after every op, fill the unused slots (``poison_cache``); after every forward of a NaN
    case, forget a NaN the cache *holds* (it was put there) — one that ``update()`` *returned* stays the step's
    fault."""

    def __init__(self, value: float):
        self.value = value
        self.filled: list[tuple[str, int]] = []  # (op label, slots filled after it)
        self.who = ""

    def after_op(self, runner, op, op_index) -> None:
        n, who = poison_cache(runner.cache, self.value, runner.mask)
        self.who = self.who or who
        self.filled.append((op.label, n))

    def after_forward(self, runner, step) -> None:
        if math.isnan(self.value) and step.nonfinite and not step.nonfinite.startswith("update("):
            step.nonfinite = None


def _cause(poisoner: _Poisoner, step, value: float) -> str:
    before = [label for label, _ in poisoner.filled]
    upto = before[: step.op_index] if step.op_index is not None else before
    freed = [label for label in upto if label.startswith(("crop", "reset"))]
    what = "NaN" if math.isnan(value) else f"{value:g}"
    if freed:
        return (f"the cache reads slots it freed: after {freed[-1]} its unused slots (pages freed by {freed[-1]}, a "
                f"buffer's tail) were filled with {what} and {step.label} read them — a page returned to the free "
                f"list (or a cropped tail) is still attended, or still listed in a row's block table")
    return (f"the cache reads slots it holds no token in: its unused slots (a preallocated buffer's tail, the rest of "
            f"its last page, a ring's stale entries) were filled with {what} and {step.label} read them — an attention "
            f"read that covers capacity, whole pages or a stale ring entry instead of the tokens held (a mask does not "
            f"help: NaN × 0 is NaN)")


VALUE = Param((str, float), default="nan", doc='"nan" or a finite number (e.g. 1e4) written into every unused slot')


def _validate(case):
    value = case.params.value
    if isinstance(value, str) and value != "nan":
        return "value", f'check_poisoned_capacity takes value = "nan" or a number; got {value!r}'
    if not isinstance(value, str) and not math.isfinite(float(value)):
        return "value", 'check_poisoned_capacity takes value = "nan" or a finite number (inf: write "nan")'
    return None


@register("logits", reads_position_ids=True, needs=("forward",), params={**OP_PARAMS, "value": VALUE},
          ops=OpRule(first="prefill", why="it fills the unused slots after every op, from the prefill on"),
          validate=_validate)
def check_poisoned_capacity(ctx):
    """After every op, every slot the cache must not read is filled with NaN or a large finite value (the cache's
    ``kvconform_poison(value)`` hook, or kvconform on transformers' static layers); every step's logits must be finite
    and equal the oracle's. A subject that does not declare the capability an op needs (``crop``, ``reset``) is run
    up to the case's first such op."""
    ctx = up_to_undeclared_op(ctx)
    value = _value(ctx)
    cache = ctx.new_cache()
    reason = can_poison(cache, value, bool(ctx.case.params.get("padding")))
    if reason:
        raise CheckSkipped(reason)
    poisoner = _Poisoner(value)
    runner = Runner(ctx, cache, observers=[poisoner])
    try:
        steps = runner.run()
    except SubjectRaised as exc:
        fail_raised(ctx, exc, "the cache does not support this sequence of calls with its unused slots filled "
                              f"({HOOK}, see the exception)")
    slots = sum(n for _, n in poisoner.filled)
    if not slots:
        raise CheckSkipped(f"{type(cache).__name__} held no unused slot to fill during {ctx.case.ops_label()}")
    verdict = judge(ctx, steps)
    record_verdict(ctx, verdict, len(steps), poisoned_slots=slots, poisoned_by=poisoner.who)
    if verdict.passed:
        return
    step, cmp = verdict.first_fail  # type: ignore[misc]  # set where the verdict did not pass
    observed = "NaN/inf" if not math.isfinite(cmp.max_abs) else f"{cmp.max_abs:.1e}"
    filled = ", ".join(f"{label}: {n}" for label, n in poisoner.filled if n)
    who = f"its {HOOK}() hook" if poisoner.who == "hook" else "kvconform (transformers' static layers)"
    ctx.fail([f"max|Δlogit| = {observed}{ctx.kind.versus} with the unused slots filled with "
              f"{'NaN' if math.isnan(value) else f'{value:g}'}, but should be ≤ {cmp.tol:.1e} "
              f"({ctx.tolerance().describe(cmp.floor)})",
              f"ops: {ctx.case.ops_label()}   [failed at {step.label}]",
              f"slots filled by {who} after each op: {filled}",
              f"measured in the cache at {step.label}: {step.nonfinite}" if step.nonfinite else "",
              "likely cause: " + _cause(poisoner, step, value)],
             {"max_abs": cmp.max_abs, "failed_at": step.label, "poisoned_slots": slots})
