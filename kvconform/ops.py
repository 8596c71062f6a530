"""The op vocabulary: one table (``OPS``) of every op a case may name, and what each means.

Every other list of ops in kvconform is derived from this table (the case-file syntax in ``cases``, the ops a check's
driver accepts, the capability an op needs, the fuzzer's draws, the likely cause blamed on an op) and the op
interpreter (``checks/_interpreter.py``) dispatches from it: an entry names the ``Runner`` method that applies it.
Adding an op is one entry here and that one ``Runner`` method (ARCHITECTURE.md, "The op interpreter").

This module imports nothing from kvconform and nothing heavy (no torch): ``cases`` reads it at case load.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OpSpec:
    """One op of the vocabulary.

    Attributes:
        name: the op's name in case files (``"prefill"``).
        count: ``"required"`` (``"decode 4"``), ``"optional"`` (``"reset"`` or ``"reset 2"``) or ``"none"``.
        min_count: the smallest count a case may give (tokens, steps, repeats or rows).
        label: how a run names the op in messages, ``{n}`` standing for its count (``"decode×{n}"``); for an
            optional count, the label without one is ``name``.
        feeds: the op feeds tokens (makes forwards): ``prefill``, ``chunk``, ``decode``.
        per_token: with ``feeds``: one forward per token (``decode N`` makes N forwards; the others one).
        held: how it changes the tokens the cache holds: ``"adds"`` (its count), ``"removes"`` (its count, not below
            0), ``"empties"`` or ``"keeps"`` (see ``tokens_held``).
        rows: what it does to the batch rows: ``"keep"``, ``"permute"`` (a beam reorder), ``"resize"`` (repeat,
            select) or ``"new"`` (a reset starts a new batch, of another size with a count).
        copies: the op copies the cache (``fork``: ``copy.deepcopy``).
        capability: the subject capability it needs (``CacheSpec.capabilities``); None: every cache can (feeds).
        min_batch: the smallest batch it makes sense on (``swap_rows`` exchanges rows 0 and 1).
        runner: the name of the ``checks._interpreter.Runner`` method that applies it, ``method(op)``.
        method: the cache method the op calls, as messages name it (``"reorder_cache"``); None for the feeding ops.
        fault: the likely cause named when an exact cache's rows are wrong after this batch op (the batch family);
            None where that family does not judge the op.
        cause: the likely cause named when a cache diverges after this op (a lossy subject compared with a fresh
            instance of its class, ``checks._consistency``); None for the feeding ops.
        fuzz: the ``(low, high)`` counts the op-sequence fuzzer draws (``(0, 0)``: an op without count), or None:
            not drawn. For ``prefill`` it bounds the program's first op.
    """

    name: str
    count: str = "none"
    min_count: int = 1
    label: str = "{name}"
    feeds: bool = False
    per_token: bool = False
    held: str = "keeps"
    rows: str = "keep"
    copies: bool = False
    capability: str | None = None
    min_batch: int = 1
    runner: str = ""
    method: str | None = None
    fault: str | None = None
    cause: str | None = None
    fuzz: tuple[int, int] | None = None

    def label_of(self, n: int) -> str:
        """The op with count ``n`` as a run names it (``"decode×3"``, ``"crop(-2)"``, ``"reorder"``)."""
        if self.count == "none" or (self.count == "optional" and not n):
            return self.name
        return self.label.format(name=self.name, n=n)

    def forwards(self, n: int) -> int:
        """Forwards the op makes with count ``n`` (0 for an op that does not feed tokens)."""
        if not self.feeds:
            return 0
        return n if self.per_token else 1

    def held_after(self, held: int, n: int) -> int:
        """Tokens per row the cache holds after this op with count ``n``, from ``held`` before it (≥ 0)."""
        if self.held == "adds":
            return held + n
        if self.held == "removes":
            return max(held - n, 0)
        if self.held == "empties":
            return 0
        return held


_OPS = (
    OpSpec("prefill", count="required", label="prefill({n})", feeds=True, held="adds", runner="op_feed",
           fuzz=(2, 10)),
    OpSpec("decode", count="required", label="decode×{n}", feeds=True, per_token=True, held="adds",
           runner="op_decode", fuzz=(1, 3)),
    OpSpec("chunk", count="required", label="chunk({n})", feeds=True, held="adds", runner="op_feed", fuzz=(2, 5)),
    OpSpec("crop", count="required", min_count=0, label="crop(-{n})", held="removes", capability="crop",
           runner="op_crop", method="crop", fuzz=(1, 4),
           cause="crop() did not cut every part of the cache to the kept tokens (quantized part / residual / length "
                 "counter): cropped tokens survive, or kept ones are lost (a Δ near the compression error instead: "
                 "the tokens that re-enter the exact window after the crop stay quantized — keep exact copies of "
                 "the last tokens, or refuse crop)"),
    OpSpec("fork", copies=True, capability="deepcopy", runner="op_fork", method="copy.deepcopy", fuzz=(0, 0),
           cause="copy.deepcopy did not copy every part of the cache (quantized part / residual / scales), or the "
                 "copy and the original share a part that one of them then changed"),
    OpSpec("reorder", rows="permute", capability="reorder", runner="op_reorder", method="reorder_cache", fuzz=(0, 0),
           fault="reorder_cache() did not move every tensor of every layer with its row (keys and values, conv and "
                 "recurrent states, and any per-row counter)",
           cause="reorder_cache() did not move every part of the cache with the rows (quantized part / residual / "
                 "scales): one part kept the old row order"),
    OpSpec("swap_rows", rows="permute", capability="reorder", min_batch=2, runner="op_swap_rows",
           method="reorder_cache",
           fault="reorder_cache() with a permutation that exchanges two rows (a beam swap) did not move every tensor "
                 "of every layer with its row, or moved the other rows too",
           cause="reorder_cache() exchanging two rows did not move every part of the cache with them (quantized "
                 "part / residual / scales)"),
    # not drawn by the fuzzer (fuzz=None): the derandomized default programs stay the programs they were
    OpSpec("beam_fork", rows="permute", capability="reorder", min_batch=2, runner="op_beam_fork",
           method="reorder_cache",
           fault="reorder_cache() with a beam index that holds one row twice (beam search keeping two continuations "
                 "of one beam) did not move every tensor of every layer with its row, or left the two copies sharing "
                 "a part that one of them then overwrote (a page, a block or a buffer taken by reference, without "
                 "copy-on-write)",
           cause="reorder_cache() with a row taken twice did not move every part of the cache with the rows "
                 "(quantized part / residual / scales), or left the two copies sharing a part that one of them then "
                 "changed"),
    OpSpec("repeat", count="required", label="repeat({n})", rows="resize", capability="batch_repeat",
           runner="op_repeat", method="batch_repeat_interleave", fuzz=(2, 2),
           fault="batch_repeat_interleave() did not repeat every tensor row by row ([b0, b0, b1, b1]: "
                 "repeat_interleave, not tile)",
           cause="batch_repeat_interleave() did not repeat every part of the cache (quantized part / residual / "
                 "scales) row by row"),
    OpSpec("select", rows="resize", capability="batch_select", runner="op_select", method="batch_select_indices",
           fuzz=(0, 0),
           fault="batch_select_indices() did not keep exactly the selected rows of every tensor of every layer",
           cause="batch_select_indices() did not keep the same rows in every part of the cache (quantized part / "
                 "residual / scales)"),
    OpSpec("reset", count="optional", label="reset(then batch {n})", held="empties", rows="new", capability="reset",
           runner="op_reset", method="reset", fuzz=(0, 0),
           cause="reset() did not clear every part of the cache (quantized part / residual / scales / length "
                 "counter): the previous sequence survives into the next one"),
)

OPS: dict[str, OpSpec] = {spec.name: spec for spec in _OPS}
"""Every op, by name, in the order case-file messages list them."""

OP_NAMES: tuple[str, ...] = tuple(OPS)
"""The op names a case may use."""

FORWARD_OPS: tuple[str, ...] = tuple(n for n, s in OPS.items() if s.feeds)
"""The ops that feed tokens (``prefill``, ``decode``, ``chunk``)."""

OPS_WITH_COUNT: tuple[str, ...] = tuple(n for n, s in OPS.items() if s.count == "required")
"""The ops a case must give a count (``"decode 4"``)."""

OP_CAPABILITY: dict[str, str] = {n: s.capability for n, s in OPS.items() if s.capability}
"""``{op: the capability it needs}`` for the ops that need one."""

CAUSES: dict[str, str] = {n: s.cause for n, s in OPS.items() if s.cause}
"""``{op: the likely cause of a divergence right after it}``."""


def spec(name: str) -> OpSpec:
    """The ``OpSpec`` of op ``name``.

    Raises:
        KeyError: ``name`` is not an op of ``OPS``.
    """
    return OPS[name]


def op_names(**where) -> tuple[str, ...]:
    """The op names whose ``OpSpec`` has every given attribute value, in table order; a tuple value means any of
    those (``op_names(feeds=False, rows=("keep", "permute"))``)."""
    def fits(s):
        return all(getattr(s, k) in v if isinstance(v, tuple) else getattr(s, k) == v for k, v in where.items())
    return tuple(n for n, s in OPS.items() if fits(s))


@dataclass(frozen=True)
class Op:
    """One op of a case: ``name`` in ``OP_NAMES`` and its count ``n`` (tokens or steps; 0 when not applicable)."""

    name: str
    n: int = 0

    @property
    def spec(self) -> OpSpec:
        """Its entry of ``OPS``."""
        return OPS[self.name]

    @property
    def label(self) -> str:
        """How a run names it (``"prefill(12)"``, ``"decode×2"``, ``"crop(-3)"``, ``"reorder"``)."""
        return OPS[self.name].label_of(self.n)

    @property
    def new_tokens(self) -> int:
        """Tokens it feeds (0 for an op that does not feed)."""
        return self.n if OPS[self.name].feeds else 0


def tokens_held(ops, held: int = 0) -> list[int]:
    """Tokens per row the cache holds after each op of ``ops`` (``Op``-like: ``name``, ``n``), starting from
    ``held``: feeding ops add their count, ``crop N`` removes N (not below 0), ``reset`` empties, the others keep.
    The one computation of held tokens (case validation, the evicting skip rule, the interpreter's crop)."""
    out = []
    for op in ops:
        held = OPS[op.name].held_after(held, op.n)
        out.append(held)
    return out
