"""Family ``crop``: rolling a cache back (``crop``) and feeding *different* tokens behaves like no cache at all.

Assisted decoding, prompt lookup and the deferred stop check roll a cache back with ``crop(-k)`` and continue with
other tokens; they first call ``activate_past_recording()`` and read ``is_croppable`` after the prefill. So:

* a crop the cache accepts must leave exactly the first ``T − k`` tokens (the continuation equals the oracle of the
  edited sequence, and ``get_seq_length()`` is ``max(T − k, 0)`` — never negative);
* a crop it cannot honour must raise a clear error (a ``ValueError``/``RuntimeError``... naming the problem, not a
  raw ``IndexError`` from a tensor op) and leave the cache untouched;
* ``is_croppable`` tells the truth: True → the crop round-trips exactly; False → the crop is refused, or (a
  conservative flag) it still round-trips exactly. A crop accepted while the flag says False and then wrong is the
  fault callers cannot defend against.

Case keys: the ``crop N`` op gives ``k``; ``params.record = true`` calls ``activate_past_recording()`` before the first
token; ``params.positive = true`` calls ``crop(+N)`` instead, whose meaning depends on the installed version
(``positive_crop_contract``).
"""

from __future__ import annotations

from kvconform import compat
from kvconform.outcomes import CheckSkipped, KVConformError
from kvconform.checks import OP_PARAMS, OpRule, Param, register
from kvconform.checks._drive import SubjectRaised, seq_length
from kvconform.checks._interpreter import Runner
from kvconform.checks._judge import judge, record_verdict
from kvconform.failure import Cause, OpsTrail
from kvconform.checks._diagnosis import describe_exception, fail_verdict, measured_cause

# the refusal rules and cache snapshots live in the engine (other families use them too); re-exported here
from kvconform.checks._refusal import (CROP_WORDS, RAW_ERRORS, changed, clear_error, same_tensor,  # noqa: F401
                                       snapshot)

positive_crop_contract = compat.positive_crop_contract  # "raise" (≥ 5.20) or a length to keep (older releases)


class CropRecord:
    """What happened at the crop: the flag, the lengths, acceptance, and the refusal (if any)."""

    def __init__(self, label, k, held, flag, positive):
        self.label, self.k, self.held, self.flag, self.positive = label, k, held, flag, positive
        self.refused: BaseException | None = None
        self.reported_after = None
        self.reported_before = None


def _flag(cache):
    value = getattr(cache, "is_croppable", None)
    return None if value is None else bool(value)


def _recording_call(cache, keep: int):
    """``(label, call)`` that turns past recording on: ``activate_past_recording()``, or with ``keep > 0``
    ``activate_past_recording(recurrent_states_to_keep=keep)`` (the recurrent states of the last ``keep`` tokens
    recorded, so that a crop can rewind them: transformers 5.25).

    Raises:
        CheckSkipped: ``keep > 0`` and the installed transformers' linear-attention layers take no such count.
    """
    if not keep:
        return "activate_past_recording()", lambda: cache.activate_past_recording()
    if not compat.records_recurrent_states():
        raise CheckSkipped(f"transformers {compat.transformers_version()} records no recurrent states "
                           "(activate_past_recording takes no recurrent_states_to_keep before 5.25)")
    return (f"activate_past_recording(recurrent_states_to_keep={keep})",
            lambda: cache.activate_past_recording(recurrent_states_to_keep=keep))


def run_crop_case(ctx, cache, records=None):
    """Run the case's ops; the ``crop`` op is done with the policy above. Returns ``(runner, records)``; each crop
    appends a ``CropRecord`` to ``records`` (a list, filled even when a later op raises).

    Raises:
        ConformanceError: a raw error, a lying flag, a half-done refusal, a wrong length, an accepted positive
            argument (through ``ctx.fail``).
        SubjectRaised: a forward raised.
    """
    params = ctx.case.params
    if params["record_states"]:
        _recording_call(cache, params["record_states"])  # skipped before anything runs where no release records
    runner = Runner(ctx, cache)
    if params["record"] and hasattr(cache, "activate_past_recording"):
        label, record = _recording_call(cache, params["record_states"])
        runner._call(label, record)
        runner.trail.append(label)
    records = [] if records is None else records

    def crop(runner, op):
        """The crop under test: refusals judged, positive arguments, lengths after."""
        positive = params.positive
        label = f"crop({op.n})" if positive or op.n == 0 else op.label
        rec = CropRecord(label, op.n, runner.length, _flag(runner.cache), positive)
        rec.reported_before = seq_length(runner.cache)
        records.append(rec)
        before = snapshot(runner.cache)
        try:
            if positive:
                runner.cache.crop(op.n)
            else:
                compat.crop(runner.cache, op.n, runner.length)
        except Exception as exc:  # noqa: BLE001 - judged below
            rec.refused = exc
        runner.trail.append(label + (" (refused)" if rec.refused is not None else ""))
        if rec.refused is not None:
            _judge_refusal(ctx, runner, rec, before)
            return
        keep = rec.held - op.n if not positive or positive_crop_contract() == "raise" else op.n
        if positive and positive_crop_contract() == "raise":
            keep = _accepted_positive_crop(ctx, runner, rec, op.n)
        keep = max(min(keep, rec.held), 0)
        runner.seq = runner.seq[:, :keep]
        runner.mask = None if runner.mask is None or keep == 0 else runner.mask[:, :keep]
        rec.reported_after = seq_length(runner.cache)
        if rec.reported_after is not None and rec.reported_after != keep:
            ctx.fail([f"after {label} on a {rec.held}-token cache get_seq_length() = {rec.reported_after}, but should "
                      f"be {keep}" + (" (never negative)" if rec.reported_after < 0 else ""),
                      f"ops: {' → '.join(runner.trail)}",
                      "likely cause: " + _length_cause(rec, runner)],
                     {"flag": rec.flag, "reported_length": rec.reported_after, "expected_length": keep})

    runner.handlers["crop"] = crop
    runner.run()
    return runner, records


def _length_cause(rec, runner) -> str:
    """Why the length after a crop is wrong: a length already wrong before the crop (the cache reported the tokens
    it holds, not the tokens seen: an eviction or a press compressing the prefill), a negative length, or the crop
    itself."""
    before, after = rec.reported_before, rec.reported_after
    if before is not None and before != rec.held:
        removed = before - after
        return (f"get_seq_length() was already {before} for the {rec.held} tokens fed before crop() ran (at "
                f"{' → '.join(runner.trail[:-1]) or 'the start'}): the cache reports the tokens it holds, not the "
                f"tokens seen (an eviction, or a press compressing the prefill); crop() then removed {removed} as "
                f"asked — the length counter is the fault, not the crop")
    if after < 0:
        return ("crop() subtracts k from the length without clamping at 0: removing more tokens than are cached must "
                "empty the cache or raise a clear error")
    return "crop() removed a different number of tokens than asked"


class PositiveCropNote(UserWarning, KVConformError):
    """A positive ``crop(+n)`` was accepted where the installed transformers refuses it (≥ 5.20). No caller of such
    a release passes a positive count, so this is reported (a warning and the item's ``note`` metric), not failed;
    the continuation after it is still judged."""


POSITIVE_MEANINGS = {
    "abs": "crop() treats the sign loosely (abs(n)): crop(+{n}) removed {n} tokens",
    "keep": "crop() implements the pre-5.20 meaning of a positive count (keep the first {n} tokens)",
    "ignored": "crop() ignored the positive count: nothing was removed",
}


def _accepted_positive_crop(ctx, runner, rec, n: int) -> int:
    """What an accepted ``crop(+n)`` did, read from ``get_seq_length()`` after it: ``abs(n)`` (n removed), the
    pre-5.20 "keep n", or nothing. One of those is reported (``PositiveCropNote``, metric ``note``) and the run goes
    on from the length the cache now has; any other length fails the item (the crop did something unexplained).
    Returns the number of tokens kept."""
    import warnings

    after = seq_length(runner.cache)
    meanings = {"abs": max(rec.held - n, 0), "keep": min(n, rec.held), "ignored": rec.held}
    meaning = next((m for m, kept in meanings.items() if kept == after), None)
    if meaning is None:
        ctx.fail([f"crop({n}) with a positive argument was accepted on a {rec.held}-token cache and left "
                  f"get_seq_length() = {after}: neither {meanings['abs']} (n removed), {meanings['keep']} (keep n, "
                  f"the pre-5.20 meaning) nor {rec.held} (ignored)",
                  f"ops: {' → '.join(runner.trail)}",
                  "likely cause: crop() misreads a positive count; on transformers ≥ 5.20 it should raise a clear "
                  "error (crop takes a negative count of tokens to remove)"],
                 {"flag": rec.flag, "accepted": True, "reported_length": after})
    assert meaning is not None  # ctx.fail raised above
    note = (f"crop({n}) accepted on a {rec.held}-token cache: {POSITIVE_MEANINGS[meaning].format(n=n)}; transformers "
            f"≥ 5.20 raises there, but none of its callers passes a positive count — reported, not failed")
    ctx.metrics.update(note=note, positive_crop=meaning)
    warnings.warn(PositiveCropNote(f"{ctx.subject.name} on {ctx.model.name}: {note}"), stacklevel=2)
    return meanings[meaning]


def _judge_refusal(ctx, runner, rec, before):
    """A refused crop passes only if the error is clear, the flag did not promise a round trip of it (a crop of at most
    the tokens held, with ``is_croppable`` True), and nothing changed. All problems found go into one message, the
    most severe (a half-done crop) first."""
    exc = rec.refused
    what = f"{rec.label} on a {rec.held}-token cache raised {describe_exception(exc)}"
    metrics = {"flag": rec.flag, "accepted": False, "raised": type(exc).__name__}
    diff = changed(before, snapshot(runner.cache))
    lines, causes = [], []
    if diff:
        lines.append(f"and changed {', '.join(diff[:3])}" + (f" (+{len(diff) - 3} more)" if len(diff) > 3 else "")
                     + " before raising: the cache is now half-cropped")
        causes.append("crop() modifies some layers before another refuses; a refusal must leave the cache as it was "
                      "(check every layer first, then crop)")
        metrics["changed"] = diff[:10]
    if rec.positive and positive_crop_contract() == "raise":
        pass  # refusing a positive count is the contract
    elif not clear_error(exc, CROP_WORDS):
        lines.append("but a crop the cache cannot honour should raise a clear error naming the problem")
        causes.append("crop() does not check its argument or its state before touching tensors")
    elif rec.flag and 0 < rec.k <= rec.held:
        # is_croppable promises that a crop of tokens the cache holds round-trips; a crop of more tokens than it
        # holds is no rollback any caller makes (assisted decoding removes rejected candidates it fed): emptying the
        # cache or a clear refusal that changes nothing are both correct there (case crop_more_than_cached)
        lines.insert(0, "although is_croppable is True")
        if ctx.model.is_encoder_decoder and "dynamic" in str(exc).lower():
            why = ("EncoderDecoderCache.crop() accepts only DynamicCache halves (an isinstance check) while "
                   "is_croppable asks the halves")
        elif claims := recurrent_layers_claiming_crop(runner.cache):
            causes.append(_linear_claim(claims))
            why = ""
        elif ctx.case.params.get("record") and (off := layers_not_recording(runner.cache)):
            causes.append(_not_forwarded(off))
            why = ""
        elif ctx.model.has_sliding and ctx.case.params.get("record"):
            why = ("activate_past_recording() was called, yet crop() refuses a sliding window already full: the "
                   "sliding layers do not keep the tokens that leave the window while recording (honour record_past "
                   "in them, or say is_croppable False)")
        elif ctx.model.has_sliding:
            why = "is_croppable does not account for a sliding window already full with past recording off"
        else:
            why = "is_croppable does not account for this state"
        if why:
            causes.append(f"{why}; callers such as assisted decoding trust the flag and expect crop() to round-trip")
    if lines:
        ctx.fail([what, *lines, f"ops: {' → '.join(runner.trail)}", "likely cause: " + "; ".join(causes)],
                 metrics)


def recurrent_layers_claiming_crop(cache) -> list[str]:
    """Labels (``cache_layers``) of the layers that hold a recurrent (SSM) state and yet say ``is_croppable`` True:
    a recurrent state summarises every token it saw, so no ``crop()`` can rewind it and such a flag is a promise
    the layer cannot keep. A layer holds one when its ``is_recurrent_states_initialized`` (transformers' and
    kvconform's linear-attention layers) has a True value, or its ``recurrent_states`` holds a tensor."""
    from kvconform.checks._measure import cache_layers, read_attr

    out = []
    for label, layer in cache_layers(cache):
        flags = read_attr(layer, "is_recurrent_states_initialized")
        states = read_attr(layer, "recurrent_states")
        try:
            held = any(flags.values()) if isinstance(flags, dict) else (
                any(v is not None for v in states.values()) if isinstance(states, dict) else states is not None)
        except Exception:  # noqa: BLE001 - states that cannot be read: no evidence of a held state
            held = False
        try:
            claims = bool(getattr(layer, "is_croppable", False))
        except Exception:  # noqa: BLE001 - a flag that cannot be read claims nothing
            claims = False
        if held and claims:
            out.append(label)
    return out


def layers_not_recording(cache) -> list[str]:
    """Labels (``cache_layers``) of the layers with a past-recording flag (transformers' ``record_past``) that is
    still False: after ``cache.activate_past_recording()`` every such layer should keep its past."""
    from kvconform.checks._measure import cache_layers

    out = []
    for label, layer in cache_layers(cache):
        try:
            flag = getattr(layer, "record_past", None)
        except Exception:  # noqa: BLE001 - a flag that cannot be read says nothing
            flag = None
        if flag is False:
            out.append(label)
    return out


def _not_forwarded(layers: list[str]) -> str:
    """The cause of a crop refused (or wrong) after ``activate_past_recording()`` that never reached the layers."""
    shown = ", ".join(layers[:3]) + (f" (+{len(layers) - 3} more)" if len(layers) > 3 else "")
    return (f"activate_past_recording() was called on the cache but did not reach its layers ({shown} still "
            f"record_past = False): the cache (a wrapper, or an override of activate_past_recording) does not forward "
            f"it to every layer, so their past is not kept and the crop cannot roll back — is_croppable is not the "
            f"fault; forward activate_past_recording() to each layer")


def _linear_claim(layers: list[str]) -> str:
    """The cause of a crop on layers that hold a recurrent state and say ``is_croppable`` True."""
    return (f"is_croppable is True on a linear-attention layer that holds a recurrent (SSM) state ({', '.join(layers)}"
            f"): a recurrent state cannot be rewound, so the flag promises a rollback the layer cannot do — it must be "
            f"False there and crop() must raise (assisted decoding trusts the flag)")


def _cause(ctx, records, cache=None):
    def cause(step, cmp):
        rec = next((r for r in records if r.refused is None), None)
        if rec is None:
            return "the cache changed after a refused crop, or a later op corrupted it"
        claims = recurrent_layers_claiming_crop(cache) if cache is not None and rec.flag else []
        off = layers_not_recording(cache) if cache is not None and ctx.case.params.get("record") else []
        if off:
            return f"{rec.label} did not round-trip: " + _not_forwarded(off)
        if claims:
            return (f"{rec.label} was accepted, but the recurrent state still holds the removed tokens: "
                    + _linear_claim(claims))
        if rec.flag is False:
            if ctx.model.has_linear_attention:
                return (f"{rec.label} was accepted although is_croppable is False: a linear-attention layer rolled "
                        f"back its conv state but cannot roll back its recurrent (SSM) state; crop() must raise")
            if ctx.model.has_sliding:
                return (f"{rec.label} was accepted although is_croppable is False: the sliding window (size "
                        f"{ctx.model.sliding_window}) already evicted the states the rollback needs; crop() must "
                        f"raise")
            return f"{rec.label} was accepted although is_croppable is False, and did not restore the cache"
        return (f"{rec.label} removed the wrong tokens or left stale state behind (keys/values of some layer, "
                f"a length counter, or a conv/recurrent state not rolled back)")

    return cause


def _crop_check(ctx):
    cache = ctx.new_cache()
    records: list = []
    try:
        runner, _ = run_crop_case(ctx, cache, records)
    except SubjectRaised as exc:
        accepted = [r for r in records if r.refused is None]
        measured = measured_cause(exc)
        cause: str | Cause
        if accepted:
            cause = (f"{accepted[-1].label} left the cache in a state its next update cannot handle ("
                     + str(measured or "its keys, length counter and get_mask_sizes() no longer agree") + ")")
        else:
            cause = measured or "the cache does not support this sequence of calls (see the exception)"
        recording = _recording_call(cache, ctx.case.params["record_states"])[0] + " → " \
            if ctx.case.params["record"] else ""
        ctx.fail([f"the subject raised {describe_exception(exc.cause)}",
                  OpsTrail.of_case(ctx.case, at=exc.where, verb="raised",
                                   text=f"{recording}{ctx.case.ops_label()}" if recording else None),
                  cause if isinstance(cause, Cause) else Cause(cause)],
                 {"raised": type(exc.cause).__name__, "failed_at": exc.where})
    ctx.metrics.update(is_croppable=[r.flag for r in records], crop_accepted=[r.refused is None for r in records])
    verdict = judge(ctx, runner.steps, driver=_driver)
    record_verdict(ctx, verdict, len(runner.steps))
    if not verdict.passed:
        fail_verdict(ctx, verdict, _cause(ctx, records, runner.cache), ops_text=" → ".join(runner.trail),
                     driver=_driver)


def _driver(ctx, cache):
    """Replays the crop case on another subject (the reference or a lossy subject's twin)."""
    return run_crop_case(ctx, cache)[0].steps


CROP_PARAMS = {
    **OP_PARAMS,
    "record": Param(bool, default=False, doc="call activate_past_recording() before the first token"),
    "record_states": Param(int, default=0, doc="with record: keep the recurrent states of the last N tokens "
                           "(activate_past_recording(recurrent_states_to_keep=N), transformers 5.25 and later; "
                           "skipped before)"),
    "positive": Param(bool, default=False, doc="call crop(+N) instead of crop(-N)"),
    "crop_beyond_held": Param(bool, default=False, doc="a crop removes more tokens than the cache holds, on purpose "
                              "(the edge case: empty the cache or refuse clearly); otherwise such a crop is an error "
                              "in the case file"),
}
CROP_OPS = OpRule(required=("crop",), why="it checks crop()", crop_past_start="crop_beyond_held", crop_keeps="positive")


@register("crop", needs=("forward", "crop"), params=CROP_PARAMS, ops=CROP_OPS)
def check_crop_then_continue(ctx):
    """Prefill, decode, ``crop(-k)``, then feed *different* tokens: every step equals the oracle of the edited
    sequence; edges: ``crop(0)``, ``k`` larger than the cached length, a positive argument."""
    if not any(op.name == "crop" for op in ctx.case.ops):
        raise ValueError(f"case {ctx.case.id}: check_crop_then_continue needs a 'crop N' op")
    _crop_check(ctx)


@register("crop", needs=("forward", "crop"), params=CROP_PARAMS, ops=CROP_OPS)
def check_crop_contract(ctx):
    """``is_croppable`` tells the truth: a cache that says True round-trips a crop exactly; a crop it cannot honour
    raises a clear error and changes nothing; a crop accepted while the flag says False must still be exact."""
    if not any(op.name == "crop" for op in ctx.case.ops):
        raise ValueError(f"case {ctx.case.id}: check_crop_contract needs a 'crop N' op")
    from transformers import Cache

    if hasattr(Cache, "is_croppable") and not hasattr(ctx.new_cache(), "is_croppable"):
        ctx.fail(["the cache has no is_croppable attribute",
                  "likely cause: a Cache without is_croppable: assisted decoding reads it after the prefill"], {})
    _crop_check(ctx)
