"""A from-scratch model's failure said in its adapter's terms: the likely cause from the op it failed at
(``likely_cause``), kvconform's generic causes that name transformers' cache API rewritten (``adapter_lines``)."""

from __future__ import annotations

import dataclasses

from kvconform.failure import Cause, OpsTrail


_POSITIONS = "positions: the start offset kvconform passes the adapter (cumsum(mask) - 1 on left-padded rows)"

_BATCH_WORDS = ("reorder", "select", "repeat", "swap", "beam")
"""The batch ops (in an op label or a case's ops line) a from-scratch model's ``select`` performs."""
_ANY, _PREFILL = ("",), ("prefill",)  # any op; an op label that begins with "prefill"
_CROP, _RESET = ("crop",), ("reset",)

_CAUSES = (
    # (check name, or "*"; words of the op label the step failed or raised at; cause in the model's terms)
    ("check_length_bookkeeping", _ANY,
     "your seq_length(cache) does not count the tokens the cache holds after that op: a counter your forward, crop, "
     "select or reset forgets to update (kvconform passes positions as start, so the logits stay right; code that "
     "reads your count — your own generation loop — continues at the wrong position)"),
    ("check_poisoned_capacity", _ANY,
     "your model reads slots your poison(cache, start, value) filled — slots the cache holds no token in: it attends "
     "a buffer past the start tokens it holds, or derives how many tokens it holds (where it writes next) from the "
     "buffer's contents (nonzero slots) rather than from start or a counter"),
    ("*", ("chunk(",),
     "your cached forward, given T > 1 new tokens while the cache already holds some (start > 0), attends them "
     "wrongly while single tokens and the prefill are right: look for a causal mask applied only when the queries "
     "are as long as the keys (a warm-cache chunk then attends its own later tokens), or a ring buffer written "
     "before it is read (a chunk that wraps overwrites keys its own earlier queries still need)"),
    ("check_multi_turn", _ANY,
     "your cache does not continue the first turn: kvconform fed your forward the turn-1 prompt, then one token per "
     "step, and feeds the second turn's tokens it does not hold yet (turn 1's last token and the new ones) as one "
     "chunk at start = the tokens held — a cached forward wrong on several new tokens into a warm cache (see the "
     "chunk items), or a cache that holds something else than the tokens it was fed"),
    ("check_prefix_generate", _ANY,
     "your cache does not continue the prefix: kvconform fed your forward the prefix, then the prompt's tokens past "
     "it as one chunk at start = the prefix's length, then one token per step — a cached forward wrong on several "
     "new tokens into a warm cache (see the chunk items), or a cache that lost or changed the prefix"),
    ("check_prefix_fork", _ANY,
     "fork(cache) (default copy.deepcopy) leaves the copy and the original sharing state: a forward on one "
     "changed the other — a list of per-block dicts copied shallowly (list(cache), cache.copy(), dict(layer)) keeps "
     "the same dicts, and a forward that assigns layer['key'] = cat(...) then writes into both"),
    ("*", _CROP,
     "after your crop(cache, n) the next forward is wrong: it must drop exactly the last n tokens of every block, "
     "and the positions of the next tokens must continue at the tokens kept — a position counter kept in the cache "
     "that crop resets to 0 or does not rewind, or a ring buffer whose evicted slots crop cannot bring back"),
    ("*", _RESET,
     "after your reset (or new_cache) the next sequence is wrong: buffers kept from the previous sequence — its "
     "batch size (a setup that returns early when buffers exist), its length or its tokens"),
    ("*", _BATCH_WORDS,
     "your select(cache, rows) does not move every tensor of every block to the rows asked, in that order"),
    ("*", _PREFILL,
     "your cached forward of the first tokens, into an empty cache, differs from your uncached forward of the same "
     "tokens: the cached path computes something else — look for a causal mask (or positions) built only when no "
     "cache is passed"),
)


def likely_cause(check_name: str, ops: OpsTrail | None, failed_at: str | None = None) -> str | None:
    """A likely cause in the adapter's own terms for a failure of a from-scratch model's item, from the op it
    failed or raised at (``ops.at``; ``failed_at`` where the failure has no ops trail), the ops it ran (``ops``)
    and the check; None where none applies (the generic one stays)."""
    at = (ops.at or "") if ops is not None else (failed_at or "")
    ran = (ops.label + (f"   [{ops.verb} at {ops.at}]" if ops.at else "")) if ops is not None else ""
    measures_bytes = check_name.startswith("check_memory")  # its step is where bytes were read, not a wrong forward
    for check, words, cause in _CAUSES:
        if check not in ("*", check_name) or (check == "*" and measures_bytes):
            continue
        by_ops = words in (_CROP, _RESET) or (words == _BATCH_WORDS and not at.startswith("prefill"))
        if by_ops and ops is not None and ops.op_index is not None:  # measured: only the ops before the failing one
            ran = " → ".join(label for _, label in ops.ops[:ops.op_index])
        if check != "*" or _names(at, words) or (by_ops and _names(ran, words) and at):
            return cause
    return None


def _names(text: str, words) -> bool:
    """Whether ``text`` (an op label or the ops run) holds one of ``words`` (``_PREFILL``: begins with it)."""
    if words is _ANY:
        return True
    if words is _PREFILL:
        return text.startswith("prefill")
    return any(w in text for w in words)


def adapter_lines(check_name: str, lines: list, failed_at: str | None = None, raised: bool = False) -> list:
    """A failure's body (``Failure.body``: strings, an ``OpsTrail``, a ``Cause``) for an item of a from-scratch
    model: the likely cause said in the adapter's terms (``likely_cause``; the generic reading kept after it, the
    cause's id and facts kept), positions described as the start offset it is given (the trail's note).
    ``failed_at``: the step label a failure without an ops trail failed at (a fuzz program's), or None; ``raised``:
    the item failed on an exception (the generic cause then says so)."""
    ops = next((x for x in lines if isinstance(x, OpsTrail)), None)
    cause = likely_cause(check_name, ops, failed_at)
    out: list = []
    for line in lines:
        if isinstance(line, str) and line.startswith("likely cause: "):  # a check's plain cause line: typed here
            line = Cause(line.removeprefix("likely cause: "))
        if isinstance(line, OpsTrail) and line.note:
            line = dataclasses.replace(line, note=_POSITIONS)
        if isinstance(line, Cause):
            foreign = _foreign(line.text)
            if cause:
                line = line.with_text(cause if foreign else f"{cause} (kvconform's reading: {line.text})")
                cause = None
            elif foreign:
                line = line.with_text(_generic_cause(ops, failed_at, raised))
        out.append(line)
    if cause:
        out.append(Cause(cause, "adapter"))
    return out


_FOREIGN = ("get_seq_length", "generate()", "generate calls", "update(", "reorder_cache", "batch_repeat_interleave",
            "batch_select_indices", "repeat_interleave", "__deepcopy__", "get_mask_sizes", "is_croppable",
            "kvconform_poison", "DynamicCache", "StaticCache", "DynamicLayer", "StaticLayer", "cache_implementation",
            "get_max_length", "get_max_cache_shape")
"""Words of kvconform's generic causes that name transformers' cache API (or kvconform's hook for it): a cause that
holds one is not said to a from-scratch model, whose adapter has none of them."""


def _foreign(text: str) -> str | None:
    """The first word of ``_FOREIGN`` in ``text``, or None."""
    return next((w for w in _FOREIGN if w in text), None)


def _generic_cause(ops: OpsTrail | None, failed_at: str | None, raised: bool = False) -> str:
    """The cause said to an adapter where no cause in its terms applies and kvconform's names transformers' API:
    where it failed, and the ops that ran before it (measured: ``OpsTrail.op_index``)."""
    at = (ops.at if ops is not None else None) or failed_at
    before = ""
    if ops is not None and ops.op_index:
        before = " → ".join(label for _, label in ops.ops[:ops.op_index])
    if raised or (ops is not None and ops.verb == "raised"):
        return ("your adapter's code raised" + (f" at {at}" if at else "") + (f", after {before}" if before else "")
                + " (see the exception and its line): the cache cannot take this call in the state those ops left")
    return ("your cached forward" + (f" at {at}" if at else "") + " differs from your uncached forward of the same "
            "tokens" + (f", after {before}" if before else "") + ": the cache held something else than the tokens "
            "kvconform fed it, or your forward reads them at the wrong positions")

