"""Family ``contract``: the API surface callers rely on is there, and the bookkeeping it reports is true.

* ``check_api_contract``: every method or attribute a caller needs, for each capability the subject declares, is
  present and works on a prefilled cache. A missing one (``AttributeError``, ``NotImplementedError``, or a
  ``TypeError`` refusing the call) is one failed contract item naming the method and the callers that need it (beam
  search, assisted decoding, ...), never a crash of the check.
* ``check_length_bookkeeping``: after every op of the case (those whose capability the subject declares),
  ``get_seq_length()`` equals the tokens the cache holds (pads included; 0 after ``reset``), ``get_max_length()``
  stays the same int, and at every forward each attention layer's ``get_mask_sizes(q, layer)`` — asked just before
  — matches what its ``update`` then returned: ``kv_length`` = the number of keys returned, ``kv_offset`` covering
  every position the new queries may attend (0 for full attention, at most ``held − window + 1`` for a sliding
  layer), ``kv_offset + kv_length ≥ held + q``.
* ``check_crop_refused``: a subject that does not declare ``crop`` (``is_croppable`` False) refuses ``crop`` with a
  clear error instead of an unrelated exception or a silent, wrong crop.
* ``check_encoder_decoder_subcaches``: in an ``EncoderDecoderCache`` the cross-attention sub-cache holds the encoder
  states once, unchanged by decoding, and the self-attention sub-cache holds the decoder tokens fed.

Evicting subjects past their budget (``kind="evicting"``, ``Budget.tokens_max``): ``check_evicting_bounds``,
``check_evicting_crop`` and ``check_evicting_ops``, in the section "the evicting contract" below.
"""

from __future__ import annotations

import copy

from kvconform import compat
from kvconform.checks import ALL_KINDS, IGNORES_OPS, OP_PARAMS, CheckSkipped, OpRule, Param, register
from kvconform.checks._diagnosis import describe_exception, describe_raise, fail_raised, measured_cause
from kvconform.checks._drive import (SubjectRaised, case_generator, encoder_ids_for, forward, image_prompt,
                                     layer_items, layer_list, random_tokens, read_attr, self_half, seq_length)
from kvconform.checks._interpreter import Runner, StopRun
from kvconform.checks._judge import judge, record_verdict
from kvconform.subjects import FRESH, kind_of
from kvconform.checks._lossy import CLEAR_ERRORS, LOSSY_OPS, drive, fail_subject_raised, oracle_slices
from kvconform.checks._observe import FORWARD_OPS, run_observed
from kvconform.checks._refusal import CROP_WORDS, changed, clear_error, snapshot
from kvconform.ops import OP_CAPABILITY, op_names
from kvconform.oracle import compare_logits

ATTENTION_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "hybrid", "hybrid_sliding")
SLIDING_TYPES = ("sliding_attention", "chunked_attention", "hybrid_sliding")


# ------------------------------------------------------------------------------------------------ api contract
def _attention_layers(ctx):
    return [i for i, t in enumerate(ctx.model.layer_types) if t in ATTENTION_TYPES]


def _contract_items(ctx, held, step):
    """(capability, item, callers, exercise(cache)) — ``exercise`` raises when the item is missing or broken.
    ``step(cache)`` feeds one more token to a prefilled cache."""
    import torch

    batch = ctx.case.batch
    layers = _attention_layers(ctx)

    def seq_len(c):
        if not layers:  # an all-linear cache may refuse: it holds no tokens (transformers raises a ValueError)
            return
        value = c.get_seq_length()
        frozen = int(value)
        if frozen != held:
            raise ValueError(f"returned {frozen} for a cache holding {held} tokens")
        return value

    def seq_len_snapshot(c):
        if not layers:
            return
        value = c.get_seq_length()
        before = int(value)
        step(c)
        if int(value) != before:
            raise ValueError(f"the value it returned ({before}) became {int(value)} after the next forward: it is "
                             f"the cache's live counter, not a snapshot")

    def mask_sizes(c):
        for i in layers:
            kv_len, kv_off = c.get_mask_sizes(1, i)
            int(kv_len), int(kv_off)

    def max_len(c):
        value = getattr(c, compat.max_length_name())()
        if not isinstance(value, int) and not (isinstance(value, torch.Tensor) and value.dim() == 0):
            raise TypeError(f"returned {type(value).__name__}, not an int")

    return [
        ("forward", "get_seq_length()", "models deriving positions without position_ids; generate() slicing a "
         "reused prompt", seq_len),
        ("forward", "get_seq_length() returns a snapshot", "callers keeping the length across a forward "
         "(start = cache.get_seq_length(); model(...); positions from start)", seq_len_snapshot),
        ("forward", "get_mask_sizes(query_length, layer_idx)", "masking_utils (every attention mask)", mask_sizes),
        ("forward", f"{compat.max_length_name()}()", "generate() and the masks of fixed-size caches", max_len),
        ("forward", "is_compileable", "generate() (4D masks, automatic compilation)",
         lambda c: bool(c.is_compileable)),
        ("reorder", "reorder_cache(beam_idx)", "beam search: generate(num_beams > 1)",
         lambda c: c.reorder_cache(torch.arange(batch).flip(0))),
        ("crop", "is_croppable", "assisted decoding and prompt lookup (read after the prefill)",
         lambda c: bool(c.is_croppable)),
        ("crop", "activate_past_recording()", "assisted decoding, generate's deferred stop check",
         lambda c: c.activate_past_recording()),
        ("crop", "crop(-n)", "assisted decoding, prompt lookup, generate's deferred stop check (rollback)",
         lambda c: _crop_allowing_refusal(c, held)),
        ("batch_repeat", "batch_repeat_interleave(repeats)", "contrastive search (Hub custom_generate), expanding "
         "a prefilled prompt cache for parallel sampling", lambda c: c.batch_repeat_interleave(2)),
        ("batch_select", "batch_select_indices(indices)", "contrastive search (Hub custom_generate)",
         lambda c: c.batch_select_indices(torch.arange(batch))),
        ("reset", "reset()", "reusing one cache object across generate() calls; CUDA-graph serving loops",
         lambda c: c.reset()),
        ("deepcopy", "copy.deepcopy(cache)", "prefix caching and multi-turn reuse", copy.deepcopy),
    ]


def _in_installed_api(item: str) -> bool:
    """An item is part of the contract only if the installed transformers' ``Cache`` defines it (callers of that
    version use it): ``is_croppable`` exists since 5.18, ``activate_past_recording`` since 5.2x."""
    from transformers import Cache

    name = item.split("(")[0].split(" ")[0]
    return name.startswith("copy.") or hasattr(Cache, name)


def _crop_allowing_refusal(cache, held=None):
    """Call ``crop(-1)``; a refusal raised as ``ValueError``/``RuntimeError`` (a state the cache cannot roll back)
    counts as present — the crop family judges it."""
    try:
        compat.crop(cache, 1, held)
    except (ValueError, RuntimeError):
        pass


@register("contract", needs=("forward",), params=OP_PARAMS,
          ops=OpRule(shape=("prefill",), optional=True,
                     why="it prefills once (6 tokens without ops), then calls the API"))
def check_api_contract(ctx):
    """Every method a caller needs (per declared capability) is present and callable on a prefilled cache; each
    missing one is a failed contract item naming the method and its callers."""
    n = ctx.case.ops[0].n if ctx.case.ops and ctx.case.ops[0].name == "prefill" else 6

    runners = {}

    def prefilled():
        runner = Runner(ctx, ctx.new_cache())
        runner.feed(n, f"prefill({n})")
        runners[id(runner.cache)] = runner
        return runner.cache

    def step(cache):
        runners[id(cache)].feed(1, "decode")

    try:
        prefilled()
    except SubjectRaised as exc:
        fail_raised(ctx, exc, "the cache cannot even take a prefill (see the exception)", f"prefill({n})")
    items = [it for it in _contract_items(ctx, n, step) if it[0] in ctx.subject.capabilities
             and _in_installed_api(it[1])]
    problems = []
    for capability, name, callers, exercise in items:
        cache = prefilled()
        try:
            exercise(cache)
        except SubjectRaised as exc:
            problems.append((name, callers, "the next forward raised " + describe_exception(exc.cause), False))
        except Exception as exc:  # noqa: BLE001 - missing (AttributeError...) or present but broken
            missing = isinstance(exc, (AttributeError, NotImplementedError, TypeError))
            problems.append((name, callers, describe_exception(exc), missing))
    if problems:
        lines = [f"{len(problems)} of {len(items)} contract items fail on a cache prefilled with {n} tokens:"]
        for name, callers, error, _ in problems[:5]:
            lines.append(f"{name} — {_short(error)} — needed by {callers}")
        if len(problems) > 5:
            lines.append(f"... and {len(problems) - 5} more: {', '.join(p[0] for p in problems[5:])}")
        causes = []
        if any(p[3] for p in problems):
            causes.append("the cache class (or one of its layer classes) does not implement "
                          + ", ".join(p[0] for p in problems if p[3])
                          + " — implement it, or undeclare the capability (kvconform_capabilities)")
        if any(not p[3] for p in problems):
            causes.append(", ".join(p[0] for p in problems if not p[3]) + " exists but reports a wrong or live "
                          "value, or leaves the cache unusable")
        lines.append("likely cause: " + "; ".join(causes))
        ctx.fail(lines, {"missing": [p[0] for p in problems if p[3]],
                         "broken": [p[0] for p in problems if not p[3]], "items": len(items)})
    ctx.metrics.update(items=len(items))


def _short(error: str, limit: int = 110) -> str:
    """The error text without the ``(at file:line in fn)`` suffix, cut to ``limit`` characters."""
    text = error.split(" (at ")[0]
    return text if len(text) <= limit else text[:limit - 3] + "..."


# ------------------------------------------------------------------------------------------------ bookkeeping
class UpdateSpy:
    """Records ``(layer_idx, new_tokens, returned_length)`` for every ``update`` call of the (self-attention) cache,
    calling through to the real method (an instance attribute shadowing the class method)."""

    def __init__(self, cache):
        self.target = getattr(cache, "self_attention_cache", cache)
        self.calls = []
        original = self.target.update

        def update(*args, **kwargs):
            keys, values = original(*args, **kwargs)
            layer_idx = kwargs.get("layer_idx", args[2] if len(args) > 2 else None)
            key_states = kwargs.get("key_states", args[0] if args else None)
            self.calls.append((layer_idx, int(key_states.shape[-2]), int(keys.shape[-2])))
            return keys, values

        self.target.update = update


def stored_tokens(cache) -> int | None:
    """The number of tokens the unbounded attention layers of ``cache`` (or its self-attention half) store, read from
    their key tensors (``[B, H, T, D]``: ``T``), when they all agree; None when there is no such layer (static,
    sliding or linear-attention layers only: their buffers do not say how many tokens are held) or they disagree."""
    import torch

    lengths = set()
    for layer in layer_list(self_half(cache)):
        keys = read_attr(layer, "keys")
        try:
            unbounded = compat.max_length(layer) == -1
        except Exception:  # noqa: BLE001
            continue
        if unbounded and isinstance(keys, torch.Tensor) and keys.dim() == 4:
            lengths.add(int(keys.shape[-2]))
    return lengths.pop() if len(lengths) == 1 else None


def _length_cause(fault) -> str:
    """The likely cause of the first wrong ``get_seq_length()``: the counter, or the stored keys themselves."""
    op, reported, held, stored = fault
    if stored is not None and stored != held:
        more = stored - held
        return (f"after {op} the cache stores {stored} tokens where it should hold {held} ({abs(more)} "
                f"{'too many' if more > 0 else 'too few'}): {op} {'kept' if more > 0 else 'dropped'} tokens in its "
                f"keys/values — the stored state is wrong, not only the counter")
    return ("get_seq_length() does not count what update() stored (an off-by-one, or a counter that crop(), "
            "reset() or a batch op forgot to update) — models derive positions from it")


def _lengths_differ(cache, runner) -> bool:
    try:
        return int(cache.get_seq_length()) != runner.length
    except Exception:  # noqa: BLE001
        return False


def _windows(ctx):
    """Per-layer sliding window (None for full attention) of the decoder."""
    from kvconform.compat import layer_types_and_kwargs

    types, kwargs = layer_types_and_kwargs(ctx.model.config)
    return [kw.get("sliding_window") if t in SLIDING_TYPES else None for t, kw in zip(types, kwargs)]


class Bookkeeping:
    """Observer of ``check_length_bookkeeping``: before every forward it asks ``get_mask_sizes`` of each attention
    layer, after it compares with what ``update`` returned (``UpdateSpy``); after every op it compares
    ``get_seq_length()`` with the tokens held and checks ``get_max_length()`` is stable. ``problems`` collects
    message lines; the first op with a problem ends the run (``StopRun``)."""

    def __init__(self, ctx, cache, skipped):
        self.ctx, self.cache, self.skipped = ctx, cache, skipped
        self.spy = UpdateSpy(cache)
        self.layers, self.windows = _attention_layers(ctx), _windows(ctx)
        self.problems, self.trail = [], []
        self.max_first = None
        self.held, self.predicted = 0, {}
        self.length_fault = None
        """(op label, get_seq_length(), tokens it should hold, tokens stored or None) at the first wrong length."""

    def before_forward(self, runner, label, n):
        """Ask ``get_mask_sizes(n, layer)`` of each attention layer."""
        self.held, self.predicted = runner.length, {}
        for i in self.layers:
            try:
                self.predicted[i] = tuple(int(x) for x in self.spy.target.get_mask_sizes(n, i))
            except Exception as exc:  # noqa: BLE001
                self.problems.append(f"get_mask_sizes({n}, {i}) raised {describe_exception(exc)}")
        self.spy.calls.clear()

    def after_forward(self, runner, step):
        """Compare each ``update`` call's returned key count with the prediction."""
        held = self.held
        for layer_idx, q, returned in self.spy.calls:
            if layer_idx not in self.predicted:
                continue
            kv_len, kv_off = self.predicted[layer_idx]
            window = self.windows[layer_idx] if layer_idx < len(self.windows) else None
            first_needed = 0 if window is None else max(held - window + 1, 0)
            if self.ctx.kind.presses:  # a press announces the tokens it kept: its slots end at the last position
                first_needed = max(first_needed, kv_off) if kv_off + kv_len == held + q else first_needed
            if returned != kv_len:
                self.problems.append(f"at {step.label}: layer {layer_idx} update() returned {returned} keys, but "
                                     f"get_mask_sizes({q}) said kv_length={kv_len}")
            elif kv_off > first_needed or kv_off + kv_len < held + q:
                self.problems.append(f"at {step.label}: layer {layer_idx} get_mask_sizes({q}) = "
                                     f"(kv_length={kv_len}, kv_offset={kv_off}) does not cover positions "
                                     f"{first_needed}..{held + q - 1}")

    def after_op(self, runner, op, op_index):
        """``get_seq_length()`` against the tokens held, ``get_max_length()`` stable; stop at the first problem."""
        cache, trail, problems = self.cache, self.trail, self.problems
        trail.append(op.label)
        if self.layers:
            try:
                reported = int(cache.get_seq_length())
            except Exception as exc:  # noqa: BLE001
                problems.append(f"after {' → '.join(trail)}: get_seq_length() raised {describe_exception(exc)}")
                raise StopRun from exc
            if reported != runner.length:
                stored = stored_tokens(cache)
                problems.append(f"after {' → '.join(trail)}: get_seq_length() = {reported}, but the cache should "
                                f"hold {runner.length} tokens"
                                + (f" (its unbounded attention layers store {stored})" if stored is not None else ""))
                if self.length_fault is None:
                    self.length_fault = (op.label, reported, runner.length, stored)
        try:
            value = compat.max_length(cache)
        except Exception as exc:  # noqa: BLE001
            problems.append(f"after {' → '.join(trail)}: get_max_length() raised {describe_exception(exc)}")
            raise StopRun from exc
        if self.max_first is None:
            self.max_first = value
            if value == 0 or value < -1:
                problems.append(f"get_max_length() = {value}: should be -1 (unbounded) or the capacity")
        elif value != self.max_first:
            problems.append(f"after {' → '.join(trail)}: get_max_length() = {value}, was {self.max_first}")
        if problems:
            raise StopRun

    def on_raise(self, runner, op, op_index, exc) -> bool:
        """An op the cache refuses (clearly) or lacks is the crop / batch / contract families' finding: note it and
        go on (unless a refused crop changed the length); any other exception fails the item."""
        refused = op.name not in ("prefill", "decode", "chunk") and (
            isinstance(exc.cause, (AttributeError, NotImplementedError, TypeError))
            or clear_error(exc.cause, CROP_WORDS))
        if not refused:
            fail_raised(self.ctx, exc, "the cache does not support this sequence of calls (see the exception)",
                        " → ".join(self.trail + [op.label]))
        self.trail.append(op.label + " (refused)")
        self.skipped.append(op.label + " (refused)")
        if op.name == "crop" and _lengths_differ(self.cache, runner):
            self.problems.append(f"after {' → '.join(self.trail)}: the refused crop changed get_seq_length() to "
                                 f"{int(self.cache.get_seq_length())}, but the cache should still hold "
                                 f"{runner.length}")
            return False
        return True


@register("contract", needs=("forward",), params=OP_PARAMS,
          ops=OpRule(allowed=op_names(copies=False),
                     why="it spies on update(); a fork would share the spy between copies"))
def check_length_bookkeeping(ctx):
    """After every op, ``get_seq_length()`` equals the tokens held and ``get_max_length()`` is stable; at every
    forward, ``get_mask_sizes`` (asked just before) matches what ``update`` returned."""
    ops = [op for op in ctx.case.ops if op.name not in OP_CAPABILITY
           or OP_CAPABILITY[op.name] in ctx.subject.capabilities]
    skipped = [op.label for op in ctx.case.ops if op not in ops]
    if any(op.spec.copies for op in ops):
        raise ValueError(f"case {ctx.case.id}: check_length_bookkeeping spies on update(); a fork would share the "
                         f"spy between copies")
    cache = ctx.new_cache()
    book = Bookkeeping(ctx, cache, skipped)
    Runner(ctx, cache, observers=[book]).run(ops, parked=False, on_raise=book.on_raise)
    problems = book.problems
    ctx.metrics.update(ops=len(ops), skipped_ops=skipped, update_calls_checked=True)
    if problems:
        cause = (_length_cause(book.length_fault) if book.length_fault is not None and "get_seq_length() ="
                 in problems[0] else
                 "get_seq_length() does not count what update() stored (an off-by-one, or a counter that crop(), "
                 "reset() or a batch op forgot to update) — models derive positions from it"
                 if "get_seq_length" in problems[0] else
                 "get_mask_sizes() and update() disagree on which keys the next forward sees — the attention mask "
                 "then hides the wrong positions" if "get_mask_sizes" in problems[0] else
                 _max_length_cause(problems[0], book.max_first))
        ctx.fail([problems[0], *problems[1:3],
                  f"ops: {' → '.join(op.label for op in ops)}"
                  + (f"   (skipped: {', '.join(skipped)})" if skipped else ""),
                  "likely cause: " + cause], {"problems": problems[:5]})


def _max_length_cause(problem: str, first) -> str:
    """The likely cause of a ``get_max_length()`` problem (``problem``: the first one recorded; ``first``: the value
    its first call returned, None when it never returned): a method that raises from its first call, one that
    raises later, a first value that is no capacity, or a value that changes."""
    name = compat.max_length_name()
    if "raised" in problem:
        if first is None:
            return (f"{name}() raises from its first call: it is missing or broken for this cache, not changing "
                    f"over its life — it should return -1 (unbounded) or the capacity in tokens (generate() and "
                    f"the mask builders read it)")
        return (f"{name}() answered {first} at first and raises after a later op: that op leaves the cache in a "
                f"state its {name}() cannot read")
    if first is not None and "should be -1" in problem:
        return (f"{name}() returns {first} from its first call: neither -1 (unbounded) nor a capacity in tokens — "
                f"a 0 or an unset field where the capacity should be")
    return f"{name}() changes over the cache's life"


# ------------------------------------------------------------------------------------------ crop refusal
def _not_croppable(subject, model, case, device="cpu"):
    if "crop" in subject.capabilities:
        return f"{subject.name} declares crop: the crop family checks it"
    return None


@register("contract", needs=("forward",), applies=_not_croppable,
          ops=OpRule(allowed=LOSSY_OPS, required=("crop",), why="it checks that crop() is refused"))
def check_crop_refused(ctx):
    """A subject that does not declare ``crop`` refuses ``crop(-n)`` with a clear error (ValueError,
    NotImplementedError, RuntimeError or TypeError), whatever state it is in (e.g. right after a residual flush);
    an unrelated exception or a crop that is silently accepted fails."""
    ops = ctx.case.ops
    crop_at = next((i for i, op in enumerate(ops) if op.name == "crop"), None)
    if crop_at is None:
        raise ValueError(f"case {ctx.case.id}: check_crop_refused needs a 'crop N' op")
    cache = ctx.new_cache()
    try:
        steps = drive(ctx, cache, stop_before=crop_at)
    except SubjectRaised as exc:
        fail_subject_raised(ctx, exc, "the cache does not support the ops before the crop (see the exception)")
    before = seq_length(cache)
    n = ops[crop_at].n
    croppable = getattr(cache, "is_croppable", None)
    ctx.metrics.update(is_croppable=croppable, length_before=before, steps=len(steps))
    try:
        compat.crop(cache, n, steps[-1].start + steps[-1].length if steps else 0)
    except CLEAR_ERRORS as exc:
        ctx.metrics.update(raised=type(exc).__name__)
        return
    except Exception as exc:  # noqa: BLE001 - an accident, not a refusal
        err = SubjectRaised(ops[crop_at].label, exc)
        ctx.metrics.update(raised=type(exc).__name__)
        ctx.fail([f"crop(-{n}) raised {describe_raise(err)}, but should refuse with a clear error "
                  f"(ValueError / NotImplementedError naming crop)",
                  f"ops: {ctx.case.ops_label()}   [raised at {ops[crop_at].label}]",
                  f"is_croppable = {croppable}",
                  "likely cause: crop() is inherited from a layer class that does not know this layer's storage "
                  "(e.g. DynamicLayer.crop slicing an emptied residual) instead of being refused"])
    after = seq_length(cache)
    ctx.metrics.update(length_after=after)
    ctx.fail([f"crop(-{n}) was accepted (get_seq_length() {before} → {after}), but should raise: the subject does "
              f"not declare crop and is_croppable = {croppable}",
              f"ops: {ctx.case.ops_label()}   [at {ops[crop_at].label}]",
              "likely cause: crop() is inherited from a layer class that only sees part of the storage (e.g. "
              "the exact residual of a quantized layer), so it cannot crop correctly and should refuse"])



# ------------------------------------------------------------------------------------------ encoder-decoder
def _encoder_decoder_case(case):
    """Load-time rule of ``check_encoder_decoder_subcaches`` (``register(validate=...)``): encoder-decoder models."""
    if "encoder_decoder" not in case.requires:
        return "requires", ("check_encoder_decoder_subcaches reads the cross-attention sub-cache: it needs requires = "
                            "['encoder_decoder']")
    return None


@register("contract", needs=("forward",), ops=OpRule(allowed=FORWARD_OPS, min_forwards=1),
          validate=_encoder_decoder_case)
def check_encoder_decoder_subcaches(ctx):
    """In the ``EncoderDecoderCache`` built from the subject: after every forward the cross-attention sub-cache
    holds ``encoder_len`` tokens, its keys/values unchanged since the first forward, and the self-attention
    sub-cache holds the decoder tokens fed; every step's logits equal the oracle."""
    import torch

    if not ctx.model.is_encoder_decoder:
        raise ValueError(f"case {ctx.case.id}: check_encoder_decoder_subcaches needs requires = ['encoder_decoder']")
    cache = ctx.new_cache()
    first_cross, problems, fed = [], [], [0]

    def cross_state():
        return [(read_attr(layer, "keys").clone(), read_attr(layer, "values").clone())
                for layer in layer_list(read_attr(cache, "cross_attention_cache"))
                if isinstance(read_attr(layer, "keys"), torch.Tensor) and isinstance(read_attr(layer, "values"),
                                                                                     torch.Tensor)]

    def observe(step):
        fed[0] += step.length
        cross_len, self_len = seq_length(cache.cross_attention_cache), seq_length(cache.self_attention_cache)
        if cross_len != ctx.case.encoder_len:
            problems.append(f"after {step.label}: cross-attention sub-cache holds {cross_len} tokens, but should "
                            f"hold the {ctx.case.encoder_len} encoder tokens")
        if self_len != fed[0]:
            problems.append(f"after {step.label}: self-attention sub-cache holds {self_len} tokens, but should "
                            f"hold the {fed[0]} decoder tokens fed")
        state = cross_state()
        if not first_cross:
            first_cross.extend(state)
        elif len(state) != len(first_cross) or any(
                not (torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])) for a, b in zip(first_cross, state)):
            problems.append(f"after {step.label}: cross-attention keys/values changed since the first forward")

    try:
        steps = run_observed(ctx, cache, observe)
    except SubjectRaised as exc:
        ctx.fail([f"the subject raised {describe_raise(exc)}",
                  f"ops: {ctx.case.ops_label()}   [raised at {exc.where}]",
                  "likely cause: " + (measured_cause(exc)
                                      or "the subject cannot serve as one half of an EncoderDecoderCache")],
                 {"raised": type(exc.cause).__name__, "failed_at": exc.where})
    tol = ctx.tolerance()
    if ctx.kind.target == FRESH:  # a lossy subject: against a fresh instance fed the same history
        verdict = judge(ctx, steps)
        cmps = [verdict.first_fail or verdict.worst]
        record_verdict(ctx, verdict, len(steps))
    else:
        exact = oracle_slices(ctx, steps)
        cmps = [(step, compare_logits(step.logits, *exact[step.index], tol)) for step in steps]
    worst = max(cmps, key=lambda sc: sc[1].max_abs)[1]
    ctx.metrics.update(max_abs=worst.max_abs, tolerance=worst.tol, noise_floor=worst.floor, steps=len(steps),
                       cross_layers_compared=len(first_cross))
    bad = next(((step, c) for step, c in cmps if not c.passed), None)
    if bad is not None:
        step, c = bad
        versus = f" vs {verdict.target}" if ctx.kind.target == FRESH else ""
        problems.insert(0, f"max|Δlogit| = {c.max_abs:.1e}{versus} at {step.label}, but should be ≤ {c.tol:.1e} "
                           f"({tol.describe(c.floor)})")
    if problems:
        if any("self-attention" in p for p in problems):
            cause = ("get_seq_length() of the self-attention sub-cache does not count the decoder tokens it stores "
                     "(the model derives decoder positions from it)")
        elif any("cross-attention" in p for p in problems):
            cause = ("the cross-attention sub-cache is written to again (appended, cleared or modified in place) "
                     "while decoding; it must hold the encoder states exactly once")
        else:
            cause = "the subject mishandles one half of the EncoderDecoderCache (see the logits family)"
        ctx.fail([*problems[:3], f"ops: {ctx.case.ops_label()} (encoder input {ctx.case.encoder_len} tokens)",
                  "likely cause: " + cause])


# ================================================================================= the evicting contract
# The contract of an *evicting* cache (``kind="evicting"``, ``Budget.tokens_max``), checked past ``tokens_max``
# (family ``contract``; see docs/lossy-evicting-paged.md, "Evicting caches").
#
# An evicting cache drops tokens (attention sinks + window, KV presses). Below ``tokens_max`` held tokens it is exact,
# so the exact families' cases that stay below apply to it unchanged (``Kind.not_judged`` skips the
# others). Past ``tokens_max`` its logits are judged by quality and its memory bound (family ``quality``); what holds
# exactly whatever it evicted is checked here:
#
# * ``check_evicting_bounds``: a prefill longer than ``tokens_max`` into an empty cache is exact (eviction comes
#   *after* the forward that brings the tokens: ``update`` returns every held token and the whole new chunk); after
#   every forward ``get_seq_length()`` is the number of tokens seen (the next position), not the number held; and
#   each attention layer holds at most ``tokens_max`` tokens per row (decode steps and a chunk longer than the window
#   included).
# * ``check_evicting_crop``: after eviction, ``crop(-k)`` either leaves the cache exactly as if it had never seen the
#   last ``k`` tokens (the next logits equal those of a fresh instance fed only the rest), or is refused with a clear
#   error and changes nothing.
# * ``check_evicting_ops``: after eviction, ``reorder_cache`` / ``batch_select_indices`` / ``batch_repeat_interleave``
#   / ``reset`` / ``copy.deepcopy`` behave as for any cache: the next logits equal those of a fresh instance of the
#   same class fed the equivalent history (the rows permuted, selected or repeated; a new sequence; the same one),
#   forward for forward — exact wherever the class is deterministic, however much it evicted.
#
# Each check builds its own program from the subject's ``tokens_max`` (``T``): ``prefill(T + over)``, then decode
# steps and a chunk longer than ``T``; ``params.over`` (default 5) sets how far past ``T`` the prefill goes.


def evicting_only(subject, model, case, device="cpu"):
    """Applicability rule: evicting subjects only (``kind="evicting"`` with a ``tokens_max`` budget)."""
    kind = kind_of(subject)
    if not kind.evicts or kind.exact_limit is None:
        return "applies to evicting subjects only (kind='evicting' with a tokens_max or keep_ratio budget)"
    return None


def held_tokens(cache) -> dict:
    """``{layer index: tokens held per row}`` of every attention layer of ``cache`` (its self-attention half for
    an ``EncoderDecoderCache``) whose keys are a ``[batch, heads, tokens, head_dim]`` tensor named ``keys``;
    layers without such a tensor (linear-attention states, other storage) are left out."""
    import torch

    out = {}
    for i, layer in layer_items(self_half(cache)):
        keys = read_attr(layer, "keys")
        if isinstance(keys, torch.Tensor) and keys.dim() == 4:
            out[i] = int(keys.shape[-2])
    return out


_PARAMS = {"over": Param(int, default=5, min=1, doc="tokens past tokens_max of the first prefill")}


class _Driver:
    """One cache of the subject fed seeded tokens through the interpreter (``Runner.feed``: the one place that feeds
    a cache), with the sequence it was fed (``seq`` ``[B, T]``; a check that applies an op itself sets ``seq`` to
    what the cache should hold after it)."""

    def __init__(self, ctx, cache, encoder_ids):
        self.runner = Runner(ctx, cache, position_mode="auto", padding=[])
        self.runner.encoder_ids = encoder_ids

    @property
    def cache(self):
        """The cache being fed."""
        return self.runner.cache

    @cache.setter
    def cache(self, cache):
        self.runner.cache = cache

    @property
    def encoder_ids(self):
        """The encoder input ``[B, E]`` (None for decoder-only models)."""
        return self.runner.encoder_ids

    @encoder_ids.setter
    def encoder_ids(self, encoder_ids):
        self.runner.encoder_ids = encoder_ids

    @property
    def seq(self):
        """The tokens the cache should hold, ``[B, T]`` int64."""
        return self.runner.seq

    @seq.setter
    def seq(self, seq):
        self.runner.seq, self.runner.batch = seq, int(seq.shape[0])
        self.runner._cut_chunks(int(seq.shape[1]))

    def feed(self, tokens, label):
        """One forward of ``tokens`` ``[B, n]``; returns float64 logits ``[B, n, V]``.

        Raises:
            SubjectRaised: the subject raised (names ``label``).
        """
        if self.runner.length == 0:
            self.seq = tokens[:, :0]
        return self.runner.feed(int(tokens.shape[1]), label, tokens=tokens).logits


def _tokens(ctx, gen, batch, n, prompt: bool = False):
    """``[batch, n]`` seeded tokens; ``prompt``: the first tokens of a sequence, which on a VLM start with its image
    (``image_prompt``; a prompt too short for the image block stays text)."""
    tokens = random_tokens(gen, batch, n, ctx.model.vocab_size)
    return image_prompt(ctx.model, tokens) if prompt else tokens


SHARE_PAST = 12
"""How far past ``tokens_exact`` the programs of a share-evicting subject (``keep_ratio``) go at least, so that it
has evicted before the op under test."""


def _tokens_max(ctx) -> int:
    """``T`` of the evicting programs: ``tokens_max``, or for a subject evicting a share (``keep_ratio``) its
    ``tokens_exact`` + ``SHARE_PAST`` (it evicts from ``tokens_exact`` on)."""
    kind = kind_of(ctx.subject)
    if kind.keep_ratio is not None:
        return int(kind.exact_limit or 0) + SHARE_PAST
    return int(ctx.subject.budget.tokens_max)


def _max_abs(a, b) -> float:
    return float((a - b).abs().max())


# ------------------------------------------------------------------------------------------ bounds and length
@register("contract", needs=("forward",), judges=ALL_KINDS, applies=evicting_only, params=_PARAMS, ops=IGNORES_OPS)
def check_evicting_bounds(ctx):
    """Past ``tokens_max``: the forward that brings the cache past it is exact, ``get_seq_length()`` counts the
    tokens seen, and each attention layer holds at most ``tokens_max`` tokens per row after every forward."""
    T, over = _tokens_max(ctx), int(ctx.case.params["over"])
    gen = case_generator(ctx.case, ctx.model.name)
    enc = encoder_ids_for(ctx, gen)
    B = ctx.case.batch
    kind = kind_of(ctx.subject)
    exact_upto = kind.exact_limit if kind.keep_ratio is not None else 0  # a share: exact while ≤ tokens_exact seen
    program = [("prefill", T + over), ("decode", 3), ("chunk", T + 3), ("decode", 2)]
    if exact_upto:  # below tokens_exact first, one token at a time, then the forward that crosses it
        first = max(exact_upto - 2, 1)
        program = [("prefill", first), ("decode", exact_upto - first), ("chunk", T + over - exact_upto),
                   ("decode", 3), ("chunk", T + 3), ("decode", 2)]
    ops_text = " → ".join(f"{name}({n})" if name != "decode" else f"decode×{n}" for name, n in program)
    run = _Driver(ctx, ctx.new_cache(), enc)
    tol = ctx.tolerance()
    worst_held = 0
    try:
        for name, n in program:
            for i in range(n if name == "decode" else 1):
                k = 1 if name == "decode" else n
                label = f"{name}({n})" if name != "decode" else f"decode {i + 1} of {n}"
                before = run.runner.length
                logits = run.feed(_tokens(ctx, gen, B, k, prompt=name == "prefill"), label)
                if name == "prefill" or before <= exact_upto:
                    _judge_exact(ctx, run, logits, tol, label, ops_text, before)
                _judge_bounds(ctx, run, label, ops_text, T)
                worst_held = max([worst_held, *held_tokens(run.cache).values()])
    except SubjectRaised as exc:
        fail_raised(ctx, exc, "the cache does not take a sequence longer than its tokens_max (see the exception)",
                    ops_text)
    ctx.metrics.update(tokens_max=T, tokens_fed=int(run.seq.shape[1]), most_held=worst_held,
                       held_readable=bool(held_tokens(run.cache)))


def _judge_exact(ctx, run, logits, tol, label, ops_text, before: int = 0):
    """The forward that fed the cache from ``before`` tokens (its ``logits`` ``[B, n, V]``) against the oracle;
    ``before > 0`` only for a share-evicting subject below its ``tokens_exact``, where nothing may have been
    evicted yet."""
    from kvconform.oracle import compare_logits

    n = logits.shape[1]
    oracle = ctx.oracle.logits(run.seq, encoder_ids=run.encoder_ids)[:, -n:]
    uncached = ctx.oracle.uncached(run.seq, encoder_ids=run.encoder_ids)[:, -n:]
    cmp = compare_logits(logits, oracle, uncached, tol)
    ctx.metrics.update(max_abs=cmp.max_abs, tolerance=cmp.tol, noise_floor=cmp.floor)
    if cmp.passed:
        return
    if before:
        kind = kind_of(ctx.subject)
        ctx.fail([
            f"{label} after {before} tokens: max|Δlogit| = {cmp.max_abs:.1e} against the oracle, but should be ≤ "
            f"{cmp.tol:.1e} ({tol.describe(cmp.floor)}): the cache declares it evicts nothing before "
            f"{kind.exact_limit} tokens seen (tokens_exact)",
            f"ops: {ops_text}   [failed at {label}]",
            f"likely cause: the cache evicts (or changes what it holds) before tokens_exact = {kind.exact_limit} "
            f"tokens: it holds {', '.join(str(v) for v in held_tokens(run.cache).values()) or '?'} tokens per row "
            f"after {run.runner.length} seen — declare the tokens_exact it keeps, or keep every token up to it",
        ], {"failed_at": label, "tokens_exact": kind.exact_limit})
    ctx.fail([
        f"{label} into an empty cache: max|Δlogit| = {cmp.max_abs:.1e} against the oracle, but should be ≤ "
        f"{cmp.tol:.1e} ({tol.describe(cmp.floor)})",
        f"ops: {ops_text}   [failed at {label}]",
        f"likely cause: the cache evicts inside the forward that brings the tokens (its own chunk): a forward must "
        f"attend every token held before it plus its whole chunk — update() returns them all and announces them "
        f"in get_mask_sizes() — and evict only afterwards (tokens_max {_tokens_max(ctx)})",
    ], {"failed_at": label})


def _judge_bounds(ctx, run, label, ops_text, T):
    fed = int(run.seq.shape[1])
    reported = seq_length(run.cache)
    held = held_tokens(run.cache)
    if reported is not None and reported != fed:
        most = max(held.values(), default=None)
        restart = (f"get_seq_length() reports the tokens held ({most}), not the tokens seen: after an eviction "
                   f"the next token gets position {reported} instead of {fed} (positions restart: RoPE and absolute "
                   f"positions go wrong)") if reported == most else (
                   "get_seq_length() must count every token seen since the last reset (the next token's position), "
                   "whatever was evicted")
        ctx.fail([f"get_seq_length() = {reported} after {label}, but should be {fed} (tokens seen)",
                  f"ops: {ops_text}   [failed at {label}]", f"likely cause: {restart}"],
                 {"reported": reported, "tokens_fed": fed, "failed_at": label})
    kind = kind_of(ctx.subject)
    bound = kind.held_bound(fed) if kind.keep_ratio is not None else T
    over = {i: n for i, n in held.items() if n > bound}
    if over:
        i, n = next(iter(over.items()))
        if kind.keep_ratio is not None:
            declared = ctx.subject.budget.describe_bound()
            ctx.fail([f"attention layer {i} holds {n} tokens per row after {label} ({fed} seen), but should hold ≤ "
                      f"{bound} ({declared})" + (f" (layers over it: {sorted(over)})" if len(over) > 1 else ""),
                      f"ops: {ops_text}   [failed at {label}]",
                      f"likely cause: the cache keeps a larger share than it declares ({n / max(fed, 1):.2f} of the "
                      f"{fed} tokens seen; declared keep_ratio {kind.keep_ratio:g} past "
                      f"{kind.exact_limit} tokens), or does not evict at every step"],
                     {"held": n, "layer": i, "held_bound": bound, "failed_at": label})
        ctx.fail([f"attention layer {i} holds {n} tokens per row after {label} ({fed} seen), but tokens_max is {T}"
                  + (f" (layers over it: {sorted(over)})" if len(over) > 1 else ""),
                  f"ops: {ops_text}   [failed at {label}]",
                  "likely cause: the cache does not evict (or evicts too little): what it holds grows with the "
                  "sequence, so its memory is not bounded by the declared tokens_max"],
                 {"held": n, "layer": i, "tokens_max": T, "failed_at": label})



# ------------------------------------------------------------------------------------------ crop
@register("contract", needs=("forward", "crop"), judges=ALL_KINDS, applies=evicting_only, params={
    **_PARAMS, "crop": Param(int, default=2, min=1, doc="tokens the crop removes after the eviction")},
    ops=IGNORES_OPS)
def check_evicting_crop(ctx):
    """After eviction, ``crop(-k)`` leaves the cache exactly as a fresh instance fed all but the last ``k`` tokens
    (judged on the next step's logits), or is refused with a clear error that changes nothing."""
    from kvconform import compat

    T, over, k = _tokens_max(ctx), int(ctx.case.params["over"]), int(ctx.case.params["crop"])
    gen = case_generator(ctx.case, ctx.model.name)
    enc = encoder_ids_for(ctx, gen)
    B = ctx.case.batch
    prompt, nxt = _tokens(ctx, gen, B, T + over, prompt=True), _tokens(ctx, gen, B, 1)
    ops_text = f"prefill({T + over}) → crop(-{k}) → decode×1"
    tol = ctx.tolerance().bound(0.0)
    a = _Driver(ctx, ctx.new_cache(), enc)
    try:
        a.feed(prompt, f"prefill({T + over})")
        before = snapshot(a.cache)
        refused = None
        try:
            compat.crop(a.cache, k, T + over)
        except Exception as exc:  # noqa: BLE001 - judged below
            refused = exc
        if refused is not None:
            after = snapshot(a.cache)
            if not clear_error(refused, CROP_WORDS):
                ctx.fail([f"crop(-{k}) after eviction raised {describe_exception(refused)}",
                          f"ops: {ops_text}   [failed at crop(-{k})]",
                          "likely cause: a crop the cache cannot honour must be refused with a clear error (a "
                          "ValueError naming the problem), not a raw error from a tensor operation"],
                         {"raised": type(refused).__name__, "failed_at": f"crop(-{k})"})
            if changed(before, after):
                ctx.fail([f"crop(-{k}) after eviction was refused ({describe_exception(refused)}) but changed "
                          f"{', '.join(changed(before, after)[:4])}",
                          f"ops: {ops_text}   [failed at crop(-{k})]",
                          "likely cause: the refusal comes after part of the cache was cropped: check every layer "
                          "before changing any (all-or-nothing)"], {"failed_at": f"crop(-{k})"})
            target_prompt = prompt
        else:
            reported = seq_length(a.cache)
            if reported is not None and reported != T + over - k:
                ctx.fail([f"get_seq_length() = {reported} after crop(-{k}) of {T + over} tokens, but should be "
                          f"{T + over - k}", f"ops: {ops_text}   [failed at crop(-{k})]",
                          "likely cause: crop() must count back the tokens seen (the next token's position)"],
                         {"reported": reported, "failed_at": f"crop(-{k})"})
            a.seq = a.seq[:, : T + over - k]
            target_prompt = prompt[:, : T + over - k]
        got = a.feed(nxt, "decode 1 after crop")
        b = _Driver(ctx, ctx.new_cache(), enc)
        b.feed(target_prompt, f"prefill({target_prompt.shape[1]}) (fresh instance)")
        want = b.feed(nxt, "decode 1 (fresh instance)")
    except SubjectRaised as exc:
        fail_raised(ctx, exc, "the cache cannot continue after a crop past its eviction (see the exception)", ops_text)
    diff = _max_abs(got, want)
    ctx.metrics.update(max_abs=diff, tolerance=tol, crop_refused=refused is not None)
    if diff <= tol:
        return
    what = (f"refused ({type(refused).__name__}) and then" if refused is not None else "accepted, and")
    ctx.fail([f"crop(-{k}) after eviction was {what} the next logits differ from a fresh instance fed "
              f"{'all' if refused is not None else f'the first {T + over - k}'} of the tokens by {diff:.1e} "
              f"(should be ≤ {tol:.1e})",
              f"ops: {ops_text}   [failed at decode 1 after crop]",
              "likely cause: " + ("the refused crop still changed what the cache attends" if refused is not None
                                  else "the cache accepts a crop back past tokens it has already evicted: it cannot "
                                  "bring them back, so it must refuse such a crop (ValueError) — or not declare "
                                  "'crop'")],
             {"failed_at": "decode 1 after crop"})



# ------------------------------------------------------------------------------------------ batch ops, reset, fork
EVICTING_OPS = ("reorder", "select", "repeat", "reset", "fork")
"""The ops this check applies after an eviction (each one's capability: ``kvconform.ops.OP_CAPABILITY``)."""
_NEEDS = OP_CAPABILITY


@register("contract", needs=("forward",), judges=ALL_KINDS, applies=evicting_only, params={
    **_PARAMS, "op": Param(str, required=True, choices=EVICTING_OPS, doc="the op applied after the eviction")},
    ops=IGNORES_OPS)
def check_evicting_ops(ctx):
    """After eviction, ``reorder_cache`` / ``batch_select_indices`` / ``batch_repeat_interleave`` / ``reset`` /
    ``copy.deepcopy`` give the next logits of a fresh instance of the same class fed the equivalent history (the
    same forwards on the permuted / selected / repeated rows; a new sequence; the same sequence)."""
    import torch

    op = ctx.case.params["op"]
    if _NEEDS[op] not in ctx.subject.capabilities:
        raise CheckSkipped(f"{ctx.subject.name} does not declare capability '{_NEEDS[op]}'")
    T, over = _tokens_max(ctx), int(ctx.case.params["over"])
    gen = case_generator(ctx.case, ctx.model.name)
    B = ctx.case.batch
    enc = encoder_ids_for(ctx, gen)
    feeds = [_tokens(ctx, gen, B, T + over, prompt=True), *(_tokens(ctx, gen, B, 1) for _ in range(2))]
    rows = {"reorder": torch.roll(torch.arange(B), 1), "select": torch.arange(1, B) if B > 1 else torch.arange(1),
            "repeat": torch.arange(B).repeat_interleave(2)}.get(op)
    after = [_tokens(ctx, gen, B if rows is None else len(rows), 1) for _ in range(2)]
    ops_text = f"prefill({T + over}) → decode×2 → {op} → decode×2"
    label = op
    try:
        a = _Driver(ctx, ctx.new_cache(), enc)
        for i, t in enumerate(feeds):
            a.feed(t, f"prefill({T + over})" if i == 0 else f"decode {i}")
        cache, original = a.cache, None
        try:
            if op == "reorder":
                cache.reorder_cache(rows)
            elif op == "select":
                cache.batch_select_indices(rows)
            elif op == "repeat":
                cache.batch_repeat_interleave(2)
            elif op == "reset":
                cache.reset()
            else:
                original, a.cache = cache, copy.deepcopy(cache)
        except Exception as exc:  # noqa: BLE001 - the subject's failure
            raise SubjectRaised(op, exc) from exc
        a_enc = enc if enc is None or rows is None else enc[rows]
        a.encoder_ids = a_enc
        if op == "reset":
            a.seq = a.seq[:, :0]
            new = [_tokens(ctx, gen, B, T + over, prompt=True), *after]
        else:
            a.seq = a.seq if rows is None else a.seq[rows]
            new = after
        got = [a.feed(t, f"{'prefill' if (op == 'reset' and i == 0) else 'decode'} {i + 1} after {op}")
               for i, t in enumerate(new)]
        if original is not None:  # the original goes on too, and must not have been touched by the copy's steps
            o = _Driver(ctx, original, enc)
            o.seq = a.seq[:, : -len(new)]
            got_original = [o.feed(t, f"decode {i + 1} on the original after fork") for i, t in enumerate(new)]
        b = _Driver(ctx, ctx.new_cache(), a_enc)
        history = [] if op == "reset" else [t if rows is None else t[rows] for t in feeds]
        for i, t in enumerate(history):
            b.feed(t, f"{'prefill' if i == 0 else 'decode'} (fresh instance)")
        want = [b.feed(t, "fresh instance") for t in new]
    except SubjectRaised as exc:
        fail_raised(ctx, exc, f"the cache cannot {op} after it evicted (see the exception)", ops_text)
    tol = ctx.tolerance().bound(0.0)
    pairs = list(zip(got, want)) + (list(zip(got_original, want)) if original is not None else [])
    diffs = [_max_abs(g, w) for g, w in pairs]
    ctx.metrics.update(max_abs=max(diffs), tolerance=tol)
    if max(diffs) <= tol:
        return
    i = next(j for j, d in enumerate(diffs) if d > tol)
    where = f"decode {i % len(new) + 1} after {op}" + (" (on the original)" if i >= len(new) else "")
    cause = {"reorder": "reorder_cache() does not move every held tensor (sinks and window, per layer) with its row",
             "select": "batch_select_indices() does not select every held tensor (or the seen count) with the rows",
             "repeat": "batch_repeat_interleave() does not repeat every held tensor with the rows",
             "reset": "reset() keeps something of the old sequence (held tokens, the seen count, an eviction state)",
             "fork": "copy.deepcopy shares state between the copy and the original (one's steps change the other)"}
    ctx.fail([f"after {op}: max|Δlogit| = {diffs[i]:.1e} against a fresh instance of the same class fed the "
              f"equivalent history, but should be ≤ {tol:.1e}",
              f"ops: {ops_text}   [failed at {where}]", "likely cause: " + cause[op]],
             {"failed_at": where, "op": label})


# ======================================================================================================================
# The press contract (kind "press")
# The contract of a KV *press* (``kind="press"``, ``kvconform_press = {budget}``; family ``contract``).
#
# A press compresses the prefill: it keeps a subset of the prefill's tokens exactly, at any prompt length, with no
# token bound, and never evicts while decoding. Its logits after the prefill are lossy (judged by the quality family
# against the float64 oracle, and every cache operation by self-consistency like a lossy cache); what holds exactly
# whatever it dropped is checked here, for each prompt length of ``params.prompts`` (short prompts included):
#
# * a prompt the press cannot compress is handled (kept whole or compressed) or refused with a clear error
#   (``ValueError`` / ``RuntimeError`` naming the problem), never a raw ``IndexError`` from a tensor op;
# * the prefill itself is exact: the forward that brings the tokens attends all of them (the press compresses
#   *after* it) — its logits equal the oracle's within the float tolerance;
# * ``get_seq_length()`` is the number of tokens *seen* after every forward (prefill, decode steps, a chunk), not the
#   number held: models without ``position_ids`` and ``generate`` derive the next position from it;
# * after the prefill, what each attention layer holds is a subset of the keys the prefill computed, exactly (bit for
#   bit, per row and head: a press keeps tokens, it does not quantize them — a press that also quantizes declares
#   ``kvconform_lossy``), and no more tokens than were fed.


CLEAR_WORDS = ("prompt", "short", "token", "compress", "press", "length", "at least", "too few")
RAW_ERRORS = (IndexError, KeyError, AttributeError, ZeroDivisionError)


def press_only(subject, model, case, device="cpu"):
    """Applicability rule: press subjects only (``kind="press"``)."""
    if not kind_of(subject).presses:
        return "applies to press subjects only (kind='press': a cache that compresses the prefill)"
    return None


def _layer_keys(cache) -> dict:
    """``{layer index: keys [B, H, T, D]}`` of every layer of ``cache`` (its self-attention half) exposing a 4-d
    ``keys`` tensor."""
    import torch

    out = {}
    for i, layer in layer_items(self_half(cache)):
        keys = read_attr(layer, "keys")
        if isinstance(keys, torch.Tensor) and keys.dim() == 4:
            out[i] = keys
    return out


def _not_a_subset(held, fed) -> tuple | None:
    """``(batch, head, slot)`` of the first held key vector that equals no fed key vector of its row and head (bit
    for bit), or None when every held key is one of the fed ones."""

    for b in range(held.shape[0]):
        for h in range(held.shape[1]):
            same = (held[b, h][:, None, :] == fed[b, h][None, :, :]).all(-1).any(-1)  # [T_held]
            if not bool(same.all()):
                return b, h, int((~same).nonzero()[0])
    return None


@register("contract", needs=("forward",), judges=ALL_KINDS, applies=press_only, params={
    "prompts": Param(list, default=[1, 2, 3, 12], items=int, min=1,
                     doc="prompt lengths prefilled (short ones included)"),
    "decode": Param(int, default=3, min=1, doc="decode steps after each prefill"),
    "chunk": Param(int, default=4, min=1, doc="tokens of the chunk fed after the decode steps"),
}, ops=IGNORES_OPS)
def check_press_contract(ctx):
    """For each prompt length: the prefill is handled or refused clearly, exact, and then every forward leaves
    ``get_seq_length()`` = tokens seen and each attention layer holding an exact subset of the keys it was fed."""
    import torch

    from kvconform.oracle import compare_logits
    from kvconform.reference import ReferenceCache

    params = ctx.case.params
    prompts = [int(p) for p in params.get("prompts", [1, 2, 3, 12])]
    steps, chunk = int(params.get("decode", 3)), int(params.get("chunk", 4))
    gen = case_generator(ctx.case, ctx.model.name)
    enc = encoder_ids_for(ctx, gen)
    B, tol = ctx.case.batch, ctx.tolerance()
    refused, most_dropped = [], 0
    for P in prompts:
        program = [("prefill", P)] + [("decode", 1)] * steps + [("chunk", chunk)]
        ops_text = f"prefill({P}) → decode×{steps} → chunk({chunk})"
        cache, ref = ctx.new_cache(), ReferenceCache(ctx.model.config)
        seq = torch.zeros(B, 0, dtype=torch.long)
        for i, (name, n) in enumerate(program):
            label = f"prefill({P})" if name == "prefill" else f"decode {i} of {steps}" if name == "decode" \
                else f"chunk({n})"
            tokens = _tokens(ctx, gen, B, n, prompt=name == "prefill")
            start = seq.shape[1]
            try:
                logits = forward(ctx.model, cache, tokens, start, "implicit", enc, first=start == 0)
            except Exception as exc:  # noqa: BLE001 - judged: a clear refusal of a short prompt is allowed
                if name == "prefill" and not isinstance(exc, RAW_ERRORS) and \
                        any(w in str(exc).lower() for w in CLEAR_WORDS):
                    refused.append(f"{P}: {type(exc).__name__}")
                    break
                ctx.fail([f"{label} raised {describe_exception(exc)}",
                          f"ops: {ops_text}   [raised at {label}]",
                          "likely cause: " + (f"the press does not handle a {P}-token prompt: it should keep it (or "
                                              f"compress it) or refuse it with a clear error naming the prompt length"
                                              if name == "prefill" else
                                              "the press breaks the forwards after its compressed prefill")],
                         {"raised": type(exc).__name__, "failed_at": label, "prompt": P})
            forward(ctx.model, ref, tokens, start, "explicit", enc, first=start == 0)
            seq = torch.cat([seq, tokens], dim=1)
            fed = int(seq.shape[1])
            if name == "prefill":
                cmp = compare_logits(logits, ctx.oracle.logits(seq, encoder_ids=enc),
                                     ctx.oracle.uncached(seq, encoder_ids=enc), tol)
                if not cmp.passed:
                    ctx.fail([f"{label} into an empty cache: max|Δlogit| = {cmp.max_abs:.1e} against the oracle, but "
                              f"should be ≤ {cmp.tol:.1e} ({tol.describe(cmp.floor)})",
                              f"ops: {ops_text}   [failed at {label}]",
                              "likely cause: the press drops tokens inside the forward that brings them: that forward "
                              "must attend its whole chunk (update() returns every token) and compress afterwards"],
                             {"max_abs": cmp.max_abs, "tolerance": cmp.tol, "failed_at": label, "prompt": P})
            reported = seq_length(cache)
            held = {i: int(k.shape[-2]) for i, k in _layer_keys(cache).items()}
            if reported is not None and reported != fed:
                cause = (f"get_seq_length() reports the tokens held ({reported}), not the tokens seen ({fed}): the "
                         f"press dropped {fed - reported} and the next token gets position {reported} instead of "
                         f"{fed} where positions derive from the cache (no position_ids, generate's cache_position), "
                         f"and crop(-k) cuts from the wrong length — count the tokens seen in each layer and announce "
                         f"get_mask_sizes(q) = (held + q, seen − held)"
                         if reported in held.values() else
                         "get_seq_length() must count every token seen since the last reset (the next position), "
                         "whatever the press dropped")
                ctx.fail([f"get_seq_length() = {reported} after {label}, but should be {fed} (tokens seen)",
                          f"ops: {ops_text}   [failed at {label}]", f"likely cause: {cause}"],
                         {"reported": reported, "tokens_fed": fed, "failed_at": label, "prompt": P})
            # after the prefill every key was computed by the exact forward: what is held must be a subset of them
            # (later tokens' keys in deeper layers depend on the compressed history, so they differ by design)
            ref_keys = _layer_keys(ref) if name == "prefill" else {}
            for li, keys in _layer_keys(cache).items():
                fed_keys = ref_keys.get(li)
                if fed_keys is None or fed_keys.shape[:2] != keys.shape[:2]:
                    continue
                if keys.shape[-2] > fed_keys.shape[-2]:
                    ctx.fail([f"attention layer {li} holds {keys.shape[-2]} tokens per row after {label}, but only "
                              f"{fed_keys.shape[-2]} were fed", f"ops: {ops_text}   [failed at {label}]",
                              "likely cause: the press stores tokens twice (a kept copy beside the compressed one)"],
                             {"layer": li, "failed_at": label, "prompt": P})
                where = _not_a_subset(keys.to(fed_keys.dtype), fed_keys)
                if where is not None:
                    b, h, slot = where
                    ctx.fail([f"attention layer {li} holds a key (batch={b}, head={h}, slot {slot}) after {label} "
                              f"that equals none of the {fed_keys.shape[-2]} keys fed to it, but a press keeps a "
                              f"subset of the tokens exactly", f"ops: {ops_text}   [failed at {label}]",
                              "likely cause: the press changes the keys it keeps (rounds, merges or re-rotates them): "
                              "a cache that compresses what it keeps declares kvconform_lossy instead"],
                             {"layer": li, "failed_at": label, "prompt": P})
                most_dropped = max(most_dropped, fed - int(keys.shape[-2]))
            ref_keys = {}
    ctx.metrics.update(prompts=prompts, refused=refused, most_dropped=most_dropped)
