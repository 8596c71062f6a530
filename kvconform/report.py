"""Results of a run: one record per item, the terminal conformance matrix, Markdown and JSON (schema 1).

Records are rebuilt from test reports (``report.user_properties``), so they work the same under pytest-xdist,
where only reports travel back to the controller.
"""

from __future__ import annotations

import json
import math
import os
import tempfile

from kvconform.outcomes import KVConformError, REPORT_TO
from kvconform.families import FAMILIES
from kvconform.digest import write_atomically
from kvconform.oracle import DTYPES
from kvconform.subjects.kinds import exact_kind

OUTCOMES = ("passed", "failed", "skipped", "xfailed", "xpassed", "error", "internal")
"""``internal``: kvconform's own code failed on the item (``outcomes.KVConformInternalError``, or kvconform's
reference cache failed where transformers' DynamicCache passed, ``reference_gaps``): an error of kvconform, no verdict
on the subject."""
SCHEMA = 1


def _outcome(report) -> str | None:
    xfail = hasattr(report, "wasxfail")
    if report.when == "call":
        if report.passed:
            return "xpassed" if xfail else "passed"
        if report.skipped:
            return "xfailed" if xfail else "skipped"
        return "failed"
    if report.failed:
        return "error"
    if report.when == "setup" and report.skipped:
        return "xfailed" if xfail else "skipped"
    return None


def _message(report, outcome) -> str:
    if outcome in ("skipped", "xfailed"):
        if hasattr(report, "wasxfail"):
            return str(report.wasxfail).removeprefix("reason: ")
        longrepr = report.longrepr
        return str(longrepr[2]).removeprefix("Skipped: ") if isinstance(longrepr, tuple) else str(longrepr)
    if outcome in ("failed", "error", "internal"):
        text = report.longreprtext.strip()
        # under pytest-xdist the controller's copy of a report starts with the worker's line
        # ("[gw0] linux -- Python 3.11.7 /path/python"): not part of the item's message
        first, _, rest = text.partition("\n")
        if first.startswith("[gw") and "] " in first and " -- Python " in first:
            text = rest.strip()
        return text
    return ""


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def encode_property(value: dict) -> str:
    """A ``user_properties`` value as a JSON object string: what ``--junitxml`` writes as the property's value (CI
    dashboards parse it) and what travels back from xdist workers. Non-finite floats become strings ("inf", "nan"),
    other non-JSON values their ``str``."""
    return json.dumps({k: _clean(v) for k, v in value.items()}, default=str, ensure_ascii=False)


def decode_property(value) -> dict:
    """The dict of a property written by ``encode_property`` (a dict is returned as it is)."""
    return json.loads(value) if isinstance(value, str) else dict(value or {})


_PENDING_S: dict[str, float] = {}
"""Seconds of an item's setup that passed, until its first record (the call's) is folded in."""


def record_report(results: dict, report, props: dict, digest=None) -> None:
    """Fold one ``TestReport`` into ``results`` (nodeid → record). Later phases refine earlier ones; the record's
    ``duration_s`` is the item's wall time in seconds, setup + call + teardown as pytest timed them (a model built
    for the item's first use counts in it). With the run's
    ``digest``, an xfailed or xpassed item that a known upstream fault names gets ``metrics["known_fault"]`` (the
    entry's id; not when the subject's own ``expected_failures`` xfailed it), so that reports read from the JSON
    alone (``kvconform-merge --junitxml``) can name the fault."""
    outcome = _outcome(report)
    if outcome is None:  # a setup or teardown that passed: its time still counts in the item's duration
        pending = _PENDING_S.pop(report.nodeid, 0.0) + float(getattr(report, "duration", 0.0) or 0.0)
        if report.nodeid in results:
            results[report.nodeid]["duration_s"] = round(results[report.nodeid].get("duration_s", 0.0) + pending, 4)
        else:
            _PENDING_S[report.nodeid] = pending
        return
    info = decode_property(props["kvconform"])
    metrics = {k: _clean(v) for k, v in decode_property(props.get("kvconform_metrics")).items()}
    if outcome in ("failed", "error") and metrics.get("kvconform_internal"):
        outcome = "internal"  # kvconform's own code failed on it: no verdict on the subject
    previous = results.get(report.nodeid)
    duration = round((previous or {}).get("duration_s", 0.0) + _PENDING_S.pop(report.nodeid, 0.0)
                     + float(getattr(report, "duration", 0.0) or 0.0), 4)
    if previous is not None and previous["outcome"] in ("failed", "error", "internal") and outcome == "error":
        previous["duration_s"] = duration
        return  # a teardown error does not hide the call's failure
    record = {"nodeid": report.nodeid, **info, "outcome": outcome, "message": _message(report, outcome),
              "metrics": metrics, "duration_s": duration}
    if props.get("kvconform_failure") and outcome in ("failed", "xfailed", "error", "internal"):
        record["failure"] = decode_property(props["kvconform_failure"])  # kvconform.failure.Failure.as_dict()
    if digest is not None and outcome in ("xfailed", "xpassed"):
        subject = digest.subject(record.get("subject", ""))
        fault = digest.known_fault(record)
        if fault is not None and not (subject is not None and subject.expects_failure(record.get("check", ""),
                                                                                      record.get("case", ""))):
            metrics["known_fault"] = fault["id"]
    results[report.nodeid] = record


def _cell(records) -> tuple[str, bool]:
    counts = {o: 0 for o in OUTCOMES}
    for r in records:
        counts[r["outcome"]] += 1
    ran = (counts["passed"] + counts["failed"] + counts["error"] + counts["xfailed"] + counts["xpassed"]
           + counts["internal"])
    bad = counts["failed"] + counts["error"]
    if ran == 0:
        return ("n/a" if not counts["skipped"] else f"skip {counts['skipped']}"), False
    text = f"{counts['passed'] + counts['xpassed']}/{ran}"
    if counts["xfailed"]:
        text += f" x{counts['xfailed']}"
    if bad:
        text += f" F{bad}"
    if counts["internal"]:
        text += f" K{counts['internal']}"
    return text, bad + counts["internal"] > 0


def _ordered(names, order=None) -> list:
    """``names`` (deduplicated) in the session's ``order`` (subjects or models as declared), names it does not know
    after them, sorted: the same in a serial run and under xdist, where reports arrive in any order."""
    order = list(order or ())
    rank = {n: i for i, n in enumerate(order)}
    return sorted(set(names), key=lambda n: (rank.get(n, len(rank)), n))


def _digest_order(digest, key: str) -> list:
    if digest is None:
        return []
    return list(digest.subject_names if key == "subject" else digest.models if key == "model" else [])


def matrix(results: dict, rows_key: str, cols: list, cols_key: str, order=None) -> list[tuple[str, list, bool]]:
    """Rows of ``(row name, [cell text per column], any failure)``, rows in ``order`` (see ``_ordered``)."""
    records = list(results.values())
    by_cell: dict = {}
    for r in records:  # one pass: a default run has ~2,000 records, 20 subjects and 14 models
        by_cell.setdefault((r[rows_key], r[cols_key]), []).append(r)
    out = []
    for name in _ordered((r[rows_key] for r in records), order):
        cells, failed = [], False
        for col in cols:
            text, bad = _cell(by_cell.get((name, col), ()))
            cells.append(text)
            failed |= bad
        out.append((name, cells, failed))
    return out


def _families(results) -> list:
    present = {r["family"] for r in results.values()}
    return [f for f in FAMILIES if f in present] + sorted(present - set(FAMILIES))


def _table(tr, title, header, rows):
    widths = [max(len(str(x)) for x in col) for col in zip(header, *[[n, *c] for n, c, _ in rows])]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    tr.write_line(title, bold=True)
    tr.write_line(fmt.format(*header))
    for name, cells, failed in rows:
        tr.write_line(fmt.format(name, *cells), red=failed, green=not failed)


_DTYPE_ORDER = tuple(DTYPES)  # the order of oracle.DTYPES, the one table of dtypes


def dtype_counts(results: dict) -> str:
    """One line counting the items per case dtype, and how many of them ran (not skipped), e.g.
    ``items per dtype: float32 1,950 (720 ran), bfloat16 40 (31 ran)``; empty when no record names its dtype (a
    report written before records carried it)."""
    counts: dict = {}
    for r in results.values():
        dtype = r.get("dtype")
        if dtype is None:
            continue
        total, ran = counts.get(dtype, (0, 0))
        counts[dtype] = (total + 1, ran + (r["outcome"] != "skipped"))
    if not counts:
        return ""
    order = sorted(counts, key=lambda d: (_DTYPE_ORDER.index(d) if d in _DTYPE_ORDER else len(_DTYPE_ORDER), d))
    return "items per dtype: " + ", ".join(f"{d} {counts[d][0]:,} ({counts[d][1]:,} ran)" for d in order)


def write_terminal_matrix(tr, results: dict, digest) -> None:
    """Print the matrices: subjects × families, then models × subjects. Cells: passed/ran, xN xfailed, FN failed.
    ``digest``: the run's ``digest.RunDigest`` (the rows' order, the undeclared-kind hints), or None."""
    if not results:
        return
    tr.section("kvconform conformance matrix")
    dtypes = dtype_counts(results)
    if dtypes:
        tr.write_line(dtypes)
    fams = _families(results)
    subjects = _ordered((r["subject"] for r in results.values()), _digest_order(digest, "subject"))
    internal = any(r["outcome"] == "internal" for r in results.values())
    _table(tr, "subjects × check families (passed/ran, xN = known faults xfailed, FN = failed"
           + (", KN = kvconform's own errors, no verdict" if internal else "") + "):",
           ["subject", *fams], matrix(results, "subject", fams, "family", subjects))
    tr.write_line("")
    _table(tr, "models × subjects:", ["model", *subjects],
           matrix(results, "model", subjects, "subject", _digest_order(digest, "model")))
    failed = [r for r in results.values() if r["outcome"] in ("failed", "error")]
    if failed:
        tr.write_line("")
        tr.write_line(f"{len(failed)} non-conforming item(s); first: {failed[0]['nodeid']}", red=True)
        for line in undeclared_kind_hints(results, digest):
            tr.write_line(line, yellow=True)


UNDECLARED_FAMILIES = 3
"""Families an exact subject must fail in before the summary asks whether it is lossy by design."""


def undeclared_kind_hints(results: dict, digest) -> list[str]:
    """One line per subject of the exact kind (no ``kvconform_lossy`` / ``_evicting`` / ``_press`` declaration, not
    built in) that failed items in at least ``UNDECLARED_FAMILIES`` check families. A quantized or compressing cache
    that does not declare it is held to the exact oracle and fails nearly every family, each message blaming the op
    where its error first showed (a new user's int8 cache: 27 failures in 8 families); none of those messages can
    know that the cache is lossy on purpose, so the summary asks once."""
    lines = []
    for facts in getattr(digest, "subjects", ()):
        name = facts.name
        if not exact_kind(facts.kind) or facts.builtin:
            continue
        failed = [r for r in results.values() if r["subject"] == name and r["outcome"] in ("failed", "error")]
        families = sorted({r["family"] for r in failed})
        if len(families) < UNDECLARED_FAMILIES:
            continue
        head = (f"kvconform: {name} is checked as an exact cache and failed {len(failed)} item(s) in "
                f"{len(families)} families ({', '.join(families)}). ")
        fewer, measured = _bytes_evidence([r for r in results.values() if r["subject"] == name])
        if fewer is not None:
            lines.append(
                head + f"Its memory items measured {fewer:.2f}× the bytes of full-precision keys/values, as a cache "
                f"that compresses does: if it quantizes, compresses or evicts by design, declare it — "
                f"kvconform_lossy = {{\"kl_max\": ..., \"top1_min\": ...}} (or kvconform_evicting / "
                f"kvconform_press) on the class or factory — and it is judged against a fresh instance of itself and "
                f"a quality budget instead of the exact oracle (docs/lossy-evicting-paged.md). If "
                f"it is meant to be exact, read its first failure: a declaration would hide the bug.")
        elif measured:
            lines.append(
                head + "Its memory items measured the bytes of full-precision keys/values (nothing stored "
                "compressed), so it is an exact cache with a bug, not a lossy one: read its first failure — "
                "declaring it lossy would hide the bug.")
        else:
            lines.append(
                head + "An exact cache failing this widely most likely stores or returns wrong keys/values: read its "
                "first failure. Declare it lossy (kvconform_lossy) only if it compresses by design — to tell, run "
                "its memory items (-m kvconform_memory): a compressing cache holds fewer bytes than full-precision "
                "keys/values; one that holds as many is exact and has a bug a declaration would hide.")
    return lines


def _bytes_evidence(records) -> tuple[float | None, bool]:
    """What a subject's memory items measured: ``(the lowest held / full-precision bytes ratio below 0.9, or None;
    whether any item measured bytes at all)``. The ratio reads ``bytes_held`` against ``bytes_full_precision``
    (``bytes_formula`` where that is absent) of every item's metrics."""
    fewer, measured = None, False
    for r in records:
        m = r.get("metrics") or {}
        held, full = m.get("bytes_held"), m.get("bytes_full_precision") or m.get("bytes_formula")
        if not isinstance(held, (int, float)) or not isinstance(full, (int, float)) or full <= 0:
            continue
        measured = True
        ratio = held / full
        if ratio < 0.9 and (fewer is None or ratio < fewer):
            fewer = ratio
    return fewer, measured


def _status(records) -> str:
    """A row's mark: ❌ any item failed, ⏭️ nothing ran (every item skipped: nothing was checked), ✅ otherwise."""
    if any(r["outcome"] in ("failed", "error") for r in records):
        return "❌"
    if any(r["outcome"] == "internal" for r in records):
        return "⚠️"
    if all(r["outcome"] == "skipped" for r in records):
        return "⏭️"
    return "✅"


def markdown(results: dict, digest=None) -> str:
    """The subjects × families matrix as a GitHub-flavoured Markdown table; each subject is marked ❌ (a failure),
    ✅ (items ran, none failed) or ⏭️ (all of its items skipped)."""
    fams = _families(results)
    lines = ["### kvconform conformance matrix", "", "| subject | " + " | ".join(fams) + " |",
             "|---" * (len(fams) + 1) + "|"]
    for name, cells, _ in matrix(results, "subject", fams, "family", _digest_order(digest, "subject")):
        status = _status([r for r in results.values() if r["subject"] == name])
        lines.append(f"| {status} {name} | " + " | ".join(cells) + " |")
    lines += ["", "✅ items ran, none failed · ❌ a non-conforming item · ⚠️ kvconform's own error on an item (no "
              "verdict; see the run's \"kvconform's own gaps\") · ⏭️ every item skipped (nothing checked)"]
    return "\n".join(lines) + "\n"


POWER_NA = {
    "not planned": "the pass ran it on no item of the family (the sampled pass runs a few per family; "
                   "--kvconform-power full runs every item)",
    "not exercised": "its items ran without the op it changes (the check skipped it)",
    "no verdict": "kvconform's own code failed on it, or it could not be made for this cache",
}
"""Why a power cell is n/a (its ``why``), in the words the legend uses."""

POWER_STATES = ("killed", "blind", "n/a")
"""A power-table cell (``power_section``): some item of the family failed on the mutant (killed); items ran it, all
passed (blind: the family cannot see that bug on this subject); no item ran it (n/a)."""


def power_section(results: dict, digest=None) -> dict | None:
    """The JSON report's ``power`` section (schema 1, a top-level key; None when no item ran a mutant), built from
    the records' ``metrics["power"]`` (``{mutant: "killed" | "survived" | "not run" | "error"}``, set by the power
    pass, ``checks._power``)::

        {"mode": "sampled" | "full" | "off",
         "mutants": {name: {"what": str, "families": [family, ...]}},
         "subjects": {subject: {family: {mutant: {"status": "killed" | "blind" | "n/a",
                                                  "ran": int, "killed": int, "errors": int,
                                                  "killed_by": nodeid | None, "blind_items": [nodeid, ...]}}}}}

    ``ran`` counts the items whose check ran the mutant live to a verdict (killed or survived); ``errors`` the
    mutant runs kvconform's own code failed on (no verdict, never a kill). Every family a mutant is expected to be
    killed by (``families``) has a cell for each subject with power data, n/a where no item ran it; an n/a cell says
    ``why`` (``POWER_NA``): ``"no verdict"``, ``"not exercised"`` or ``"not planned"``."""
    from kvconform.checks._power import BY_NAME, MUTANTS

    subjects: dict = {}
    for r in sorted(results.values(), key=lambda r: r["nodeid"]):
        power = (r.get("metrics") or {}).get("power")
        if not isinstance(power, dict):
            continue
        table = subjects.setdefault(r["subject"], {})
        for name, result in power.items():
            cell = table.setdefault(r["family"], {}).setdefault(name, {"status": "n/a", "ran": 0, "killed": 0,
                                                                       "errors": 0, "killed_by": None,
                                                                       "blind_items": []})
            if result == "killed":
                cell["ran"] += 1
                cell["killed"] += 1
                cell["killed_by"] = cell["killed_by"] or r["nodeid"]
            elif result == "survived":
                cell["ran"] += 1
                cell["blind_items"].append(r["nodeid"])
            elif result == "error":
                cell["errors"] += 1
            else:
                cell["not_run"] = cell.get("not_run", 0) + 1
    if not subjects:
        return None
    present = {r["family"] for r in results.values()}  # families the run has items of
    for table in subjects.values():
        for mutant in MUTANTS:  # the mutants this subject ran: a cell in every family expected to kill each
            if not any(mutant.name in cells for cells in table.values()):
                continue
            for family in mutant.families:
                if family in present:
                    table.setdefault(family, {}).setdefault(mutant.name, {"status": "n/a", "ran": 0, "killed": 0,
                                                                          "errors": 0, "killed_by": None,
                                                                          "blind_items": []})
        for family, cells in table.items():
            for name, cell in cells.items():
                cell["status"] = "killed" if cell["killed"] else "blind" if cell["ran"] else "n/a"
                if cell["killed"]:
                    cell["blind_items"] = []
                if cell["status"] == "n/a":
                    cell["why"] = ("no verdict" if cell["errors"] else
                                   "not exercised" if cell.pop("not_run", 0) else "not planned")
                cell.pop("not_run", None)
            table[family] = dict(sorted(cells.items(), key=lambda kv: list(BY_NAME).index(kv[0])
                                        if kv[0] in BY_NAME else len(BY_NAME)))
    order = {f: i for i, f in enumerate(FAMILIES)}
    subjects = {name: dict(sorted(table.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0])))
                for name, table in subjects.items()}
    ordered = _ordered(subjects, _digest_order(digest, "subject"))
    mode = ((getattr(digest, "environment", None) or {}).get("power")) if digest is not None else None
    return {"mode": mode or "sampled",
            "mutants": {m.name: {"what": m.what, "families": list(m.families)} for m in MUTANTS},
            "subjects": {name: subjects[name] for name in ordered}}


def blind_cells(section: dict | None) -> list[tuple[str, str, str, dict]]:
    """Every blind cell of a ``power_section``: ``(subject, family, mutant, cell)``."""
    return [(subject, family, name, cell) for subject, table in ((section or {}).get("subjects") or {}).items()
            for family, cells in table.items() for name, cell in cells.items() if cell["status"] == "blind"]


def write_power_summary(tr, results: dict, digest=None) -> None:
    """Print one power table per subject that ran mutants (``power_section``): rows the families, columns the
    mutants, cells killed / BLIND / n/a ("·": the mutant is not expected to be killed by that family), then each
    blind cell with an item that passed on the mutant."""
    section = power_section(results, digest)
    if section is None:
        return
    tr.section("kvconform power (mutants of each subject made at its interface)")
    tr.write_line(f"power pass: {section['mode']}; a mutant is the subject's own cache with one planted bug: "
                  f"killed = an item of the family failed on it, BLIND = items ran it and all passed, n/a = no item "
                  f"ran it to a verdict: " + "; ".join(f"{why} = {text}" for why, text in POWER_NA.items()))
    mutants = section["mutants"]
    for subject, table in section["subjects"].items():
        names = [n for n in mutants if any(n in cells for cells in table.values())]
        rows = []
        for family, cells in table.items():
            texts = []
            for n in names:
                cell = cells.get(n)
                texts.append("·" if cell is None else {"killed": "killed", "blind": "BLIND"}.get(
                    cell["status"], f"n/a ({cell.get('why', 'not planned')})"))
            rows.append((family, texts, any(t == "BLIND" for t in texts)))
        tr.write_line("")
        _table(tr, f"{subject}: families × mutants", ["family", *names], rows)
    blind = blind_cells(section)
    if blind:
        tr.write_line("")
        tr.write_line(f"{len(blind)} blind cell(s): items that pass on the subject and on a mutant that should break "
                      f"them (a missing case, or a check that cannot see that bug on this subject):", yellow=True)
        for subject, family, name, cell in blind:
            tr.write_line(f"  {subject} × {family} × {name} ({mutants[name]['what']}): passed on "
                          f"{cell['ran']} item(s), e.g. {cell['blind_items'][0]}", yellow=True)
        tr.write_line("  what to do: a lossy cache without a fake-quant twin is judged against a fresh instance of "
                      "itself, which has the same bug, so stale_token / dropped_token are BLIND in those families by "
                      "design (the quality family, against the oracle, is the one that can kill them); elsewhere a "
                      "case that exercises the bug is missing: add one (--kvconform-cases, docs/cases.md)",
                      yellow=True)


def write_markdown_summary(results: dict, path: str | None, digest=None) -> None:
    """Append the Markdown matrix to ``path`` (``$GITHUB_STEP_SUMMARY``) when set."""
    if path and results:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(markdown(results, digest))


def json_payload(results: dict, digest, progress: dict | None = None) -> dict:
    """The JSON report's data: ``{"schema": 1, "complete", "planned", "finished", "incomplete", "environment": {...},
    "results": [...], "power": {...}}``, results sorted by node id, ``power`` only where items ran mutants
    (``power_section``); ``digest.environment`` is the environment (``{}`` for a ``digest``
    of None: a report written before the run's session is known). ``progress``: the run's state (``run_progress``);
    without it the report says it is complete with every record finished. What ``write_json`` writes and the HTML
    page reads."""
    progress = progress or run_progress(len(results), len(results), None)
    power = power_section(results, digest)
    return {"schema": SCHEMA, **progress, "environment": digest.environment if digest is not None else {},
            "results": sorted(results.values(), key=lambda r: r["nodeid"]), **({"power": power} if power else {})}


def write_json(path: str, results: dict, digest, progress: dict | None = None) -> None:
    """Write ``json_payload(results, digest, progress)`` to ``path`` atomically (temp file, then rename)."""
    write_atomically(path, json.dumps(json_payload(results, digest, progress), indent=1, ensure_ascii=False))


def run_progress(planned: int | None, finished: int, incomplete: str | None) -> dict:
    """The state a report carries beside its results (schema 1; a report without these keys was written by an
    earlier version): ``complete`` (every planned item has its result and the run ended by
    itself), ``planned`` (the items selected to run, after ``-k`` / ``-m`` / ``--kvconform-shard``; None before
    collection), ``finished`` (items with a result) and ``incomplete`` (why not complete, a sentence; None when
    complete)."""
    complete = incomplete is None and planned is not None and finished >= planned
    if not complete and incomplete is None:
        incomplete = f"{finished} of {planned if planned is not None else 'an unknown number of'} items finished"
    return {"complete": complete, "planned": planned, "finished": finished, "incomplete": incomplete}


def progress_of(payload: dict) -> dict:
    """A report's state (``run_progress``'s keys). A report of an earlier version, without them, counts as complete
    with its results finished (it carried no state to say otherwise)."""
    finished = len(payload.get("results") or ())
    if "complete" not in payload:
        return run_progress(finished, finished, None)
    return {"complete": bool(payload.get("complete")), "planned": payload.get("planned"),
            "finished": payload.get("finished", finished), "incomplete": payload.get("incomplete")}


class ReportLocked(KVConformError):
    """Another run is writing the same JSON report; ``str`` names it and the fix."""


class ReportLock:
    """A lock on a JSON report's path, held for a run (``PATH.lock`` beside the report), so that two runs never
    write one report: the second run's results would replace the first's without a word.

    The lock is ``flock`` on the lock file (released by the kernel when the process ends, even by SIGKILL, so a
    killed run leaves no stale lock); the file holds the holder's pid, host, start time and command line, which the
    refusal names. Where ``fcntl`` is missing (Windows) the file is created exclusively instead, and a file left by
    a killed run is named in the refusal to be deleted.
    """

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        self.lock_path = self.path + ".lock"
        self._fd: int | None = None

    def acquire(self, command: str = "") -> None:
        """Take the lock for this process.

        Raises:
            ReportLocked: another run holds it (naming its pid, host, start time and command, and the fix).
        """
        import datetime
        import socket

        info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "command": command[:1000],
                           "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")})
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not on Linux or macOS
            fcntl = None
        for _ in range(20):
            if fcntl is None:  # pragma: no cover
                try:
                    fd = os.open(self.lock_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
                except FileExistsError:
                    raise ReportLocked(self._refusal(stale_possible=True)) from None
            else:
                fd = os.open(self.lock_path, os.O_CREAT | os.O_RDWR, 0o666)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    os.close(fd)
                    raise ReportLocked(self._refusal()) from None
                try:  # the holder before us may have removed the file after we opened it: lock the one there now
                    same = os.stat(self.lock_path).st_ino == os.fstat(fd).st_ino
                except FileNotFoundError:
                    same = False
                if not same:
                    os.close(fd)
                    continue
                os.ftruncate(fd, 0)
            os.write(fd, info.encode())
            self._fd = fd
            return
        raise ReportLocked(self._refusal())  # pragma: no cover - the file kept being replaced under us

    def release(self) -> None:
        """Remove the lock file and let the lock go (nothing when not held)."""
        if self._fd is None:
            return
        try:
            os.unlink(self.lock_path)
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None

    def _refusal(self, stale_possible: bool = False) -> str:
        try:
            with open(self.lock_path, encoding="utf-8") as fh:
                other = json.loads(fh.read() or "{}")
        except (OSError, ValueError):
            other = {}
        who = (f"pid {other.get('pid', '?')} on {other.get('host', '?')}, started {other.get('started', '?')}"
               + (f": {other['command']}" if other.get("command") else ""))
        stem, ext = os.path.splitext(os.path.basename(self.path))
        text = (f"another kvconform run is writing this report now ({who}), and the results of one run would replace "
                f"the other's. Give this run a report of its own (e.g. --kvconform-json {stem}-2{ext or '.json'}; "
                f"kvconform-merge --json puts the reports of one plan's shards together), or wait for that run to end")
        if stale_possible:  # pragma: no cover - without fcntl
            text += f"; if no such run is going on, delete {self.lock_path}"
        return text


def json_path_problem(path: str) -> str | None:
    """Why the JSON report cannot be written to ``path`` (checked before the run, so that a bad path does not cost
    the whole run): its folder does not exist or is not writable, or ``path`` is a folder. None when it can."""
    target = os.path.abspath(path)
    directory = os.path.dirname(target)
    if os.path.isdir(target):
        return "is a folder; give a file name"
    if not os.path.isdir(directory):
        return f"folder {directory!r} does not exist"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"folder {directory!r} is not writable"
    # os.access trusts the permission bits (and root passes them), which special file systems such as /proc or a
    # read-only mount do not honour: create and remove a file there, as write_json will
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".kvconform-", suffix=".probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return f"folder {directory!r} does not take new files ({exc.strerror or exc})"
    if os.path.exists(target):
        try:
            with open(target, "a", encoding="utf-8"):
                pass
        except OSError as exc:
            return f"cannot be written ({exc.strerror or exc})"
    return None


def write_selftest_summary(tr) -> None:
    """Print the share of bundled faulty caches caught, per family (``--kvconform-selftest``)."""
    per_family: dict = {}
    for reports in tr.stats.values():
        for report in reports:
            props = dict(getattr(report, "user_properties", None) or ())
            info = props.get("kvconform_selftest")
            info = decode_property(info) if info else None
            if info and getattr(report, "when", None) == "call":
                per_family.setdefault(info["family"], []).append(info)
    if not per_family:
        return
    tr.section("kvconform selftest: faulty caches caught per family")
    total = caught = 0
    for family in sorted(per_family):
        infos = per_family[family]
        n = sum(1 for i in infos if i["caught"])
        total, caught = total + len(infos), caught + n
        missed = [i["name"] for i in infos if not i["caught"]]
        tr.write_line(f"{family:<12} {n}/{len(infos)} caught" + (f"   missed: {', '.join(missed)}" if missed else ""),
                      green=not missed, red=bool(missed))
    tr.write_line(f"{'all':<12} {caught}/{total} caught ({100 * caught / total:.0f}%)", bold=True)


def known_fault_findings(results: dict, digest) -> tuple[list, dict]:
    """What the run says about the known-faults list: ``(stale, passed)``.

    ``stale``: ``{"id", "transformers", "source"}`` of the entries that apply to the installed transformers and the
    run's models but match no planned item (``RunDigest.stale_faults``). ``passed``: ``{label: [nodeid, ...]}`` of
    items expected to fail that passed — XPASS, or under ``--kvconform-strict`` a pass of an item a known fault
    names; ``label`` is the entry id, or ``"<subject>.expected_failures"`` when the xfail came from the subject's own
    ``CacheSpec``. A pass of a self-consistency-judged subject on a fault of the model's code is not listed
    (``shared_by_fresh`` in ``RunDigest.known_faults``: the fresh instance it is compared with shares that fault).
    """
    passed: dict = {}
    run_time: dict = {}  # entry id judged at run time → (whether any item showed it, the items that passed)
    for r in sorted(results.values(), key=lambda r: r["nodeid"]):
        fault = digest.known_fault(r)
        if fault is not None and fault.get("judged_at_run_time") and not fault["shared_by_fresh"]:
            shown, passes = run_time.setdefault(fault["id"], [False, []])
            run_time[fault["id"]][0] = shown or r["outcome"] in ("xfailed", "failed")
            if r["outcome"] == "passed":
                passes.append(r["nodeid"])
        if r["outcome"] not in ("xpassed", "passed") or (r["outcome"] == "passed" and not digest.strict):
            continue
        subject = digest.subject(r["subject"])
        if r["outcome"] == "xpassed" and subject is not None and subject.expects_failure(r["check"], r["case"]):
            label = f"{r['subject']}.expected_failures"
        else:
            if fault is None or fault["shared_by_fresh"]:
                continue
            label = fault["id"]
        passed.setdefault(label, []).append(r["nodeid"])
    # An entry judged at run time marks nothing before its items run, so a fault that stopped occurring shows as
    # plain passes: it is XPASS when not one of the items it names failed (the fault was seen nowhere).
    for fault_id, (shown, passes) in run_time.items():
        if not shown and passes and fault_id not in passed:
            passed[fault_id] = passes
    return list(digest.stale_faults), passed


def write_known_fault_summary(tr, results: dict, digest) -> None:
    """Print one line per known-fault entry that matched no item (stale) and per entry whose items passed (XPASS),
    so that the list is kept as strict as the cases. Prints nothing when there is nothing to say."""
    if not results:
        return
    stale, passed = known_fault_findings(results, digest)
    if not stale and not passed:
        return
    tr.section("kvconform known faults")
    for fault in stale:
        tr.write_line(f"stale: {fault['id']!r} (transformers {fault['transformers']}; "
                      f"{os.path.basename(fault['source'])}) "
                      f"matched no item of this run's plan", yellow=True)
    verb = "passed (strict)" if digest.strict else "XPASS"
    for label, nodeids in passed.items():
        tr.write_line(f"{verb}: {label!r}: {len(nodeids)} item(s) expected to fail passed, e.g. {nodeids[0]}",
                      yellow=True)


# ------------------------------------------------------------------------------------------------ kvconform's own gaps
REFERENCE_SUBJECT = "ReferenceCache"
"""The subject name of kvconform's own reference cache."""
BASELINE_SUBJECT = "DynamicCache"
"""transformers' own cache that the reference is held to (``reference_gaps``)."""
REFERENCE_GAP = "kvconform's ReferenceCache fails where transformers' DynamicCache passes (the reference is wrong)"


def reference_gaps(results: dict) -> list:
    """Mark the items where kvconform's reference cache failed and transformers' ``DynamicCache`` passed the same
    (model, check, case) in this run: the reference, not the model, is wrong there, which is kvconform's gap. Their
    outcome becomes ``internal`` (metrics ``kvconform_internal`` = ``REFERENCE_GAP``). Idempotent; returns the
    records marked now. Items the reference failed where DynamicCache failed too (a model fault) or did not run stay
    as they are."""
    passed = {(r["model"], r["check"], r["case"]) for r in results.values()
              if r["subject"] == BASELINE_SUBJECT and r["outcome"] in ("passed", "xpassed")}
    marked = []
    for r in results.values():
        if r["subject"] == REFERENCE_SUBJECT and r["outcome"] in ("failed", "error") \
                and (r["model"], r["check"], r["case"]) in passed:
            r["outcome"] = "internal"
            r["metrics"] = {**(r.get("metrics") or {}), "kvconform_internal": REFERENCE_GAP}
            marked.append(r)
    return marked


def own_gaps(results: dict, digest=None) -> list[str]:
    """The lines of the run's "kvconform's own gaps" summary (empty when kvconform's own code failed nowhere): the
    installed transformers, one line per place kvconform's code failed (items, the exception, an example item), the
    reference's gaps, and where to report them."""
    internal = sorted((r for r in results.values() if r["outcome"] == "internal"), key=lambda r: r["nodeid"])
    if not internal:
        return []
    env = getattr(digest, "environment", None) or {}
    versions = ", ".join(f"{k} {env[k]}" for k in ("transformers", "torch", "kvconform") if env.get(k))
    lines = [f"{len(internal)} item(s) are errors of kvconform's own code, not verdicts on their subjects "
             f"(exit code 3){' — on ' + versions if versions else ''}:"]
    by_place: dict = {}
    for r in internal:
        by_place.setdefault(r["metrics"].get("kvconform_internal", "?"), []).append(r)
    for place, records in sorted(by_place.items(), key=lambda kv: -len(kv[1])):
        what = next((r["metrics"]["internal_error"] for r in records if r["metrics"].get("internal_error")), None)
        subjects = sorted({r["subject"] for r in records})
        lines.append(f"  {len(records)} item(s): {place}" + (f": {what}" if what else "")
                     + f" (subjects: {', '.join(subjects[:4])}{' …' if len(subjects) > 4 else ''}); "
                     f"e.g. {records[0]['nodeid']}")
    lines.append(f"missing in kvconform: what these places need to handle; {REPORT_TO} "
                 "(each item's message names the place; -rf prints them)")
    return lines


def write_own_gaps_summary(tr, results: dict, digest=None) -> None:
    """Print the "kvconform's own gaps" section (``own_gaps``), once per run; nothing when there are none."""
    lines = own_gaps(results, digest)
    if not lines:
        return
    tr.section("kvconform's own gaps")
    for line in lines:
        tr.write_line(line, yellow=True)


# ------------------------------------------------------------------------------------------------ per architecture
ARCHITECTURE_PREFIX = "tf_"
"""The prefix of an architecture's model name in records (``architectures.model_name``: ``tf_<model type>``)."""
UNEXPLAINED = ("failed", "error", "internal")
"""The outcomes that no known fault explains: a failure (kvconform's verdict on the cache, or on the model where no
known-faults entry names it), an error, an error of kvconform's own code. A known upstream fault is ``xfailed``."""


def architecture_rows(results: dict) -> list[tuple[str, dict]]:
    """Per architecture of a ``transformers:*`` run (records whose model is ``tf_<type>``), in name order:
    ``(model type, {"items", "passed", "known", "unexplained", "xpassed", "skipped"})`` — ``known`` the items a
    known upstream fault explains (xfailed), ``unexplained`` those of ``UNEXPLAINED``. Empty when no record is of an
    architecture."""
    rows: dict = {}
    for r in results.values():
        if not r["model"].startswith(ARCHITECTURE_PREFIX):
            continue
        row = rows.setdefault(r["model"].removeprefix(ARCHITECTURE_PREFIX),
                              dict.fromkeys(("items", "passed", "known", "unexplained", "xpassed", "skipped"), 0))
        row["items"] += 1
        outcome = r["outcome"]
        key = ("known" if outcome == "xfailed" else "unexplained" if outcome in UNEXPLAINED
               else outcome if outcome in row else None)
        if key:
            row[key] += 1
    return sorted(rows.items())


def architecture_summary(results: dict) -> list[tuple[str, bool]]:
    """The lines of the per-architecture summary of a ``transformers:*`` run, each with whether it is bad (an
    unexplained failure): a table (architecture, items, passed, known upstream faults, unexplained, XPASS,
    skipped), then the architectures with unexplained failures, or that there are none. Empty when the run has no
    architecture."""
    rows = architecture_rows(results)
    if not rows:
        return []
    header = ("architecture", "items", "passed", "known faults", "unexplained", "XPASS", "skipped")
    cells = [(name, *(str(row[k]) for k in ("items", "passed", "known", "unexplained", "xpassed", "skipped")))
             for name, row in rows]
    widths = [max(len(c[i]) for c in [header, *cells]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [(fmt.format(*header), False)]
    lines += [(fmt.format(*c), row["unexplained"] > 0) for c, (_, row) in zip(cells, rows)]
    bad = [(name, row["unexplained"]) for name, row in rows if row["unexplained"]]
    known = sum(row["known"] for _, row in rows)
    if bad:
        lines.append((f"{len(bad)} of {len(rows)} architecture(s) with unexplained failures (no known fault names "
                      f"them: a fault of the cache, of kvconform, or of transformers not yet listed in "
                      f"known_faults.toml): " + ", ".join(f"{name} ({n})" for name, n in bad), True))
    else:
        lines.append((f"{len(rows)} architecture(s): no unexplained failure ({known} item(s) of known upstream "
                      f"faults)", False))
    return lines


def write_architecture_summary(tr, results: dict) -> None:
    """Print the "kvconform architectures" section (``architecture_summary``); nothing when the run has no
    architecture."""
    lines = architecture_summary(results)
    if not lines:
        return
    tr.section("kvconform architectures")
    for line, bad in lines:
        tr.write_line(line, red=bad)
