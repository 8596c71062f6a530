"""The API contract of family ``contract``: the API surface callers rely on is there, and the bookkeeping it reports
is true.

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
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from kvconform import compat
from kvconform.checks import OP_PARAMS, OpRule, register
from kvconform.checks._diagnosis import describe_exception, describe_raise, fail_raised, measured_cause
from kvconform.failure import Cause, OpsTrail
from kvconform.checks._drive import (SubjectRaised, seq_length)
from kvconform.checks._measure import layer_list, read_attr, self_half
from kvconform.checks._interpreter import Runner, StopRun
from kvconform.checks._judge import judge, record_verdict
from kvconform.subjects import FRESH
from kvconform.checks._lossy import CLEAR_ERRORS, LOSSY_OPS, drive, fail_subject_raised, oracle_slices
from kvconform.checks._observe import FORWARD_OPS, run_observed
from kvconform.checks._refusal import CROP_WORDS, clear_error
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
        self.calls: list[tuple] = []
        original = self.target.update

        def update(*args, **kwargs):
            keys, values = original(*args, **kwargs)
            layer_idx = kwargs.get("layer_idx", args[2] if len(args) > 2 else None)
            key_states: Any = kwargs.get("key_states", args[0] if args else None)
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


@dataclass(frozen=True)
class Problem:
    """One finding of ``check_length_bookkeeping``, typed: ``kind`` says what was wrong, ``op`` the name of the op it
    was found at (``prefill``, ``decode``, ``chunk``, ``crop``, ``reorder``, ``repeat``, ``select``, ``reset``; "" for
    none), ``text`` the message line (for people only), ``raised`` the exception's class name where a method raised.

    Kinds: ``length_wrong`` / ``length_raised`` (``get_seq_length()`` after an op), ``max_length_raised`` /
    ``max_length_not_capacity`` / ``max_length_changed`` (``get_max_length()``), ``mask_sizes_raised``,
    ``keys_vs_mask_sizes`` (``update()`` returned another key count than ``get_mask_sizes`` announced),
    ``mask_sizes_cover`` (the announced keys do not cover the positions needed), ``refused_crop_changed_length``.
    The report's ``problem_ids`` (``kind@op``) are what a known fault's envelope matches, never ``text``."""

    kind: str
    op: str
    text: str
    raised: str | None = None

    @property
    def id(self) -> str:
        """``kind@op`` (``length_wrong@reset``), or ``kind`` when no op applies."""
        return f"{self.kind}@{self.op}" if self.op else self.kind


class Bookkeeping:
    """Observer of ``check_length_bookkeeping``: before every forward it asks ``get_mask_sizes`` of each attention
    layer, after it compares with what ``update`` returned (``UpdateSpy``); after every op it compares
    ``get_seq_length()`` with the tokens held and checks ``get_max_length()`` is stable. ``problems`` collects
    ``Problem`` records; the first op with a problem ends the run (``StopRun``)."""

    def __init__(self, ctx, cache, skipped):
        self.ctx, self.cache, self.skipped = ctx, cache, skipped
        self.spy = UpdateSpy(cache)
        self.layers, self.windows = _attention_layers(ctx), _windows(ctx)
        # a model adapter's cache (kvconform.scratch): its own seq_length(cache) and capacity(cache) are checked
        # after every op; it has no get_mask_sizes / update() to compare (the model builds its own masks)
        self.adapter = getattr(getattr(ctx.model, "model", None), "adapter", None)
        self.counts = bool(self.layers) or self.adapter is not None
        if self.adapter is not None:
            self.layers = []
        self.len_name = "seq_length(cache)" if self.adapter is not None else "get_seq_length()"
        self.max_name = "capacity(cache)" if self.adapter is not None else "get_max_length()"
        self.problems: list[Problem] = []
        self.trail: list[str] = []
        self.op_name = ""
        """The name of the op being applied (``before_op``): where a problem found during its forwards is filed."""
        self.max_first = None
        self.held, self.predicted = 0, {}
        self.length_fault = None
        """(op label, get_seq_length(), tokens it should hold, tokens stored or None) at the first wrong length."""

    def before_op(self, runner, op, op_index):
        """Note the op whose forwards come next."""
        self.op_name = op.name

    def _problem(self, kind: str, text: str, exc=None) -> None:
        self.problems.append(Problem(kind, self.op_name, text, None if exc is None else type(exc).__name__))

    def before_forward(self, runner, label, n):
        """Ask ``get_mask_sizes(n, layer)`` of each attention layer."""
        self.held, self.predicted = runner.length, {}
        for i in self.layers:
            try:
                self.predicted[i] = tuple(int(x) for x in self.spy.target.get_mask_sizes(n, i))
            except Exception as exc:  # noqa: BLE001
                self._problem("mask_sizes_raised", f"get_mask_sizes({n}, {i}) raised {describe_exception(exc)}", exc)
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
                self._problem("keys_vs_mask_sizes", f"at {step.label}: layer {layer_idx} update() returned "
                                                    f"{returned} keys, but get_mask_sizes({q}) said kv_length={kv_len}")
            elif kv_off > first_needed or kv_off + kv_len < held + q:
                self._problem("mask_sizes_cover", f"at {step.label}: layer {layer_idx} get_mask_sizes({q}) = "
                                                  f"(kv_length={kv_len}, kv_offset={kv_off}) does not cover positions "
                                                  f"{first_needed}..{held + q - 1}")

    def after_op(self, runner, op, op_index):
        """``get_seq_length()`` against the tokens held, ``get_max_length()`` stable; stop at the first problem."""
        cache, trail, problem = self.cache, self.trail, self._problem
        trail.append(op.label)
        if self.counts:
            try:
                reported = int(cache.get_seq_length())
            except Exception as exc:  # noqa: BLE001
                problem("length_raised", f"after {' → '.join(trail)}: {self.len_name} raised "
                                         f"{describe_exception(exc)}", exc)
                raise StopRun from exc
            if reported != runner.length:
                stored = None if self.adapter is not None else stored_tokens(cache)
                problem("length_wrong", f"after {' → '.join(trail)}: {self.len_name} = {reported}, but the cache "
                                        f"should hold {runner.length} tokens"
                        + (f" (its unbounded attention layers store {stored})" if stored is not None else ""))
                if self.length_fault is None:
                    self.length_fault = (op.label, reported, runner.length, stored)
        try:
            value = compat.max_length(cache)
        except Exception as exc:  # noqa: BLE001
            problem("max_length_raised", f"after {' → '.join(trail)}: {self.max_name} raised "
                                         f"{describe_exception(exc)}", exc)
            raise StopRun from exc
        if self.max_first is None:
            self.max_first = value
            if value == 0 or value < -1:
                problem("max_length_not_capacity", f"{self.max_name} = {value}: should be -1 (unbounded) or the "
                                                   f"capacity")
        elif value != self.max_first:
            problem("max_length_changed", f"after {' → '.join(trail)}: {self.max_name} = {value}, was "
                                          f"{self.max_first}")
        if self.problems:
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
            self._problem("refused_crop_changed_length",
                          f"after {' → '.join(self.trail)}: the refused crop changed get_seq_length() to "
                          f"{int(self.cache.get_seq_length())}, but the cache should still hold {runner.length}")
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
        first = problems[0]
        cause = (_length_cause(book.length_fault) if book.length_fault is not None and first.kind == "length_wrong"
                 else
                 "get_seq_length() does not count what update() stored (an off-by-one, or a counter that crop(), "
                 "reset() or a batch op forgot to update) — models derive positions from it"
                 if first.kind in ("length_wrong", "length_raised", "refused_crop_changed_length") else
                 "get_mask_sizes() and update() disagree on which keys the next forward sees — the attention mask "
                 "then hides the wrong positions" if first.kind.startswith(("mask_sizes", "keys_vs")) else
                 _max_length_cause(first, book.max_first))
        raised = next((p.raised for p in problems if p.raised), None)
        ctx.fail([first.text, *(p.text for p in problems[1:3]),
                  f"ops: {' → '.join(op.label for op in ops)}"
                  + (f"   (skipped: {', '.join(skipped)})" if skipped else ""),
                  "likely cause: " + cause],
                 {"problems": [p.text for p in problems[:5]], "problem_ids": [p.id for p in problems[:5]],
                  **({"raised": raised} if raised else {})})


def _max_length_cause(problem: Problem, first) -> str:
    """The likely cause of a ``get_max_length()`` problem (``problem``: the first one recorded; ``first``: the value
    its first call returned, None when it never returned): a method that raises from its first call, one that
    raises later, a first value that is no capacity, or a value that changes."""
    name = compat.max_length_name()
    if problem.kind == "max_length_raised":
        if first is None:
            return (f"{name}() raises from its first call: it is missing or broken for this cache, not changing "
                    f"over its life — it should return -1 (unbounded) or the capacity in tokens (generate() and "
                    f"the mask builders read it)")
        return (f"{name}() answered {first} at first and raises after a later op: that op leaves the cache in a "
                f"state its {name}() cannot read")
    if first is not None and problem.kind == "max_length_not_capacity":
        return (f"{name}() returns {first} from its first call: neither -1 (unbounded) nor a capacity in tokens — "
                f"a 0 or an unset field where the capacity should be")
    return f"{name}() changes over the cache's life"


# ------------------------------------------------------------------------------------------ crop refusal
def _not_croppable(subject, model, case, device="cpu"):
    if "crop" in subject.capabilities:
        return (f"checks that a cache without the crop capability refuses crop(); {subject.name} declares crop, "
                f"so the crop family checks its crops instead")
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
          validate=_encoder_decoder_case, transformers_only="transformers' EncoderDecoderCache")
def check_encoder_decoder_subcaches(ctx):
    """In the ``EncoderDecoderCache`` built from the subject: after every forward the cross-attention sub-cache
    holds ``encoder_len`` tokens, its keys/values unchanged since the first forward, and the self-attention
    sub-cache holds the decoder tokens fed; every step's logits equal the oracle."""
    import torch

    if not ctx.model.is_encoder_decoder:
        raise ValueError(f"case {ctx.case.id}: check_encoder_decoder_subcaches needs requires = ['encoder_decoder']")
    cache = ctx.new_cache()
    first_cross: list = []
    problems: list[str] = []
    fed = [0]

    def cross_state():
        return [(read_attr(layer, "keys").clone(), read_attr(layer, "values").clone())
                for layer in layer_list(read_attr(cache, "cross_attention_cache"))
                if isinstance(read_attr(layer, "keys"), torch.Tensor) and isinstance(read_attr(layer, "values"),
                                                                                     torch.Tensor)]

    encoder_tokens = ctx.model.encoder_states(ctx.case.encoder_len)  # what the cross-attention half must hold

    def observe(step):
        fed[0] += step.length
        cross_len, self_len = seq_length(cache.cross_attention_cache), seq_length(cache.self_attention_cache)
        if cross_len != encoder_tokens:
            problems.append(f"after {step.label}: cross-attention sub-cache holds {cross_len} tokens, but should "
                            f"hold the {encoder_tokens} encoder tokens")
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
        measured = measured_cause(exc)
        ctx.fail([f"the subject raised {describe_raise(exc)}",
                  OpsTrail.of_case(ctx.case, at=exc.where, verb="raised"),
                  measured if isinstance(measured, Cause) else
                  Cause(measured or "the subject cannot serve as one half of an EncoderDecoderCache")],
                 {"raised": type(exc.cause).__name__, "failed_at": exc.where})
    tol = ctx.tolerance()
    cmps: list[Any]  # (step, Comparison) pairs
    if ctx.kind.target == FRESH:  # a lossy subject: against a fresh instance fed the same history
        verdict = judge(ctx, steps)
        cmps = [verdict.first_fail or verdict.worst]
        record_verdict(ctx, verdict, len(steps))
    else:
        exact: dict[int, tuple] = oracle_slices(ctx, steps)  # step index → (oracle, uncached)
        cmps = [(step, compare_logits(step.logits, exact[step.index][0], exact[step.index][1], tol)) for step in steps]
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
