"""JUnit XML of a kvconform JSON report (``kvconform-merge --junitxml PATH``): the format CI dashboards (GitHub
test reporters, GitLab's ``artifacts:reports:junit``, Buildkite's junit annotations, Jenkins) show natively.

One ``<testcase>`` per item: ``classname`` is the subject (so a dashboard groups the items by cache) and ``name``
the item id (``<subject>-<model>-<check>-<case>``, what ``-k`` selects). A failed item carries ``<failure>`` with
kvconform's message (its first line in the ``message`` attribute, the whole of it, reproduce line included, as the
element's text), an error ``<error>``, a skipped item ``<skipped>`` with its reason, and an item xfailed on a known
upstream fault ``<skipped type="pytest.xfail">`` naming the fault (``known upstream fault '<id>': <reason>``), as
pytest's own ``--junitxml`` writes xfails. An XPASS is a passed testcase whose ``<system-out>`` says so. Each
testcase's ``<properties>`` carry its model, check, family, case and outcome. A report that is not complete
(``complete: false``: a run interrupted or killed) gets one more testcase, ``kvconform`` / ``run complete``, with an
``<error>`` saying why and how many items finished, so that the dashboard is red rather than green on part of a run.

Only the standard library (``xml.etree``); no time is given per testcase (the JSON report holds none).
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")
"""Characters XML 1.0 cannot hold (ElementTree would write them as they are, and the file would not parse)."""


def _text(value) -> str:
    """``value`` as XML text: a string as it is, anything else as JSON (``true``, ``null``, ``8``); characters XML
    cannot hold as ``\\xNN``."""
    import json

    text = value if isinstance(value, str) else json.dumps(value)
    return _NOT_XML.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _first_line(message: str) -> str:
    return message.strip().partition("\n")[0]


def _xfail_text(record: dict) -> str:
    fault = (record.get("metrics") or {}).get("known_fault")
    reason = record.get("message") or ""
    if fault:
        return f"known upstream fault {fault!r}: {reason}"
    return f"expected failure ({record.get('subject', '')}'s own expected_failures): {reason}"


def junit_tree(report: dict) -> ET.ElementTree:
    """The JUnit XML tree of a kvconform JSON report (schema 1: ``report.write_json``, or a merged one).

    Args:
        report: the parsed JSON report; ``results`` records need ``nodeid``, ``subject``, ``outcome`` and
            ``message`` (``model``, ``check``, ``family``, ``case``, ``metrics`` when present).

    Returns:
        ``<testsuites name="kvconform">`` holding one ``<testsuite name="kvconform">`` whose ``tests`` /
        ``failures`` / ``errors`` / ``skipped`` count its testcases (skipped: skips and xfails), with the report's
        environment and state (``complete``, ``planned``, ``finished``) as suite properties.
    """
    from kvconform.digest import item_id

    records = sorted(report.get("results") or (), key=lambda r: r["nodeid"])
    suite = ET.Element("testsuite", name="kvconform")
    props = ET.SubElement(suite, "properties")
    environment = report.get("environment") or {}
    for key, value in environment.items():
        if isinstance(value, (str, int, float, bool)) or value is None:
            ET.SubElement(props, "property", name=_text(key), value=_text(value))
    for key in ("complete", "planned", "finished", "incomplete"):
        if report.get(key) is not None:
            ET.SubElement(props, "property", name=key, value=_text(report[key]))
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for record in records:
        outcome = record["outcome"]
        case = ET.SubElement(suite, "testcase", classname=_text(record.get("subject", "")),
                             name=_text(item_id(record["nodeid"]) or record["nodeid"]))
        case_props = ET.SubElement(case, "properties")
        for key in ("model", "check", "family", "case", "outcome"):
            if key in record:
                ET.SubElement(case_props, "property", name=key, value=_text(record[key]))
        message = record.get("message") or ""
        counts["tests"] += 1
        if outcome in ("failed", "error", "internal"):  # internal: kvconform's own error, no verdict on the subject
            tag = "failure" if outcome == "failed" else "error"
            counts["failures" if tag == "failure" else "errors"] += 1
            element = ET.SubElement(case, tag, message=_text(_first_line(message)),
                                    type="kvconform.internal" if outcome == "internal" else "kvconform")
            element.text = _text(message)
        elif outcome == "skipped":
            counts["skipped"] += 1
            ET.SubElement(case, "skipped", type="pytest.skip", message=_text(message))
        elif outcome == "xfailed":
            counts["skipped"] += 1
            ET.SubElement(case, "skipped", type="pytest.xfail", message=_text(_xfail_text(record)))
        elif outcome == "xpassed":
            out = ET.SubElement(case, "system-out")
            out.text = _text("XPASS: expected to fail, passed (the fault may be fixed in this version): "
                             + _xfail_text(record))
    if "complete" in report and not report["complete"]:
        counts["tests"] += 1
        counts["errors"] += 1
        case = ET.SubElement(suite, "testcase", classname="kvconform", name="run complete")
        why = report.get("incomplete") or "the run did not finish"
        element = ET.SubElement(case, "error", type="kvconform.incomplete",
                                message=_text(f"INCOMPLETE: {why}"))
        element.text = _text(f"INCOMPLETE: {why}. Planned {report.get('planned')} items, {report.get('finished')} "
                             f"finished: the other testcases are only the items that finished.")
    for key, value in counts.items():
        suite.set(key, str(value))
    root = ET.Element("testsuites", name="kvconform", **{k: str(v) for k, v in counts.items()})
    root.append(suite)
    ET.indent(root, space=" ")
    return ET.ElementTree(root)


def write_junit(path: str, report: dict) -> None:
    """Write ``junit_tree(report)`` to ``path`` (UTF-8, with an XML declaration), atomically: a temp file in the same
    folder, then a rename (``digest.write_atomically``)."""
    from kvconform.digest import write_atomically

    text = ET.tostring(junit_tree(report).getroot(), encoding="unicode")
    write_atomically(path, '<?xml version="1.0" encoding="utf-8"?>\n' + text + "\n")
