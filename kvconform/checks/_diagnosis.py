"""The failure messages of the checks and their "likely cause" diagnosis: ``fail_verdict`` (a failed verdict, with
the reference cache's run on the same case as the ``oracle:`` line), ``fail_raised`` (the subject raised),
``describe_exception``, ``token_mismatch``, ``positions_label`` and ``MODEL_AT_FAULT``.
"""

from __future__ import annotations

import traceback

from kvconform import compat
from kvconform.checks._drive import SubjectRaised, prefill_refusal
from kvconform.checks._judge import Verdict, run_and_judge
from kvconform.failure import Cause, Measured, OpsTrail
from kvconform.ops import op_names
from kvconform.oracle import DTYPES
from kvconform.outcomes import CheckSkipped


MODEL_AT_FAULT = "transformers' modeling code mishandles this case, whatever the cache (see the known faults)"
"""The likely cause when kvconform's ReferenceCache fails the same case too: the fault is in the model."""


def token_mismatch(seq, ref_seq, what: str, reference: str) -> str:
    """One message line saying where two token sequences (``(batch, length)`` int64) first differ, or that their
    shapes differ. ``what`` names the subject's output, ``reference`` the uncached run it should equal."""
    if tuple(seq.shape) != tuple(ref_seq.shape):
        return f"{what} of shape {tuple(seq.shape)}, but {reference} gave {tuple(ref_seq.shape)}"
    b, i = (seq != ref_seq).nonzero()[0].tolist()
    return f"{what} differ from {reference} at batch={b} index={i}: {seq[b, i].item()} vs {ref_seq[b, i].item()}"



def describe_raise(exc: SubjectRaised) -> str:
    """``"IndexError: ... (at cache_utils.py:512 in update)"`` — the innermost frame of the subject's exception."""
    return describe_exception(exc.cause)


def describe_exception(cause: BaseException) -> str:
    """``"Type: first line (at file.py:line in function)"`` for any exception."""
    tb = traceback.extract_tb(cause.__traceback__)
    where = f" (at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno} in {tb[-1].name})" if tb else ""
    text = str(cause).strip().splitlines()
    first = text[0][:200] if text else ""
    return f"{type(cause).__name__}: {first}{where}"


def oracle_line(ctx, position_mode=None, driver=None, at=None) -> tuple[str, bool]:
    """Run the same case (or ``driver``) on the reference subject; return (message line, model_at_fault).

    ``at``: the subject's failing ``Step``. The reference is compared like with like: when it fails only at a later
    step than ``at`` (it was within the tolerance up to there), the fault at ``at`` is the subject's, and the line
    says where the reference fails instead of blaming the model."""
    ref = ctx.reference
    if ref is None:
        return "", False
    if ref.name == ctx.subject.name:
        # The reference cache is the simplest correct cache (proven by kvconform's own tests): when it fails,
        # the model's code is at fault.
        return (f"oracle: {ref.name} is kvconform's reference cache → the fault is in the model, "
                f"not the cache"), True
    try:
        v = run_and_judge(ctx, ref, position_mode, driver)
    except SubjectRaised as exc:
        if exc.internal is not None:  # kvconform's own gap, not the model's: no reference line for this case
            return (f"oracle: kvconform's {ref.name} cannot run this case (kvconform internal error: "
                    f"{exc.internal['what']} at {exc.internal['place']}; report it to kvconform) — the verdict "
                    f"above stands, measured against the float64 oracle"), False
        return f"oracle: {ref.name} on the same case raised {describe_raise(exc)}", False
    ref_step, cmp = v.first_fail or v.worst  # type: ignore[misc]  # a judged run has a worst step
    if v.passed:
        return f"oracle: {ref.name} on the same case: {cmp.max_abs:.1e} → the fault is in the subject", False
    if at is not None and ref_step.index > at.index:
        return (f"oracle: {ref.name} on the same case is within the tolerance up to {at.label}, where the subject "
                f"fails, and fails only later, at {ref_step.label} ({cmp.max_abs:.1e}: the model's own fault there) "
                f"→ the fault at {at.label} is in the subject"), False
    return (f"oracle: {ref.name} on the same case fails too ({cmp.max_abs:.1e}) → the fault is in the model, "
            f"not the cache"), True


def fail_verdict(ctx, verdict: Verdict, cause_fn, position_mode=None, ops_text=None, driver=None):
    """Raise the failure message of a failed verdict (what was observed, where, the ops, the reference cache's
    run on the same case, the likely cause). ``cause_fn(step, cmp) -> str`` gives the likely cause in the
    subject; it is consulted only when kvconform's ReferenceCache passes the same case (else the cause is
    ``MODEL_AT_FAULT``)."""
    assert verdict.first_fail is not None, "fail_verdict needs a failed verdict"
    step, cmp = verdict.first_fail
    b, offset = cmp.worst
    position = step.start + offset
    ref_line, model_at_fault = oracle_line(ctx, position_mode, driver, at=step)
    observed = "NaN/inf" if cmp.max_abs == float("inf") else f"{cmp.max_abs:.1e}"
    tol_text = ctx.tolerance().describe(cmp.floor)
    if step.index in verdict.widened:
        tol_text = (f"the fresh instance's compression error: after a crop inside a forward or a batch-size change "
                    f"its replay runs forwards of other shapes, so rounding may differ by a quantization level; "
                    f"{tol_text}")
    versus = f" vs {verdict.target}" if verdict.target else ctx.kind.versus
    own = verdict.own_error.get(step.index)
    ctx.fail([
        f"max|Δlogit| = {observed}{versus}, but should be ≤ {cmp.tol:.1e} ({tol_text})",
        "" if own is None else f"the fresh instance's own distance to the oracle there "
                               f"(its compression error, for scale): "
                               f"{own:.1e}",
        f"worst at batch={b} step={step.index} position={position}",
        OpsTrail.of_case(ctx.case, at=step.label, note=positions_label(ctx), text=ops_text,
                         op_index=getattr(step, "op_index", None)),
        f"measured in the cache at {step.label}: {step.nonfinite}" if getattr(step, "nonfinite", None) else "",
        ref_line,
        _verdict_cause(ctx, verdict, step, cmp, cause_fn, model_at_fault),
    ], {"max_abs": cmp.max_abs, "nonfinite": getattr(step, "nonfinite", None), "tolerance": cmp.tol,
        "noise_floor": cmp.floor, "failed_at": step.label,
        "position": position, "model_at_fault": model_at_fault,
        **({"compared_with": verdict.target, "distance_to_oracle": own} if verdict.target else {})},
        measured=Measured("max|Δlogit|", cmp.max_abs, cmp.tol, "logits", "<="))


def _verdict_cause(ctx, verdict: Verdict, step, cmp, cause_fn, model_at_fault: bool) -> Cause:
    """The likely cause of a failed verdict at ``step``: the model's own fault, what was measured in the cache
    there (non-finite values, unmasked slots, an ``update()`` that returned the wrong number of keys: a
    ``kv_length`` cause keeps its id and facts), else the check's reading (``cause_fn(step, cmp)``)."""
    if model_at_fault:
        return Cause(MODEL_AT_FAULT, "model_at_fault")
    if getattr(step, "nonfinite", None):
        return Cause(_cache_fault_cause(step.nonfinite))
    if getattr(step, "unmasked", None):
        return Cause(str(step.unmasked))
    kv = getattr(step, "kv_mismatch", None)
    if kv:
        text = f"{kv} — {verdict.cause or cause_fn(step, cmp)}"
        return kv.with_text(text) if isinstance(kv, Cause) else Cause(text)
    return Cause(str(verdict.cause or image_prefill_cause(ctx, step, cmp) or before_ops_cause(ctx, step)
                     or cause_fn(step, cmp)))


def ops_after(ctx, step) -> tuple[list[str], list[str]]:
    """``(labels of the case's ops that do not feed tokens and ran before step, those that had not run yet)``,
    from the forwards each op makes (``OpSpec.forwards``): an op ran before the step of index ``i`` (the ``i``-th
    forward, from 0) when at most ``i`` forwards precede it in the case."""
    before, after, forwards = [], [], 0
    for op in ctx.case.ops:
        if op.spec.feeds:
            forwards += op.spec.forwards(op.n)
        elif forwards > step.index:
            after.append(op.label)
        else:
            before.append(op.label)
    return before, after


def before_ops_cause(ctx, step) -> str | None:
    """The likely cause of a step that failed before any of the case's other ops (crop, fork, reorder, reset…)
    ran: the forwards themselves, never an op that had not happened (a family's reading names its op). None when
    one of those ops ran before the step, or the case has none."""
    before, after = ops_after(ctx, step)
    if before or not after:
        return None
    shown = ", ".join(after[:3]) + (", ..." if len(after) > 3 else "")
    where = ("a prefill into an empty cache" if step.index == 0 else
             f"the forwards up to {step.label}")
    return (f"the cache is already wrong at {step.label}, before {shown} ran (those ops are not the cause): "
            f"{where} stores or returns wrong keys/values — compare what update() returns with the states it was "
            f"given (a block or page boundary, a slice, a length counter)")


def image_prefill_cause(ctx, step, cmp) -> str | None:
    """The likely cause of a failed prefill of a VLM's image prompt (``ZooModel.image``) when the worst position is
    in or before the image block, else None. Where the model attends its image block bidirectionally (gemma3:
    ``token_type_ids``), the uncached forward of the same pixels with a plain causal mask is measured first: when
    the subject's logits are that forward's, the block's bidirectional mask was lost."""
    import torch

    image = ctx.model.image
    if image is None or not step.label.startswith("prefill") or step.start != 0:
        return None
    is_image = step.seq == image.image_token_id
    b, offset = cmp.worst
    cols = is_image[b].nonzero().flatten()
    if not len(cols):
        return None
    first, last, position = int(cols[0]), int(cols[-1]), step.start + offset
    if image.token_type_ids and (step.mask is None or bool(step.mask.all())):
        from kvconform import vision

        m = ctx.model.model
        param = next(m.parameters())
        pixels = vision.image_inputs(image, step.seq, param.dtype, param.device)["pixel_values"]
        with torch.no_grad():  # the same pixels and tokens, no token_type_ids: the image block attended causally
            causal = m(input_ids=step.seq.to(param.device), pixel_values=pixels, use_cache=False).logits
        gap = float((step.logits - causal.detach().to("cpu", torch.float64)).abs().max())
        if gap <= max(cmp.tol, 0.01 * cmp.max_abs):
            return (f"the image block (positions {first}..{last}) was attended causally at the prefill: the "
                    f"subject's logits are the uncached forward's without the block's bidirectional mask (within "
                    f"{gap:.1e}) — the model did not get token_type_ids, or its mask was built without the image "
                    f"block")
    if position > last:
        return None
    where = "before" if position < first else "inside"
    return (f"the prefill of the image prompt is wrong at position {position}, {where} the image block at positions "
            f"{first}..{last}: the image tokens' keys/values are not returned where the prompt put them (dropped, "
            f"shifted or reordered against the text) — update() must return a prefill's keys and values in "
            f"sequence order")


def _cache_fault_cause(fault: str) -> str:
    """The likely cause of a fault measured in the cache itself (``Step.nonfinite``)."""
    if "wrote into" in fault:
        return ("update() modifies the caller's key/value tensors in place (e.g. scaling or quantizing them where "
                "they lie) instead of working on its own copy: the model may still read them")
    return ("update() returns or stores non-finite keys/values (or states): an overflow, a division by a zero scale, "
            "or uninitialised memory read back")


def positions_label(ctx) -> str:
    """How positions were given: explicit ``position_ids`` or derived by the model from the cache."""
    explicit = ctx.case.position_ids != "implicit" and compat.accepts_position_ids(ctx.model.model)
    if ctx.case.params.get("padding") and not ctx.model.is_encoder_decoder:
        return "left-padded batch, attention_mask and explicit position_ids"
    return "explicit position_ids" if explicit else "no position_ids (derived from the cache)"


def run_on_variant(ctx, variant, oracle):
    """The case's ops on a fresh subject cache for ``variant`` (a changed copy of the item's model, a ``ZooModel``)
    judged against ``oracle`` (that copy's float64 oracle): ``(vctx, cache, steps, verdict)``, ``vctx`` the item's
    context on the variant. A raise of the subject fails the item (``fail_raised``)."""
    from kvconform.checks._interpreter import run_ops
    from kvconform.checks._judge import judge

    vctx = ctx.replace(model=variant, oracle=oracle)
    cache = vctx.new_cache()
    try:
        steps = run_ops(vctx, cache)
    except SubjectRaised as exc:
        fail_raised(vctx, exc, "the cache does not support this sequence of calls (see the exception)")
    return vctx, cache, steps, judge(vctx, steps)


def fail_raised(ctx, exc: SubjectRaised, cause: str | Cause, ops_text=None):
    """Fail the item because the subject raised: the exception (innermost frame), the ops with the op that raised
    (``ops_text``, default the case's), and the likely cause: what was measured at the raise
    (``measured_cause``) when it explains it, else ``cause`` (the check's reading of where it raised); a subject's
    context that left the model changed has its own (``subjects.ModelLeftChanged.likely_cause``).

    Raises:
        SubjectBuildError: when what raised was building the subject (a fresh cache made inside the ops): the
            item is judged as a constructor failure (``checks.run_check``), not as a raise at that op.
    """
    from kvconform.subjects import ModelLeftChanged, SubjectBuildError

    if isinstance(exc.cause, SubjectBuildError):
        raise exc.cause
    reason = prefill_refusal(ctx, exc)
    if reason:
        raise CheckSkipped(reason)
    if isinstance(exc.cause, ModelLeftChanged):
        cause = ModelLeftChanged.likely_cause
    else:
        cause = measured_cause(exc) or cause
        cause = _press_on_sliding(ctx, cause)
        cause = _count_in_model_dtype(ctx, cause)
    ctx.fail([
        f"the subject raised {describe_raise(exc)}",
        OpsTrail.of_case(ctx.case, at=exc.where, verb="raised", text=ops_text, op_index=exc.op_index),
        cause if isinstance(cause, Cause) else Cause(cause),
    ], {"raised": type(exc.cause).__name__, "failed_at": exc.where})


def _press_on_sliding(ctx, cause):
    """A press whose ``update()`` returned fewer keys than a *sliding-window* layer should hold compressed that
    layer: name it (kvpress compresses every attention layer, qwen2's sliding one included). ``cause``: a ``Cause``
    or a string; a ``kv_length`` cause (``_evidence.kv_length_mismatch``) is read from its facts."""
    facts = cause.facts if isinstance(cause, Cause) and cause.id == "kv_length" else None
    if not facts or facts.get("mask") is not None or not ctx.kind.presses:
        return cause
    types, _ = compat.layer_types_and_kwargs(ctx.model.config)
    sliding = [j for j, t in enumerate(types) if t in ("sliding_attention", "chunked_attention")]
    if not sliding:
        return cause
    # a press holds fewer keys than tokens seen in its full-attention layers by design; on a model with sliding
    # layers the size error comes from a sliding layer it compressed too, whose mask is sized for the window
    return Cause(f"the press compresses the sliding-window layer{'s' if len(sliding) > 1 else ''} "
                 f"{', '.join(map(str, sliding))} too: a sliding layer's mask is sized for the tokens its window must "
                 f"hold, so attention cannot line up the fewer keys it keeps — leave sliding layers to their window "
                 f"(the model bounds them already), or announce the kept tokens in get_mask_sizes() (measured at the "
                 f"raise: update(layer_idx={facts['layer_idx']}) returned {facts['returned']} keys after "
                 f"{facts['held']} tokens)", "press_on_sliding", dict(facts))


def _count_in_model_dtype(ctx, cause):
    """A cache whose returned keys stop growing exactly where the model's dtype stops holding every integer (256 at
    bfloat16, 2048 at float16) while it should hold more: name the count kept in that dtype (a running sum of
    tokens in a 0-d tensor "like the keys": ``count + 1`` rounds back to the count). ``cause``: a ``Cause`` or a
    string; a ``kv_length`` cause is read from its facts."""
    facts = cause.facts if isinstance(cause, Cause) and cause.id == "kv_length" else None
    dtype = str(getattr(ctx.model, "dtype", "")).removeprefix("torch.")
    limit = DTYPES[dtype].exact_integers if dtype in DTYPES else None  # every integer 0..limit exact in it
    if not facts or facts.get("mask") is not None or limit is None or facts["returned"] != limit \
            or facts["held"] <= limit:
        return cause
    return Cause(f"{cause} — {limit} is where {dtype} stops holding every integer: a token or fill count kept in "
                 f"the model's dtype (a running sum in {dtype}) stalls there, since {limit} + 1 rounds back to "
                 f"{limit}; keep counts as Python ints or int64 tensors", "count_in_model_dtype",
                 {**facts, "dtype": dtype, "exact_up_to": limit})


def _size_error(cause: BaseException) -> bool:
    """An exception about mismatched sizes or an index out of range (what a length or layer-count mismatch raises
    inside attention, the mask or the cache)."""
    text = str(cause)
    return isinstance(cause, IndexError) or any(w in text for w in (
        "size of tensor", "must match", "out of bounds", "out of range", "shape", "expanded size"))


def _signature_error(cause: BaseException) -> bool:
    """A call that did not fit the method's signature (``TypeError: ... unexpected keyword argument`` / ``...
    positional argument``): the method raised before doing anything, so no layer it would have made is missing."""
    return isinstance(cause, TypeError) and any(w in str(cause) for w in ("unexpected keyword argument",
                                                                         "positional argument"))


def measured_cause(exc: SubjectRaised) -> str | Cause | None:
    """The likely cause of a raise inside a forward, from what was measured there (``SubjectRaised.facts``, see
    ``_evidence.raise_facts``), or None when the measurements explain nothing. In order:

    * one layer object serves several decoder layers (``shared_layers``);
    * the cache has fewer layers than the model's decoder (an ``update(layer_idx=i)`` found no layer ``i``, or an
      IndexError with fewer layers than ``decoder_depth`` in a cache whose layers do not grow on demand);
    * an ``update()`` returned another number of keys than the cache should hold (an unbounded layer: the tokens
      fed; a bounded one: the ``kv_length`` its ``get_mask_sizes`` gave the mask);
    * ``get_mask_sizes`` sized the mask of an unbounded layer for another number of keys than the tokens held;
    * a layer that holds tokens answers None for ``layer.keys`` (transformers reads it directly) and the forward
      raised an AttributeError / TypeError;
    * the cache's tensors disagree on the batch size, or all differ from the batch's rows (unless every layer's
      ``keys`` / ``values`` has the batch's rows: then the other tensors' first dimension counts something else,
      such as a paged pool's pages);
    * what the forward's ``UpdateWatch`` saw an ``update()`` do wrong (``update_fault``: another dtype returned…).
    """
    f = exc.facts
    if not f:
        return None
    n_layers, depth, calls = f.get("cache_layers"), f.get("decoder_depth"), f.get("update_calls", ())
    if f.get("shared_layers"):
        return f["shared_layers"]
    held, layer_max, masks = f.get("held"), f.get("layer_max", []), f.get("mask_sizes", {})
    # an empty layer list read by an update() of the cache's own is no layer count: the cache keeps its storage
    # elsewhere (and fills its layers lazily, if at all)
    own_storage = n_layers == 0 and (not f.get("layers_updated", True) or bool(f.get("grows_layers")))
    if n_layers is not None and depth is not None and n_layers < depth and not _signature_error(exc.cause) \
            and not own_storage:
        missing = [c[0] for c in calls if isinstance(c[0], int) and c[0] >= n_layers]
        if missing or (isinstance(exc.cause, IndexError) and not f.get("grows_layers")):
            found = f"update(layer_idx={missing[0]}) found no layer {missing[0]}" if missing else \
                f"{type(exc.cause).__name__} on a layer index"
            source = (" (an encoder-decoder config's encoder_layers / num_layers is the encoder's depth)"
                      if f.get("encoder_decoder") else " (num_hidden_layers of the text config is the decoder's)")
            return (f"the cache has {n_layers} layers, but the model's decoder has {depth} ({found}): the cache's "
                    f"layer count differs from the decoder depth — it is sized from another count{source}")
    if _size_error(exc.cause):
        if f.get("kv_mismatch"):
            kv = f["kv_mismatch"]
            text = f"{kv}: attention and its mask cannot line the keys up with the queries"
            return kv.with_text(text) if isinstance(kv, Cause) else text
        for layer_idx, (kv_length, kv_offset) in sorted(masks.items()):
            unbounded = layer_idx < len(layer_max) and layer_max[layer_idx] == -1
            if unbounded and kv_offset + kv_length != held:
                return (f"get_mask_sizes(layer {layer_idx}) sized the attention mask for {kv_length} keys (offset "
                        f"{kv_offset}) for a cache that should hold {held} tokens: the mask and the keys cannot "
                        f"line up (get_seq_length() or a length counter is off)")
    missing = f.get("keys_missing") or []
    if missing and isinstance(exc.cause, (AttributeError, TypeError)):
        returned_none = next((c for c in calls if len(c) > 2 and c[2] is None), None)
        if returned_none is not None:
            return (f"update(layer_idx={returned_none[0]}) returned no key tensor, and {missing[0]} answers None for "
                    f"layer.keys although it holds tokens: update() must return the held keys and values "
                    f"([batch, kv_heads, tokens, head_dim] each), and layer.keys / layer.values must answer them too")
        return (f"{missing[0]}{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''} holds tokens "
                f"(get_seq_length() > 0) but answers None for layer.keys: transformers reads layer.keys and "
                f"layer.values directly, not only what update() returns (t5's and bart's cross-attention reuse "
                f"layers[i].keys once the encoder's states are cached) — expose the held keys and values there, "
                f"e.g. as properties")
    sizes, batch = f.get("batch_sizes", {}), f.get("batch")
    public = f.get("public_batch") or {}
    if public and set(public.values()) == {batch}:
        sizes = {}  # keys/values have the batch's rows: the other tensors' first dimension is something else (pages)
    if sizes and (len(set(sizes.values())) > 1 or set(sizes.values()) != {batch}):
        # the tensors off the batch's rows first: a batch op that skipped a layer leaves the others right
        odd = [(name, b) for name, b in sizes.items() if b != batch]
        shown = ", ".join(f"{name}: {b}" for name, b in (odd + [(n, b) for n, b in sizes.items() if b == batch])[:3])
        since = next((op for op in reversed(f.get("trail", ())) if op.split("(")[0] in _BATCH_OPS), None)
        pinned = not since and batch not in set(sizes.values())
        return (f"the cache holds tensors of batch sizes {', '.join(str(b) for b in sorted(set(sizes.values())))} "
                f"({shown}) for a batch of {batch} rows"
                + (f": {since} did not resize every tensor of every layer alike" if since else
                   ": its storage was sized for another batch before any batch op — a batch size fixed at "
                   "construction (a default, or a read-only batch_size) must follow the batch_size argument or "
                   "the rows of the first forward" if pinned else ""))
    return f.get("update_fault")  # e.g. update() returned another dtype than it was given


_BATCH_OPS = op_names(copies=False, rows=("permute", "resize", "new"))
"""The ops that change the batch rows (``kvconform.ops``): named as the cause of a batch-size mismatch."""


def sliding_window_slots(ctx, cache, seq) -> str | None:
    """What the sliding-window layers of ``cache`` hold after the run, measured: each sliding layer's ``keys``
    (row 0) are matched, key vector by key vector, against the keys of every position of ``seq`` (``[B, T]``
    int64, the tokens the cache was fed) computed by one forward of ``seq`` into a cache that keeps every token
    (``DynamicCache`` of plain layers: the model still applies its sliding masks). A sliding layer must hold the
    last tokens fed; one that holds an older position while missing a newer one — the window's oldest slot read
    in place of its newest, a ring buffer's start slot misplaced at the wrap — is named with the positions it
    holds and the ones it should. Returns the cause, or None when every sliding layer holds a suffix of ``seq``
    (or the measurement does not apply: no sliding layer, an encoder-decoder model, keys that cannot be read).
    One extra forward, run only on a failure."""
    import torch
    from transformers import DynamicCache

    from kvconform.checks._drive import forward_kwargs
    from kvconform.checks._measure import layer_list

    if ctx.model.is_encoder_decoder or not ctx.model.sliding_window or cache is None:
        return None
    types, kwargs = compat.layer_types_and_kwargs(ctx.model.config)
    layers = layer_list(cache)
    sliding = [i for i, t in enumerate(types) if t in ("sliding_attention", "chunked_attention") and i < len(layers)]
    held = {}
    for i in sliding:
        try:
            keys = layers[i].keys
        except Exception:  # noqa: BLE001 - a layer whose keys cannot be read is not measured
            continue
        if isinstance(keys, torch.Tensor) and keys.dim() == 4 and keys.shape[-2] > 0:
            held[i] = keys[0].detach().to(torch.float64).transpose(0, 1).reshape(keys.shape[-2], -1)
    if not held:
        return None
    full = DynamicCache()  # no config: plain layers that keep every token
    m = ctx.model.model
    try:
        with torch.no_grad():
            m(**forward_kwargs(m, full, seq[:1], 0))
    except Exception:  # noqa: BLE001 - no measurement without the full-history keys
        return None
    total = seq.shape[1]
    for i, rows in held.items():
        ref = getattr(full.layers[i], "keys", None)
        if not isinstance(ref, torch.Tensor) or ref.dim() != 4 or ref.shape[-2] != total:
            continue
        ref = ref[0].detach().to(torch.float64).transpose(0, 1).reshape(total, -1)
        if ref.shape[-1] != rows.shape[-1]:
            continue
        dist = (rows[:, None, :] - ref[None, :, :]).abs().amax(-1)  # [held, T]
        best, where = dist.min(dim=-1)
        scale = float(ref.abs().max()) or 1.0
        positions = [int(p) if float(d) <= 1e-3 * scale else None for d, p in zip(best, where)]
        n = len(positions)
        expected = list(range(total - n, total))
        if sorted(p for p in positions if p is not None) == expected:
            continue  # the last n positions (in any order: attention does not depend on it)
        window = kwargs[i].get("sliding_window") or ctx.model.sliding_window
        found = [p for p in positions if p is not None]
        stale = sorted(set(found) - set(expected))
        lost = sorted(set(expected) - set(found))
        unwritten = n - len(found)
        shown = _ranges(sorted(found)) + (f" and {unwritten} slot(s) matching no position fed" if unwritten else "")
        head = (f"sliding layer {i} (window {window}) holds the keys of positions {shown} after {total} tokens, but "
                f"should hold the last {n}: {_ranges(expected)}")
        if stale and lost and min(stale) < min(expected):
            shift = min(expected) - min(found)
            return (f"{head} — it keeps position{'s' if len(stale) > 1 else ''} {_ranges(stale)} (already out of the "
                    f"window) in place of the newest, {_ranges(lost)}: the window's oldest slot is read in place of "
                    f"its newest, as a ring buffer whose start slot (where the oldest kept token lies) is misplaced "
                    f"by {shift} once the window wraps"
                    + ("" if unwritten else " (every key it holds is a token fed, stored intact: the slots are read "
                                            "from the wrong start)"))
        return f"{head}: the sliding window keeps the wrong tokens"
    return None


def _ranges(positions) -> str:
    """``[3, 4, 5, 9]`` → ``"3-5, 9"``."""
    runs: list[list[int]] = []
    for p in positions:
        if runs and p == runs[-1][1] + 1:
            runs[-1][1] = p
        else:
            runs.append([p, p])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs) or "none"
