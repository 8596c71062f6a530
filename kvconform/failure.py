"""The failure record: what a check found, as typed values, rendered to text only by the reports.

A check builds its failure from typed parts at the point of assertion — the ops trail (``OpsTrail``: the case's
ops, the op it failed or raised at, the note after them), the likely cause (``Cause``: an id, its facts, the
sentence for users) and plain lines — and ``CheckContext.fail`` assembles them into a ``Failure`` (headline,
measured vs bound, ops, cause, reproduce arguments). Whoever needs a fact reads the field (diagnosis, the
from-scratch adapter's wording, the HTML page, known-fault matching); ``Failure.lines()`` / ``render()`` make the
message text (ARCHITECTURE.md, "Failure messages"), and ``as_dict()`` the JSON report's ``failure`` field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Cause:
    """The likely cause of a failure.

    Attributes:
        text: the sentence for users (the ``likely cause:`` line without its prefix).
        id: a stable name of the cause (``"kv_length"``, ...), or None where the cause has none yet; known faults
            and expected failures may match it instead of the text.
        facts: the measurements the cause was read from (JSON-serialisable values: ints, floats, strings), e.g.
            ``{"layer_idx": 0, "returned": 7, "held": 8}`` for ``kv_length``.
    """

    text: str
    id: str | None = None
    facts: dict = field(default_factory=dict)

    def line(self) -> str:
        """The message line: ``"likely cause: " + text``."""
        return "likely cause: " + self.text

    def __str__(self) -> str:
        return self.text

    def with_text(self, text: str) -> Cause:
        """The same cause (id, facts) said in other words."""
        return dataclasses.replace(self, text=text)

    def as_dict(self) -> dict:
        """``{"id", "text", "facts"}`` for the JSON report."""
        return {"id": self.id, "text": self.text, "facts": dict(self.facts)}


@dataclass(frozen=True)
class OpsTrail:
    """The ops a failing item ran and where it failed.

    Attributes:
        ops: the case's ops as ``(op name, label)`` pairs in order (``("prefill", "prefill(12)")``), or a single
            ``(None, text)`` pair for a trail that is no case's ops (a generate() call, a benchmark).
        at: the label of the step it failed or raised at (``"chunk(3)"``, ``"decode 1 after crop"``), or None.
        verb: ``"failed"``, ``"raised"`` or ``"at"`` (rendered ``[failed at X]``, ``[raised at X]``, ``[at X]``).
        note: what follows the trail after ``"; "`` (how positions were given), or None.
        op_index: the index in ``ops`` of the op it failed or raised in (``"decode 1"`` names a step of one of
            several decode ops), or None where not measured.
    """

    ops: tuple = ()
    at: str | None = None
    verb: str = "failed"
    note: str | None = None
    op_index: int | None = None

    @classmethod
    def of_case(cls, case, at: str | None = None, verb: str = "failed", note: str | None = None,
                text: str | None = None, op_index: int | None = None) -> OpsTrail:
        """The trail of ``case`` (a ``Case``: its ``ops``); ``text``, when given, replaces the case's ops label
        (a check that ran other ops than the case lists) and is kept as one untyped entry (``op_index`` then
        dropped: it indexes the case's ops)."""
        ops = ((None, text),) if text else tuple((op.name, op.label) for op in case.ops)
        return cls(ops, at, verb, note, None if text else op_index)

    @property
    def label(self) -> str:
        """The ops joined as a run names them (``"prefill(12) → decode×2"``)."""
        return " → ".join(label for _, label in self.ops)

    @property
    def names(self) -> tuple[str, ...]:
        """The op names of the trail (``OP_NAMES``), untyped entries left out."""
        return tuple(name for name, _ in self.ops if name)

    def line(self) -> str:
        """The message line: ``ops: <label>   [failed at <at>]; <note>``."""
        text = f"ops: {self.label}"
        if self.at is not None:
            text += f"   [{self.verb} at {self.at}]"
        return text + (f"; {self.note}" if self.note else "")

    def as_dict(self) -> dict:
        """``{"ops": [[name, label], ...], "at", "verb", "note"}`` for the JSON report."""
        return {"ops": [list(pair) for pair in self.ops], "at": self.at, "verb": self.verb, "note": self.note}


@dataclass(frozen=True)
class Measured:
    """A measured value against its bound: ``value`` (a number) in ``unit`` (``"logits"``, ``"tokens"``,
    ``"bytes"``, ``"s"``, ...) should be ``relation`` (``"<="``, ``"=="``, ``">="``) ``bound``."""

    name: str
    value: float | int | None
    bound: float | int | None
    unit: str = ""
    relation: str = "<="

    def as_dict(self) -> dict:
        return {"name": self.name, "value": self.value, "bound": self.bound, "unit": self.unit,
                "relation": self.relation}


Line = Any  # a message line: str, OpsTrail or Cause


@dataclass(frozen=True)
class Failure:
    """One failing item's record.

    Attributes:
        headline: ``"<check> failed: <subject> on <model> (<dtype>, batch B), case <id>"``.
        body: the message's lines in order: plain strings, and the ``OpsTrail`` / ``Cause`` parts in place.
        measured: the measured value against its bound where the check gave one (``Measured``), else None.
        reproduce: the ``reproduce:`` line (``digest.reproduce_line``).
        reproduce_args: the extra command-line arguments in it (``--kvconform-...``), in order.
    """

    headline: str
    body: tuple = ()
    measured: Measured | None = None
    reproduce: str = ""
    reproduce_args: tuple = ()

    @property
    def ops(self) -> OpsTrail | None:
        """The ops trail of the body, or None."""
        return next((x for x in self.body if isinstance(x, OpsTrail)), None)

    @property
    def cause(self) -> Cause | None:
        """The (first) likely cause of the body, or None."""
        return next((x for x in self.body if isinstance(x, Cause)), None)

    def lines(self) -> list[str]:
        """The body rendered, one string a line (empty lines left out)."""
        out = []
        for x in self.body:
            text = x.line() if isinstance(x, (OpsTrail, Cause)) else str(x)
            if text:
                out.append(text)
        return out

    def render(self) -> str:
        """The failure message: the headline, the body indented by two spaces, the reproduce line."""
        return "\n".join([self.headline, *("  " + line for line in self.lines()),
                          *(["  " + self.reproduce] if self.reproduce else [])])

    def as_dict(self) -> dict:
        """The JSON report's ``failure`` field: ``{"headline", "measured", "ops", "cause", "reproduce",
        "reproduce_args"}`` (``measured``, ``ops``, ``cause``: None where the check gave none)."""
        return {"headline": self.headline,
                "measured": self.measured.as_dict() if self.measured else None,
                "ops": self.ops.as_dict() if self.ops else None,
                "cause": self.cause.as_dict() if self.cause else None,
                "reproduce": self.reproduce, "reproduce_args": list(self.reproduce_args)}
