"""Family ``quality``: lossy and evicting subjects, judged by what they promise (their ``Budget``) instead of exactness.

A subject declares ``kind="lossy"`` or ``kind="evicting"`` with a ``kvconform.Budget`` (``CacheSpec(kind=...,
budget=...)``, or ``kvconform_lossy = {...}`` / ``kvconform_evicting = {...}`` on its class or factory). Its cases
(``conformance_cases/quality.toml``) go well past the exact window such caches keep (transformers' and turboquant's
quantized caches keep the last 128 tokens exact), so that the compressor or the eviction is reached:

* ``check_quality_budget`` (lossy and evicting): the next-token distributions of every position that read the cache
  (every forward after the first) against the float64 oracle: mean KL(oracle ‖ subject) ≤ ``budget.kl_max`` nats
  and top-1 agreement ≥ ``budget.top1_min``. When it fails, a subject with a fake-quant twin (``CacheSpec.twin``) has
  its twin's quality in the message too (is the loss the declared quantization's, or the subject's own?).
* ``check_compression_real`` (lossy): the bytes the cache holds after the long context (``_measure.held_bytes``: every
  reachable tensor once per storage, quanto's / HQQ's packed tensors through their inner data and scales) are fewer
  than an exact cache must hold after the same ops (every token's keys and values of a full-attention layer, the
  window of a sliding layer, the linear-attention states), and ≤ ``budget.bytes_ratio_max`` of it when declared. A
  "quantized" cache that also keeps a full-precision copy, or that never quantizes, fails here even though its
  quality is perfect. A compressed cache that keeps the whole history of a sliding layer may hold more than
  ``DynamicCache`` does: it fails here too, with that cause.
* ``check_memory_bound`` (evicting): the bytes held after the long context are ≤ what ``budget.tokens_max`` tokens'
  keys and values take in each attention layer, plus each layer's linear-attention states (hybrid models).

Per-token bytes and state sizes are measured on kvconform's ``ReferenceCache`` run on the same ops (it keeps
exactly what the model hands it), so no table of config attribute names is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvconform.checks import ALL_KINDS, EVICTING, OpRule, Param, register
from kvconform.checks._drive import SubjectRaised, measure_reference
from kvconform.checks._measure import (cache_layers, held_bytes, held_tensor_items, largest_holdings, layer_bytes,
                                       owned_by_model, storage_bytes)
from kvconform.checks._lossy import LOSSY_OPS, drive, fail_subject_raised, oracle_slices, twin_spec
from kvconform.checks._observe import measured_at_batch_one
from kvconform.memo import MEMO
from kvconform.subjects import kind_of

DEFAULT_SLACK_BYTES = 256
LONG_CONTEXT_RULE = OpRule(allowed=LOSSY_OPS, min_forwards=2, why="it judges every position after the first forward")
"""What the quality family's checks need of a case: the ops their driver runs, and a forward after the first."""


# ------------------------------------------------------------------------------------------ applicability
def _declares_no_budget(subject, model, case, device="cpu") -> str | None:
    """Applicability rule of ``check_quality_budget`` on a lossy kind (``BUDGETED``): a subject that declares no
    budget (an exact declaration with a fake-quant twin) is judged only on a case that gives ``kl_max`` and
    ``top1_min``."""
    if subject.budget is None and not {"kl_max", "top1_min"} <= set(case.params or {}):
        return (f"{subject.name} declares no quality budget: declare kind='lossy' (or 'evicting') with "
                f"budget=kvconform.Budget(kl_max=..., top1_min=...)")
    return None


BUDGETED = {"lossy": "applies to lossy and evicting subjects only (CacheSpec kind='lossy' or 'evicting', with a "
                     "Budget)"}
"""``facts=`` of ``check_quality_budget``: the lossy kinds (``Kind.lossy``: lossy, evicting, press, a fake-quant
twin); of those, ``_declares_no_budget`` skips a subject with no budget and a case that gives none."""

COMPRESSING = {"compresses": {EVICTING: "{subject} is evicting: its bytes are bounded by check_memory_bound "
                                        "(budget.tokens_max)",
                              "*": "applies to lossy subjects only (CacheSpec kind='lossy')"}}
"""``facts=`` of ``check_compression_real``: the kinds that must hold fewer bytes than an exact cache
(``Kind.compresses``: lossy, press, a fake-quant twin)."""


def _compression_judged(subject, model, case, device="cpu"):
    """Applicability rule of ``check_compression_real`` on a kind that compresses (``COMPRESSING``): its budget
    promises a memory saving (``Budget.saves_memory``), on a model with attention layers (a Mamba-style model holds
    only fixed-size states: nothing for a key/value compressor to compress)."""
    if not kind_of(subject).saves_memory:
        return (f"{subject.name} promises no memory saving (saves_memory=False in its budget): its held bytes are not "
                f"judged against an exact cache's; its quality (check_quality_budget) and self-consistency are")
    if "attention" not in model.features:
        return (f"{model.name} has no attention layers: no keys or values to compress (its linear-attention "
                f"states are fixed-size), so compression is not judged on it")
    return None


EVICTING_ONLY = "applies to evicting subjects only (CacheSpec kind='evicting' with budget.tokens_max)"
"""The skip reason of ``check_memory_bound`` (``judges=(EVICTING,)``) on every other kind."""


# ------------------------------------------------------------------------------------------ quality budget
def _budget(ctx) -> tuple[float, float, str]:
    """``(kl_max, top1_min, where from)``: the subject's ``Budget``, each value replaced by the case's ``params``
    ``kl_max`` / ``top1_min`` where the case gives it (a case may tighten or loosen a budget)."""
    budget, params = ctx.subject.budget, ctx.case.params or {}
    kl_max = params.get("kl_max", getattr(budget, "kl_max", None))
    top1_min = params.get("top1_min", getattr(budget, "top1_min", None))
    if kl_max is None or top1_min is None:
        raise ValueError(f"case {ctx.case.id}: {ctx.subject.name} declares no quality budget; declare kind='lossy' "
                         f"with budget=kvconform.Budget(kl_max=..., top1_min=...)")
    overridden = [k for k in ("kl_max", "top1_min") if k in params]
    source = f"case {ctx.case.id} params ({', '.join(overridden)})" if overridden else f"{ctx.subject.name}'s budget"
    return float(kl_max), float(top1_min), source  # a budget's own values may be ints


def _cache_positions(steps):
    """Logits ``[B, N, V]`` of every position fed after the first forward (the ones that read the cache)."""
    import torch

    return torch.cat([s.logits for s in steps[1:]], dim=1)


def _per_op(ctx, steps, oracle_by_step) -> str:
    """Mean KL per op of the case after the first forward (``"decode×8: 1.2e-03, chunk(48): ..."``)."""
    import torch

    from kvconform.quant import quality_metrics

    groups: dict = {}
    for s in steps[1:]:
        groups.setdefault(s.op_index, []).append(s)
    parts = []
    for op_index, group in groups.items():
        obs = torch.cat([s.logits for s in group], dim=1)
        ref = torch.cat([oracle_by_step[s.index] for s in group], dim=1)
        parts.append(f"{ctx.case.ops[op_index].label}: {quality_metrics(obs, ref)['kl_mean']:.1e}")
    return ", ".join(parts)


@register("quality", cost=4.0, needs=("forward",), judges=ALL_KINDS, facts=BUDGETED, applies=_declares_no_budget,
          params={
    "kl_max": Param(float, min=0, doc="replaces the subject's budget.kl_max (mean KL(oracle ‖ subject), nats)"),
    "top1_min": Param(float, min=0, max=1, doc="replaces the subject's budget.top1_min (top-1 agreement)"),
}, ops=LONG_CONTEXT_RULE)
def check_quality_budget(ctx):
    """A lossy or evicting subject's next-token distributions stay within its budget of the float64 oracle: mean
    KL(oracle ‖ subject) ≤ ``budget.kl_max`` nats and top-1 agreement ≥ ``budget.top1_min``, over every position
    that read the cache (all forwards after the first; ``[B, N]`` positions). A case may replace either bound
    (``params``). On a failure, a subject with a fake-quant twin has the twin's own quality on the same ops in the
    message and metrics (``twin_kl_mean``, ``twin_top1``): is the loss the declared quantization's, or the
    subject's?"""
    import torch

    from kvconform.quant import quality_metrics

    kl_max, top1_min, source = _budget(ctx)
    try:
        steps = drive(ctx, ctx.new_cache())
    except SubjectRaised as exc:
        fail_subject_raised(ctx, exc, "the cache does not support this sequence of calls (see the exception)")
    if len(steps) < 2:
        raise ValueError(f"case {ctx.case.id}: check_quality_budget needs ops after the first forward")
    exact = oracle_slices(ctx, steps)
    oracle_by_step = {s.index: exact[s.index][0] for s in steps}
    oracle = torch.cat([oracle_by_step[s.index] for s in steps[1:]], dim=1)
    q = quality_metrics(_cache_positions(steps), oracle)
    ctx.metrics.update(kl_mean=q["kl_mean"], kl_worst=q["kl_worst"], top1=q["top1"], positions=q["positions"],
                       kl_max=kl_max, top1_min=top1_min, tokens=int(steps[-1].seq.shape[1]))
    if q["kl_mean"] <= kl_max and q["top1"] >= top1_min:
        return
    # the budget is the subject's loss on top of what an exact cache gets on this model: where kvconform's reference
    # cache is not exact here (the model's own known fault), its KL and top-1 are the baseline
    rq = _reference_quality(ctx, oracle)
    if rq is not None:
        ctx.metrics.update(reference_kl_mean=rq["kl_mean"], reference_top1=rq["top1"])
        if q["kl_mean"] - rq["kl_mean"] <= kl_max and q["top1"] >= rq["top1"] - (1 - top1_min):
            ctx.metrics.update(note=f"{ctx.reference.name} itself gets KL {rq['kl_mean']:.2e}, top-1 "
                                    f"{rq['top1']:.3f} on this model (the model's own fault, not the cache's): the "
                                    f"budget was applied on top of it")
            return
    tq = None
    if ctx.kind.has_twin:  # the twin's own quality, same model and dtype
        twin_steps = drive(ctx, ctx.new_cache(twin_spec(ctx)))
        tq = quality_metrics(_cache_positions(twin_steps), oracle)
        ctx.metrics.update(twin_kl_mean=tq["kl_mean"], twin_top1=tq["top1"])
    b, offset = q["worst"]
    first = steps[1].start
    lines = [
        *_budget_lines(q, kl_max, top1_min, source),
        f"worst KL {q['kl_worst']:.2e} at batch={b} position={first + offset}; mean KL per op: "
        f"{_per_op(ctx, steps, oracle_by_step)}",
        f"ops: {ctx.case.ops_label()} ({steps[-1].seq.shape[1]} tokens)",
    ]
    if tq is not None:
        inherent = tq["kl_mean"] > kl_max or tq["top1"] < top1_min
        lines.append(f"fake-quant twin on the same case: KL {tq['kl_mean']:.2e}, top-1 {tq['top1']:.3f}")
        cause = ("the declared quantization itself loses this much on this model: the budget is too tight for it"
                 if inherent else "the subject loses more than its declared quantization does: the fault is in the "
                 "subject (its twin meets the budget)")
    elif ctx.kind.evicts:
        cause = ("the tokens the cache keeps (budget.tokens_max = "
                 f"{ctx.kind.tokens_max}) do not carry the context this model needs, or the kept tokens "
                 "are attended at the wrong positions: compare the mean KL per op before and after eviction starts")
    else:
        cause = ("the cache loses more than its declared budget allows: coarser quantization than declared, or a "
                 "fault beyond the rounding. If the self-consistency checks (a fresh instance fed the same history) "
                 "pass, the error is one every instance makes alike — a scale or zero point read for the wrong "
                 "token, group or head, a wrong bit width or rounding — which only this comparison with the oracle "
                 "sees: compare the dequantized keys/values with the states given to update()")
    ctx.fail([*lines, "likely cause: " + cause])


def _budget_lines(q: dict, kl_max: float, top1_min: float, source: str) -> list[str]:
    """The KL and top-1 lines of a failed budget, the violated one(s) first as "…, but should be …" and a measure
    within its bound as "within the budget", so that a passing KL never reads like a second violation."""
    kl = f"KL(oracle ‖ subject) = {q['kl_mean']:.2e} nats (mean of {q['positions']} positions)"
    top1 = f"top-1 agreement = {q['top1']:.3f}"
    kl_bad, top1_bad = q["kl_mean"] > kl_max, q["top1"] < top1_min
    kl = (f"{kl}, but should be ≤ {kl_max:.2e} ({source})" if kl_bad
          else f"{kl} is within the budget (≤ {kl_max:.2e}, {source})")
    top1 = (f"{top1}, but should be ≥ {top1_min:.3f}" if top1_bad
            else f"{top1} is within the budget (≥ {top1_min:.3f})")
    return [kl, top1] if kl_bad or not top1_bad else [top1, kl]


def _reference_quality(ctx, oracle):
    """``quality_metrics`` of kvconform's reference cache on the same case (the same positions as ``oracle``), or
    None when there is no reference, it is the subject, or it raises. An exact cache gets KL ≈ 1e-12 here; more is
    the model's own fault on these ops (e.g. jamba's), which no cache can beat."""
    from kvconform.quant import quality_metrics

    ref = ctx.reference
    if ref is None or ref.name == ctx.subject.name:
        return None
    try:
        steps = drive(ctx, ctx.new_cache(ref))
    except SubjectRaised:
        return None
    return quality_metrics(_cache_positions(steps), oracle)


# ------------------------------------------------------------------------------------------ bytes held
def _mib(n) -> str:
    return f"{int(n):,} B" if abs(n) < 1 << 20 else f"{n / (1 << 20):.2f} MiB"


@dataclass(frozen=True)
class ExactLayer:
    """What an exact cache must hold in one layer, measured on ``ReferenceCache`` after a run.

    Attributes:
        label: ``"layer 0"``… (``_measure.cache_layers``).
        token_bytes: one token's keys + values over the batch, ``B·H_kv·(D_k + D_v)·b`` bytes; 0 without attention.
        tokens: the tokens an exact cache must keep: every token fed, ``min(fed, window)`` for a sliding layer
            (whose older tokens the model no longer attends: ``DynamicCache`` drops them).
        state_bytes: the layer's other bytes (conv + recurrent states of a linear-attention layer).
        dims: ``(B, H_kv, D_k, b)`` for messages; ``()`` without attention.
        window: the sliding window, or None.
    """

    label: str
    token_bytes: int
    tokens: int
    state_bytes: int
    dims: tuple = ()
    window: int | None = None

    @property
    def exact_bytes(self) -> int:
        return self.token_bytes * self.tokens + self.state_bytes


def exact_layer_bytes(ref_cache) -> list:
    """``[ExactLayer]`` of a ``ReferenceCache`` (or an ``EncoderDecoderCache`` of them) after a run."""
    out = []
    for label, layer in cache_layers(ref_cache):
        chunks = getattr(layer, "key_chunks", None) or []
        window = getattr(layer, "sliding_window", None) or None
        if not chunks:
            out.append(ExactLayer(label, 0, 0, held_bytes(layer)))
            continue
        k, v = chunks[0], layer.value_chunks[0]
        token_bytes = k.shape[0] * k.shape[1] * (k.shape[-1] + v.shape[-1]) * k.element_size()
        fed = sum(c.shape[-2] for c in chunks)
        kv_bytes = storage_bytes(list(chunks) + list(layer.value_chunks))
        out.append(ExactLayer(label, token_bytes, min(fed, int(window)) if window else fed,
                              held_bytes(layer) - kv_bytes, (k.shape[0], k.shape[1], k.shape[-1], k.element_size()),
                              int(window) if window else None))
    return out


def _formula(layers) -> str:
    """``"2 attention layers × 2·B2·H_kv2·D16·4B a token × 240 tokens + linear-attention states"``."""
    groups: dict = {}
    for layer in layers:
        if layer.token_bytes:
            groups.setdefault((layer.tokens, layer.dims), []).append(layer)
    parts = [f"{len(group)} attention layer{'s' if len(group) > 1 else ''} × 2·B{B}·H_kv{H}·D{D}·{b}B a token × "
             f"{tokens} tokens" + (f" (window {group[0].window})" if group[0].window else "")
             for (tokens, (B, H, D, b)), group in sorted(groups.items())]
    if any(layer.state_bytes for layer in layers):
        parts.append(f"linear-attention states {_mib(sum(layer.state_bytes for layer in layers))}")
    return " + ".join(parts)


_REFERENCE: dict = MEMO.table("quality.reference")
"""``exact_layer_bytes`` per (model, dtype, case, batch, reference): the same for every subject of a run."""


def _reference_layers(ctx) -> list:
    def refused(exc):
        ctx.fail([f"the reference cache raised {type(exc.cause).__name__}: {exc.cause} — cannot measure what an "
                  f"exact cache holds", f"ops: {ctx.case.ops_label()}",
                  "likely cause: the model does not support these ops"], {"model_at_fault": True})

    return measure_reference(ctx, _REFERENCE, lambda ref: drive(ctx, ref), exact_layer_bytes, refused)


def _run_subject(ctx, check, summary):
    """Run the case on a fresh subject cache; return ``(cache, tokens fed)``, failing the item if the subject
    raises — after measuring ``check`` at batch 1 as well where it raised at a larger batch
    (``_observe.measured_at_batch_one``; ``summary(metrics)``: the batch-1 measurement in one phrase)."""
    cache = ctx.new_cache()
    try:
        steps = drive(ctx, cache)
    except SubjectRaised as exc:
        measured_at_batch_one(ctx, exc, check, lambda c, e: fail_subject_raised(
            c, e, "the cache does not support this sequence of calls (see the exception)"), summary)
    return cache, int(steps[-1].seq.shape[1])


def _holdings(cache) -> str:
    return "; ".join(f"{path or 'cache'} {desc} {_mib(size)}" for path, size, desc in largest_holdings(cache, 3))


@register("quality", cost=4.0, needs=("forward",), judges=ALL_KINDS, facts=COMPRESSING,
          applies=_compression_judged, params={
    "bytes_ratio_max": Param(float, min=0, doc="replaces the subject's budget.bytes_ratio_max (held / exact bytes)"),
}, ops=LONG_CONTEXT_RULE)
def check_compression_real(ctx):
    """A lossy subject's compression is real: the bytes it holds after the case's long context
    (``_measure.held_bytes``: each reachable storage once, wrapper tensors through their packed data and scales) are
    below what an exact cache must hold after the same ops (``exact_layer_bytes`` on ``ReferenceCache``: every token's
    keys and values of a full-attention layer, the window of a sliding layer, the linear-attention states): ratio <
    1, and ≤ ``budget.bytes_ratio_max`` when the subject (or the case, ``params``) declares one. The ratio is of the
    case dtype's bytes (the built-in cases: float32)."""
    cache, tokens = _run_subject(ctx, check_compression_real, lambda m: (
        f"{_mib(m.get('bytes_held', 0))} held, {m.get('bytes_ratio')}× the {_mib(m.get('bytes_exact', 0))} an exact "
        f"cache holds"))
    layers = _reference_layers(ctx)
    exact = sum(layer.exact_bytes for layer in layers)
    held = held_bytes(cache, exclude=owned_by_model(ctx.model.model))  # what the cache owns, not the model's
    ctx.measured.record(bytes_held=held, tokens_held=tokens)  # 0 bytes for held tokens: blind, not "compressed"
    ratio = held / exact if exact else float("inf")
    budget = ctx.subject.budget
    declared = (ctx.case.params or {}).get("bytes_ratio_max", getattr(budget, "bytes_ratio_max", None))
    ctx.metrics.update(bytes_held=held, bytes_exact=exact, bytes_ratio=round(ratio, 4), bytes_ratio_max=declared,
                       tokens=tokens)
    if ratio < 1 and (declared is None or ratio <= declared):
        return
    bound = (f"≤ {declared:.3f} (bytes_ratio_max)" if declared is not None else
             "< 1 (no bytes_ratio_max declared: compression must at least be real)")
    ctx.fail([
        f"held bytes = {_mib(held)} after {tokens} tokens, {ratio:.3f}× the {_mib(exact)} an exact cache must hold, "
        f"but should be {bound}",
        f"exact: {_mib(exact)} = {_formula(layers)} (measured on {ctx.reference.name} fed the same ops)",
        f"largest tensors held: {_holdings(cache)}",
        f"ops: {ctx.case.ops_label()}",
        "likely cause: " + _compression_cause(ctx, cache, layers, ratio, tokens),
    ])


def wide_codes(cache, tokens: int) -> list:
    """``[(path, dtype, what, bits needed, bits stored)]`` of the tensors ``cache`` holds over most of ``tokens`` (at
    least half: an exact residual may hold the rest) that
    store codes in a wider dtype than their values need: integer indices (``what``: ``"N levels"``, needing
    ``ceil(log2 N)`` bits) and floating tensors holding only -1, 0 and 1 (sign bits, 1–2 bits needed)."""
    import math

    import torch

    out = []
    for path, t in held_tensor_items(cache):
        if t.dim() < 2 or not tokens // 2 <= t.shape[-2] <= tokens or t.numel() == 0:
            continue
        if t.is_floating_point():
            values = torch.unique(t.detach())
            if values.numel() <= 3 and bool(values.abs().le(1).all()) and bool((values == values.round()).all()):
                need = 1 if values.numel() <= 2 else 2
                out.append((path, t.dtype, "only " + "/".join(f"{v:+.0f}" for v in values.tolist()), need,
                            t.element_size() * 8))
        elif t.dtype != torch.bool:
            lo, hi = int(t.min()), int(t.max())
            need = max(1, math.ceil(math.log2(hi - lo + 1))) if hi > lo else 1
            if need < t.element_size() * 8 // 2:
                out.append((path, t.dtype, f"{hi - lo + 1} levels", need, t.element_size() * 8))
    return out


def _compressed_tensors(cache, tokens: int, dtype) -> list[str]:
    """Paths of the tensors ``cache`` holds over at least half of ``tokens`` (dim −2) in a compressed form:
    integer codes, or floating tensors narrower than the model's ``dtype``."""
    import torch

    width = torch.empty((), dtype=dtype).element_size()
    out = []
    for path, t in held_tensor_items(cache):
        if t.dim() < 2 or not tokens // 2 <= t.shape[-2] <= tokens or t.numel() == 0 or t.dtype == torch.bool:
            continue
        if not t.is_floating_point() or t.element_size() < width:
            out.append(path)
    return out


def _compression_cause(ctx, cache, layers, ratio: float, tokens: int) -> str:
    """Why a lossy cache holds too much: tensors in the model's dtype with one token's keys (or values) for every
    token fed (a kept dequantized view, or nothing compressed), a sliding window it does not honour, or fewer bits
    saved than declared."""
    dtype = str(ctx.model.dtype).removeprefix("torch.")
    per_token = {B * H * D for B, H, D, _ in (layer.dims for layer in layers if layer.dims)}  # one token's K
    full = [path for path, t in held_tensor_items(cache)
            if t.is_floating_point() and t.dtype == ctx.model.dtype and t.dim() >= 2 and t.shape[-2] == tokens
            and t.numel() // tokens in per_token]
    wide = wide_codes(cache, tokens)
    coded = {path for path, *_ in wide}
    full = [path for path in full if path not in coded]  # ±1 sign bits in a float tensor are codes, not a view
    where = f" ({', '.join(full[:2])}{', ...' if len(full) > 2 else ''}: {dtype} over all {tokens} tokens)"
    windows = sorted(layer.window for layer in layers if layer.window and layer.window < tokens)
    uncompressed = 0.98 <= ratio <= 1.02
    if windows and not uncompressed:
        return (f"the model has sliding-window layers (window {windows[0]}): an exact cache keeps only the window "
                f"there, this cache keeps tokens the model no longer attends" + (where if full else ""))
    if full and not uncompressed and not _compressed_tensors(cache, tokens, ctx.model.dtype) and not coded:
        return ("nothing is stored compressed: every tensor the cache holds over the tokens is in the model's "
                f"dtype{where}, {ratio:.2f}× an exact cache's bytes — the keys/values go through the codec and "
                "are stored decoded (a round trip saves no memory); store the codes (integers, narrower floats) "
                "and decode on read, or declare that the cache promises no memory saving")
    if full and not uncompressed:
        return ("the cache keeps every token at full precision besides its compressed data" + where + ": a "
                "dequantized view kept as an attribute after update() returned it")
    if wide and not full:
        shown = "; ".join(f"{path} {str(dt).removeprefix('torch.')} holding {what} "
                          f"({need} bit{'s' if need > 1 else ''} "
                          f"needed, {have} stored)" for path, dt, what, need, have in wide[:3])
        return (f"the compressed codes are stored in wide dtypes — {shown}{'; ...' if len(wide) > 3 else ''}: the "
                f"quantization is real but its indices and sign bits are not packed, so they cost more than the "
                f"values they replace (pack them: uint8 or bit-packed)")
    if full or uncompressed:
        rounded = _stored_vs_exact(ctx, cache, full)
        if rounded is not None:
            path, delta = rounded
            return (f"the codec runs but the cache stores its decoded output: the keys/values it holds{where} are "
                    f"{dtype} tensors as large as an exact cache's, yet differ from the exact keys/values by up to "
                    f"{delta:.2g} ({path}) — every token goes through the codec and the reconstructed floats are "
                    f"kept, not the codes, so nothing is saved. Store the codes (indices, scales) and decode on read; "
                    f"or, if the design promises no memory saving, declare it: saves_memory=False in the budget "
                    f"(kvconform_lossy = {{..., 'saves_memory': False}})")
        return ("nothing is compressed: the cache holds what an exact cache holds" + (where if full else "") +
                " — the compressor is never reached (an exact window longer than the case, or layers built before "
                "the cache could install its own quantizing layers)")
    if ratio >= 1:
        return "the cache holds more than an exact one: its compressed form plus its buffers cost more"
    return "the cache compresses less than it declares (more bits, smaller groups or a longer exact window)"


def _stored_vs_exact(ctx, cache, paths) -> tuple | None:
    """Whether the full-size tensors ``cache`` holds at ``paths`` (``held_tensor_items`` paths) went through a codec:
    each is compared with the keys/values of the same shape kvconform's exact ``ReferenceCache`` holds after the same
    ops; returns ``(path, max|Δ|)`` of the tensor closest to an exact one when even that one is off by more than
    float noise (1e-4 of the exact values' scale), else None (stored exactly: nothing went through a codec, or no
    tensor to compare)."""
    import torch

    from kvconform.reference import ReferenceCache  # noqa: F401 - the reference the context builds

    if not paths or ctx.reference is None:
        return None
    try:
        ref = ctx.new_cache(ctx.reference)
        drive(ctx, ref)
    except Exception:  # noqa: BLE001 - no comparison without the reference: the general reading applies
        return None
    exact = []
    for _, layer in cache_layers(ref):
        for name in ("key_chunks", "value_chunks"):
            chunks = [c for c in (getattr(layer, name, None) or []) if isinstance(c, torch.Tensor)]
            if chunks:
                exact.append(torch.cat(chunks, dim=-2).detach().double())
    held = dict(held_tensor_items(cache))
    best = None
    for path in paths:
        t = held.get(path)
        if t is None:
            continue
        t = t.detach().double()
        deltas = [(float((t - e).abs().max()), float(e.abs().max())) for e in exact if e.shape == t.shape]
        if not deltas:
            continue
        delta, scale = min(deltas)
        if delta <= 1e-4 * max(scale, 1.0):
            return None  # one tensor is stored exactly: the codec does not touch what the cache keeps
        if best is None or delta < best[1]:
            best = (path, delta)
    return best


@register("quality", cost=4.0, needs=("forward",), judges=(EVICTING,), unjudged=EVICTING_ONLY, params={
    "slack_bytes": Param(int, default=DEFAULT_SLACK_BYTES, min=0,
                         doc="bytes per layer allowed above the bound (bookkeeping: positions, counters)"),
}, ops=LONG_CONTEXT_RULE)
def check_memory_bound(ctx):
    """An evicting subject holds no more than it declares: the bytes held after the case's long context are ≤
    ``budget.tokens_max`` tokens' keys and values in each attention layer (for a share, ``budget.held_bound`` of the
    tokens seen: ``tokens_exact + ceil(keep_ratio · (seen − tokens_exact))``) (``B·H_kv·(D_k + D_v)·b`` bytes a token,
    measured on ``ReferenceCache`` fed the same ops) plus each layer's linear-attention states, plus ``slack_bytes``
    (default 256) per layer."""
    slack = ctx.case.params.slack_bytes
    cache, tokens = _run_subject(ctx, check_memory_bound, lambda m: (
        f"{_mib(m.get('bytes_held', 0))} held ≤ {_mib(m.get('bytes_bound', 0))} ({m.get('tokens_max')} tokens)"))
    budget = ctx.subject.budget
    tokens_max = int(budget.held_bound(tokens))  # tokens_max, or the share (keep_ratio) of the tokens seen
    layers = _reference_layers(ctx)
    token_bytes = sum(layer.token_bytes for layer in layers)
    states = sum(layer.state_bytes for layer in layers)
    bound = tokens_max * token_bytes + states + slack * len(layers)
    held = held_bytes(cache, exclude=owned_by_model(ctx.model.model))  # what the cache owns, not the model's
    ctx.measured.record(bytes_held=held, tokens_held=min(tokens, tokens_max))
    kept = (held - states) / token_bytes if token_bytes else float("nan")
    ctx.metrics.update(bytes_held=held, bytes_bound=bound, tokens_max=tokens_max, tokens=tokens,
                       tokens_equivalent=round(kept, 1))
    if held <= bound:
        return
    attention = [layer for layer in layers if layer.token_bytes]
    B, H, D, b = attention[0].dims if attention else (0, 0, 0, 0)
    per_layer = ", ".join(f"{label} {_mib(n)}" for label, n in layer_bytes(cache).items())
    ctx.fail([
        f"held bytes = {_mib(held)} after {tokens} tokens, but should be ≤ {_mib(bound)} "
        + (f"(budget.tokens_max = {tokens_max})" if budget.keep_ratio is None else
           f"({tokens_max} tokens: {budget.describe_bound()})"),
        f"bound: {tokens_max} tokens × {_mib(token_bytes)} a token over {len(attention)} attention layers "
        f"(2·B{B}·H_kv{H}·D{D}·{b}B each) + linear-attention states {_mib(states)} + slack {slack} B × "
        f"{len(layers)} layers",
        f"the cache holds the equivalent of {kept:.0f} tokens; per layer: {per_layer}",
        f"largest tensors held: {_holdings(cache)}",
        f"ops: {ctx.case.ops_label()}",
        "likely cause: " + (f"the cache holds all {tokens} tokens' worth: nothing is evicted, or what is evicted is "
                            "still referenced (a list of old chunks, views pinning old buffers: see the largest "
                            "tensors)" if kept >= tokens - 0.5 else
                            f"the cache keeps a larger share of the {tokens} tokens than it declares ({kept:.0f} "
                            f"tokens' worth, {kept / max(tokens, 1):.2f} of them; declared keep_ratio "
                            f"{budget.keep_ratio:g}), or evicted keys/values are still referenced"
                            if budget.keep_ratio is not None else
                            "the cache keeps more than tokens_max tokens (a window larger than declared, or "
                            "evicted keys/values still referenced: a list of old chunks, views pinning old buffers)"),
    ])
