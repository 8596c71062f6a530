"""The conformance page: one self-contained HTML file (``--kvconform-html PATH``, ``kvconform-merge --html PATH``).

It is built from the JSON report's data (the dict ``--kvconform-json`` writes, schema 1, or the one
``kvconform-merge`` makes), so a run and a merged sharded run give the same page. Everything is inline: the data as
one JSON block, the CSS and the script; the page loads nothing from anywhere (no CDN, fonts or scripts), so it opens
from a CI artefact offline.

What it shows: a header (the environment, the run's header lines, the report's own state, the known faults that
xfailed items, stale entries and XPASS items), the totals per outcome, the subjects × families and models × subjects
matrices as colour grids (compact cells, sticky headers, scrolling: readable at 180+ models), filters by subject,
model, family, dtype and outcome, every cell (and row or column name) opening its items in a side panel with each
failure's message and reproduce line, and the list of failures. Cell texts follow the terminal matrix
(``passed/ran``, ``xN`` xfailed, ``FN`` failed, ``skip N``).

Text is escaped everywhere: the header is escaped here (``html.escape``), the data block has ``<``, ``>`` and ``&``
written as JSON escapes (so no message can end the script element), and the script puts every name and message into
the page as text nodes, never as markup.
"""

from __future__ import annotations

import html
import json
import os
import re
import tomllib

NO_DTYPE = "—"
"""The dtype shown for an item whose record and case say none (a case from a file the page cannot read)."""


def case_dtypes() -> dict[str, str]:
    """``{case id: dtype}`` of the built-in cases (``conformance_cases/*.toml``: the case's ``dtype``, else its
    file's ``[defaults]``, else ``cases.Case``'s default), read with ``tomllib`` only (no validation, no torch).
    A file that cannot be read gives nothing (the page then shows ``NO_DTYPE`` for its cases)."""
    from kvconform.cases import Case, builtin_cases_dir

    default = Case.__dataclass_fields__["dtype"].default
    out: dict[str, str] = {}
    try:
        paths = sorted(builtin_cases_dir().glob("*.toml"))
    except ValueError:  # CaseFileError: a broken install; the page is still written
        return out
    for path in paths:
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        file_default = (data.get("defaults") or {}).get("dtype", default)
        for case in data.get("case") or ():
            if isinstance(case, dict) and "id" in case:
                out[str(case["id"])] = str(case.get("dtype", file_default))
    return out


def _item_id(nodeid: str) -> str:
    from kvconform.digest import item_id

    return item_id(nodeid) or nodeid


def page_data(payload: dict, digest=None) -> dict:
    """The page's data: names in the report's orders and every item as a row of indices.

    Args:
        payload: a JSON report (``{"schema": 1, "environment": {...}, "results": [...]}``).
        digest: the run's ``digest.RunDigest`` when the page is written by the run itself (it names the known-fault
            entry of each item); None for a report read back (``kvconform-merge``).

    Returns:
        ``{"outcomes", "subjects", "models", "families", "checks", "cases", "dtypes", "faults", "texts",
        "reproduces", "items"}``; each item is ``[subject, model, family, check, case, dtype, outcome, item id,
        message, fault, seconds, reproduce]``, the first seven and message, fault and reproduce indices into the
        lists of those names (``-1`` when none; ``reproduces`` holds the commands of the records' ``failure``
        field, ``failure["reproduce"]`` without its ``reproduce: `` prefix, and that line is left out of the
        message text), seconds the item's ``duration_s`` (``-1`` when the record has none; the item's tooltip
        shows it);
        the item id is ``0`` where it is the suite's own (``<subject>-<model>-<check without check_>-<case>``,
        rebuilt by the page: 4 MB less at 72,000 items).
    """
    from kvconform.report import OUTCOMES, _families, _ordered

    records = [r for r in payload.get("results") or () if isinstance(r, dict)]
    env = payload.get("environment") or {}
    by_id = {r["nodeid"]: r for r in records}
    names = {
        "subjects": _ordered((r["subject"] for r in records), env.get("subjects")),
        "models": _ordered((r["model"] for r in records), env.get("models")),
        "families": _families(by_id),
        "checks": sorted({r["check"] for r in records}),
        "cases": sorted({r["case"] for r in records}),
    }
    index = {key: {n: i for i, n in enumerate(values)} for key, values in names.items()}
    dtypes_of_cases = case_dtypes()
    dtypes: dict[str, int] = {}
    texts: dict[str, int] = {}
    reproduces: dict[str, int] = {}
    faults: dict[str, int] = {}
    known = getattr(digest, "known_faults", None) or {}
    items = []
    for r in sorted(records, key=lambda r: r["nodeid"]):
        dtype = r.get("dtype") or dtypes_of_cases.get(r["case"]) or NO_DTYPE
        message = r.get("message") or ""
        failure = r.get("failure") if isinstance(r.get("failure"), dict) else {}
        reproduce = str(failure.get("reproduce") or "")
        if reproduce:  # shown in its copy box, from the record's field: left out of the message text
            message = "\n".join(line for line in message.split("\n") if line.strip() != reproduce)
            reproduce = reproduce.removeprefix("reproduce: ")
        item = _item_id(r["nodeid"])
        fault = (known.get(item) or {}).get("id")
        own = f"{r['subject']}-{r['model']}-{r['check'].removeprefix('check_')}-{r['case']}"
        items.append([index["subjects"][r["subject"]], index["models"][r["model"]], index["families"][r["family"]],
                      index["checks"][r["check"]], index["cases"][r["case"]],
                      dtypes.setdefault(str(dtype), len(dtypes)), OUTCOMES.index(r["outcome"]),
                      0 if item == own else item, texts.setdefault(message, len(texts)) if message else -1,
                      faults.setdefault(fault, len(faults)) if fault else -1, _seconds(r.get("duration_s")),
                      reproduces.setdefault(reproduce, len(reproduces)) if reproduce else -1])
    return {"outcomes": list(OUTCOMES), **names, "dtypes": list(dtypes), "faults": list(faults),
            "texts": list(texts), "reproduces": list(reproduces), "items": items}


def _seconds(value) -> float:
    """An item's ``duration_s`` for the page, to the millisecond; -1 where the record has none (a report written
    before kvconform recorded durations, or merged from such shards)."""
    return round(float(value), 3) if isinstance(value, (int, float)) else -1


def _json_for_script(data) -> str:
    """``data`` as JSON safe inside a ``<script>`` element: ``<``, ``>`` and ``&`` as ``\\u`` escapes (a message
    holding ``</script>`` cannot end the element), and the two line separators JavaScript once disallowed."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    for char, escape in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"),
                         ("\u2029", "\\u2029")):
        text = text.replace(char, escape)
    return text


def _e(value) -> str:
    return html.escape(str(value), quote=True)


def _environment_line(env: dict) -> str:
    parts = [f"kvconform {env.get('kvconform', '?')}", f"transformers {env.get('transformers', '?')}",
             f"torch {env.get('torch', '?')}"]
    if env.get("python"):
        parts.append(f"python {env['python']}")
    device = f"device {env.get('device', '?')}"
    if "cuda_available" in env:
        device += f" (CUDA {'available' if env['cuda_available'] else 'not available'})"
    parts.append(device)
    parts.append("known faults " + ("fail (strict)" if env.get("strict") else "xfail"))
    return " · ".join(_e(p) for p in parts)


def _known_faults_html(payload: dict, digest) -> str:
    """The known-fault lines: the xfailed items grouped by entry (by the run's digest) or by reason (a report read
    back), stale entries and XPASS items (``report.known_fault_findings``) — what the terminal's known-fault summary
    prints — or, for a report read back, the xpassed items and a note that stale entries are not in the JSON."""
    from kvconform.report import known_fault_findings

    records = [r for r in payload.get("results") or () if isinstance(r, dict)]
    known = getattr(digest, "known_faults", None) or {}
    groups: dict = {}
    for r in records:
        if r["outcome"] == "xfailed":
            fault = (known.get(_item_id(r["nodeid"])) or {}).get("id")
            groups.setdefault((fault or "", r.get("message") or ""), []).append(r)
    xfails = []
    for (fault, reason), group in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        label = f"<b>{_e(fault)}</b>: " if fault else ""
        xfails.append(f'<li class="kf-xfail"><details><summary>{label}{len(group)} item(s) xfailed — '
                      f'{_e(reason.splitlines()[0][:160] if reason else "no reason given")}</summary>'
                      f'<pre class="msg">{_e(reason)}</pre>{_ids([r["nodeid"] for r in group])}</details></li>')
    findings = []
    if digest is not None and records:
        results = {r["nodeid"]: r for r in records}
        stale, passed = known_fault_findings(results, digest)
        for fault in stale:
            findings.append(f'<li class="kf-stale">stale: {_e(repr(fault["id"]))} (transformers '
                            f'{_e(fault["transformers"])}; {_e(os.path.basename(fault["source"]))}) matched no item '
                            f"of this run's plan</li>")
        verb = "passed (strict)" if digest.strict else "XPASS"
        for label, nodeids in passed.items():
            findings.append(f'<li class="kf-xpass"><details><summary>{verb}: {_e(repr(label))}: {len(nodeids)} '
                            f"item(s) expected to fail passed, e.g. {_e(nodeids[0])}</summary>{_ids(nodeids)}"
                            f"</details></li>")
    else:
        xpassed = [r["nodeid"] for r in records if r["outcome"] == "xpassed"]
        if xpassed:
            findings.append(f'<li class="kf-xpass"><details><summary>XPASS: {len(xpassed)} item(s) expected to '
                            f"fail passed, e.g. {_e(xpassed[0])}</summary>{_ids(xpassed)}</details></li>")
        findings.append('<li class="kf-note">stale entries: not recorded in the JSON report (each run\'s terminal '
                        "summary and its own --kvconform-html page list them)</li>")
    if not xfails and not findings:
        return ""
    out = '<section id="kv-known"><h2>Known faults</h2>'
    if findings:
        out += "<ul>" + "".join(findings) + "</ul>"
    if xfails:
        total = sum(len(g) for g in groups.values())
        # open when short; a sweep of every architecture xfails under dozens of entries: one line until asked
        out += (f'<details{" open" if len(xfails) <= XFAIL_GROUPS_OPEN else ""} id="kv-xfails"><summary>{total} '
                f"item(s) xfailed under {len(xfails)} known fault(s)</summary><ul>" + "".join(xfails)
                + "</ul></details>")
    return out + "</section>"


XFAIL_GROUPS_OPEN = 8
"""The xfailed items' groups (one per known fault) are listed open up to this many, else behind one line."""
IDS_LISTED = 200
"""Node ids listed under one known fault or XPASS line at most (the outcome filter shows them all)."""


def _ids(nodeids: list) -> str:
    more = len(nodeids) - IDS_LISTED
    return ('<ul class="ids">' + "".join(f"<li>{_e(n)}</li>" for n in nodeids[:IDS_LISTED])
            + (f'<li class="muted">and {more} more (the outcome filter shows them)</li>' if more > 0 else "")
            + "</ul>")


def _header_html(payload: dict, digest) -> str:
    env = payload.get("environment") or {}
    parts = [f'<p class="env" id="kv-env">{_environment_line(env)}</p>']
    if env.get("platform"):
        parts.append(f'<p class="env">platform {_e(env["platform"])}</p>')
    if payload.get("complete") is False:
        detail = ", ".join(f"{k} {_e(v)}" for k, v in payload.items()
                           if k not in ("schema", "environment", "results", "complete") and not isinstance(v, (dict,
                                                                                                                 list)))
        parts.append(f'<p class="banner" id="kv-incomplete">This report is incomplete (the run did not finish)'
                     f'{": " + detail if detail else ""}.</p>')
    if env.get("shard"):
        parts.append(f'<p class="env">shard {_e(env["shard"])} of a sharded run (merge the shards\' JSON reports '
                     f"with kvconform-merge --html for the whole run)</p>")
    merged = env.get("merged_from")
    if merged:
        parts.append(f'<p class="env" id="kv-merged">merged from {len(merged)} report(s): '
                     + ", ".join(_e(f"{m.get('path')}" + (f" (shard {m['shard']})" if m.get("shard") else ""))
                                 for m in merged) + "</p>")
    header_lines = list(getattr(digest, "header", None) or ())
    if header_lines:
        parts.append('<details><summary>run header</summary><pre class="msg">'
                     + _e("\n".join(header_lines)) + "</pre></details>")
    arch = env.get("architectures")
    if arch:
        built = [a for a in arch if a.get("built")]
        rows = "".join(f"<li>{_e(a.get('name'))}: "
                       + (_e("built (layers " + "/".join(a.get("layer_types") or ()) + ")") if a.get("built")
                          else _e("not built: " + str(a.get("reason"))))
                       + "</li>" for a in arch)
        parts.append(f"<details><summary>architectures: {len(built)} of {len(arch)} built and checked</summary>"
                     f'<ul class="ids">{rows}</ul></details>')
    other = {k: v for k, v in env.items() if k not in ("kvconform", "transformers", "torch", "python", "device",
                                                           "cuda_available", "strict", "platform", "subjects",
                                                           "models", "shard", "merged_from", "architectures", "power")}
    if other:
        parts.append("<details><summary>environment (other keys)</summary><pre class=\"msg\">"
                     + _e(json.dumps(other, indent=1, ensure_ascii=False, default=str)) + "</pre></details>")
    parts.append(_known_faults_html(payload, digest))
    parts.append(_power_html(payload))
    return "\n".join(parts)


def _power_html(payload: dict) -> str:
    """The power tables of the JSON report's ``power`` section (``report.power_section``): one table per subject,
    families × mutants, cells killed / BLIND / n/a ("·": not expected of that family), then the blind cells with an
    item each; empty when the report has none."""
    from kvconform.report import POWER_NA

    section = payload.get("power")
    if not isinstance(section, dict) or not section.get("subjects"):
        return ""
    mutants = section.get("mutants") or {}
    out = [f'<section id="kv-power"><h2>Power (mutants at each subject\'s interface; pass: '
           f'{_e(section.get("mode", "?"))})</h2>',
           '<p class="env">A mutant is the subject\'s own cache with one planted bug. killed: an item of the family '
           'failed on it; BLIND: items ran it and all passed; n/a: no item ran it to a verdict ('
           + _e("; ".join(f"{why}: {text}" for why, text in POWER_NA.items())) + ').</p>']
    for subject, table in section["subjects"].items():
        names = [n for n in mutants if any(n in cells for cells in table.values())]
        head = "".join(f'<th title="{_e(mutants[n].get("what", ""))}">{_e(n)}</th>' for n in names)
        rows = []
        for family, cells in table.items():
            tds = []
            for n in names:
                cell = cells.get(n)
                status = "·" if cell is None else cell.get("status", "n/a")
                cls = {"killed": "c-pass", "blind": "c-fail", "n/a": "c-skip"}.get(status, "")
                title = ""
                if cell is not None:
                    title = (f'ran {cell.get("ran", 0)}, killed {cell.get("killed", 0)}'
                             + (f', e.g. {cell["killed_by"]}' if cell.get("killed_by") else "")
                             + (f', passed on {cell["blind_items"][0]}' if cell.get("blind_items") else ""))
                text = "BLIND" if status == "blind" else status
                if status == "n/a" and cell is not None and cell.get("why"):
                    text = f"n/a ({cell['why']})"
                    title += f"; {cell['why']}: {POWER_NA.get(cell['why'], '')}"
                tds.append(f'<td class="{cls}" title="{_e(title)}">{_e(text)}</td>')
            rows.append(f"<tr><th>{_e(family)}</th>{''.join(tds)}</tr>")
        out.append(f'<h3>{_e(subject)}</h3><table class="grid power" data-subject="{_e(subject)}"><tr><th>family'
                   f"</th>{head}</tr>{''.join(rows)}</table>")
    blind = [(s, f, n, c) for s, t in section["subjects"].items() for f, cells in t.items()
             for n, c in cells.items() if c.get("status") == "blind"]
    if blind:
        out.append("<ul>" + "".join(
            f'<li class="kf-stale">blind: {_e(s)} × {_e(f)} × {_e(n)} ({_e(mutants.get(n, {}).get("what", ""))}): '
            f'passed on {c.get("ran", 0)} item(s), e.g. {_e((c.get("blind_items") or ["?"])[0])}</li>'
            for s, f, n, c in blind) + "</ul>")
    return "\n".join(out) + "</section>"


def render(payload: dict, digest=None, title: str = "kvconform conformance report") -> str:
    """The page's HTML text for a JSON report ``payload`` (see ``page_data`` for ``digest``)."""
    parts = {"TITLE": _e(title), "HEADER": _header_html(payload, digest), "CSS": _CSS, "SCRIPT": _SCRIPT,
             "DATA": _json_for_script(page_data(payload, digest))}
    # one pass over the template: a part's own text (a message quoting "%DATA%") is never substituted again
    return re.sub(r"%(TITLE|HEADER|CSS|SCRIPT|DATA)%", lambda m: parts[m.group(1)], _TEMPLATE)


def write_html(path: str, payload: dict, digest=None) -> None:
    """Write the page of ``payload`` to ``path`` atomically (``digest.write_atomically``)."""
    from kvconform.digest import write_atomically

    write_atomically(path, render(payload, digest))


_TEMPLATE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>%TITLE%</title>
<style>%CSS%</style>
</head>
<body>
<header>
<h1>%TITLE%</h1>
%HEADER%
</header>
<noscript><p class="banner">This page draws its matrices with JavaScript; the JSON report holds the same
data.</p></noscript>
<section id="kv-controls">
<div class="filters">
<label>subject <select id="f-subject"><option value="">all</option></select></label>
<label>model <input id="f-model" list="kv-model-list" placeholder="all (name or part; commas: any of)" size="28">
<datalist id="kv-model-list"></datalist></label>
<label>family <select id="f-family"><option value="">all</option></select></label>
<label>dtype <select id="f-dtype"><option value="">all</option></select></label>
<label>outcome <select id="f-outcome"><option value="">all</option></select></label>
<button id="f-reset" type="button">reset</button>
</div>
<div id="kv-totals"></div>
<div class="legend"><span class="c-pass">passed</span><span class="c-xfail">xfailed (known fault)</span>
<span class="c-xpass">xpassed</span><span class="c-fail">failed / error</span><span class="c-skip">skipped</span>
<span>cells: passed/ran, xN xfailed, FN failed, skip N; click a cell, a row or a column for its items</span></div>
</section>
<main>
<section><h2>subjects × check families</h2><div class="grid-wrap" id="g-families-wrap"><table class="grid"
id="g-families"></table></div></section>
<section><h2>models × subjects</h2><div class="grid-wrap tall" id="g-models-wrap"><table class="grid"
id="g-models"></table></div></section>
<section><h2 id="kv-failures-title">failures</h2><div id="kv-failures"></div></section>
</main>
<aside id="kv-panel" hidden><div class="panel-head"><h2 id="kv-panel-title"></h2>
<button id="kv-panel-close" type="button" title="close (Esc)">×</button></div><div id="kv-panel-body"></div></aside>
<script type="application/json" id="kv-data">%DATA%</script>
<script>%SCRIPT%</script>
</body>
</html>
"""

_CSS = """
*{box-sizing:border-box}
body{font:13px/1.4 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif;margin:0;
 color:#1b1b1b;background:#f6f7f9}
header,#kv-controls,main>section{padding:6px 16px}
header{background:#fff;border-bottom:1px solid #d8dbe0}
h1{font-size:18px;margin:4px 0}
h2{font-size:14px;margin:10px 0 4px}
.env{margin:2px 0;color:#333}
.banner{background:#b71c1c;color:#fff;padding:6px 10px;font-weight:600}
#kv-known ul{margin:2px 0;padding-left:18px}
#kv-known li{margin:1px 0}
.kf-stale,.kf-xpass{color:#6a4b00}
.kf-note{color:#666}
ul.ids{font:11px/1.3 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;max-height:14em;overflow:auto}
#kv-controls{background:#f6f7f9;border-bottom:1px solid #d8dbe0}
.filters{display:flex;flex-wrap:wrap;gap:6px 14px;align-items:center}
.filters select,.filters input{font:inherit;max-width:22em}
#kv-totals{margin:4px 0}
#kv-totals button{font:inherit;border:1px solid #bbb;border-radius:3px;padding:0 6px;margin-right:4px;cursor:pointer}
.legend{display:flex;flex-wrap:wrap;gap:4px 8px;font-size:11px;color:#444}
.legend span{padding:0 5px;border-radius:2px}
.grid-wrap{max-height:70vh;overflow:auto;border:1px solid #c9ccd1;background:#fff;display:inline-block;max-width:100%}
.grid-wrap.tall{max-height:80vh}
table.grid{border-collapse:separate;border-spacing:0;font:11px/1.25 ui-monospace,SFMono-Regular,Menlo,Consolas,
 monospace}
table.grid th,table.grid td{padding:1px 5px;border-right:1px solid #fff;border-bottom:1px solid #fff;
 white-space:nowrap}
table.grid thead th{position:sticky;top:0;z-index:2;background:#eceef1;vertical-align:bottom;cursor:pointer;
 font-weight:600}
table.grid thead th.col>span{writing-mode:vertical-rl;transform:rotate(180deg);display:inline-block;
 max-height:170px;overflow:hidden;text-overflow:ellipsis}
table.grid thead th.corner{left:0;z-index:3;text-align:left;cursor:default;color:#555;font-weight:400}
table.grid tbody th{position:sticky;left:0;z-index:1;background:#f3f4f6;text-align:left;font-weight:600;
 max-width:280px;overflow:hidden;text-overflow:ellipsis;cursor:pointer;border-right:1px solid #c9ccd1}
table.grid tbody tr:hover th{background:#dde3ea}
td.cell{text-align:center;min-width:3.6em;cursor:pointer}
td.cell:hover,td.cell.sel{outline:2px solid #1550a8;outline-offset:-2px}
td.c-none{cursor:default;background:#fff}
.c-pass{background:#bfe3c1;color:#0d3d12}
.c-xfail{background:#ffe08a;color:#4d3800}
.c-xpass{background:#c9b6ef;color:#2b1657}
.c-fail{background:#d32f2f;color:#fff;font-weight:700}
.c-skip{background:#e3e5e8;color:#555}
#kv-panel{position:fixed;top:0;right:0;height:100vh;width:min(980px,62vw);background:#fff;z-index:10;
 box-shadow:-4px 0 16px rgba(0,0,0,.18);display:flex;flex-direction:column}
#kv-panel[hidden]{display:none}
.panel-head{display:flex;justify-content:space-between;align-items:center;padding:6px 12px;
 border-bottom:1px solid #d8dbe0;background:#f3f4f6}
.panel-head h2{margin:0;font-size:14px}
#kv-panel-close{font-size:20px;border:0;background:none;cursor:pointer}
#kv-panel-body{overflow:auto;padding:6px 12px;flex:1}
.item{border-bottom:1px solid #eee;padding:2px 0}
.item summary,.item .line{cursor:pointer;font:12px/1.4 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
.item .line{cursor:default;padding-left:14px}
.badge{display:inline-block;min-width:5.5em;padding:0 4px;margin-right:6px;border-radius:2px;text-align:center;
 font-weight:600}
pre.msg{white-space:pre-wrap;word-break:break-word;background:#f7f7f9;border:1px solid #e2e4e8;padding:6px 8px;
 margin:4px 0;font:12px/1.4 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;max-height:32em;overflow:auto}
.repro{display:flex;gap:6px;align-items:flex-start;margin:2px 0 6px}
.repro code{flex:1;background:#eef3fb;border:1px solid #c9d6ee;padding:3px 6px;white-space:pre-wrap;
 overflow-wrap:anywhere;font:12px/1.4 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
.repro button{font:inherit;cursor:pointer}
.more{margin:6px 0;font:inherit;cursor:pointer}
.muted{color:#666}
"""

_SCRIPT = r"""
(function () {
"use strict";
const D = JSON.parse(document.getElementById("kv-data").textContent);
const O = D.outcomes;
const OI = Object.fromEntries(O.map((o, i) => [o, i]));
const ownId = a => [D.subjects[a[0]], D.models[a[1]], D.checks[a[3]].replace(/^check_/, ""), D.cases[a[4]]].join("-");
const items = D.items.map(a => ({s: a[0], m: a[1], f: a[2], c: a[3], k: a[4], d: a[5], o: a[6], msg: a[8],
                                 fault: a[9], id: a[7] || ownId(a), sec: a.length > 10 ? a[10] : -1,
                                 rep: a.length > 11 ? a[11] : -1}));
const BAD = new Set([OI.failed, OI.error, OI.internal]);
const RANK = [OI.failed, OI.error, OI.internal, OI.xpassed, OI.xfailed, OI.passed, OI.skipped];
const $ = id => document.getElementById(id);

function el(tag, props, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(props || {})) {
    if (k === "class") e.className = v;
    else if (k.startsWith("data-")) e.setAttribute(k, v);
    else e[k] = v;
  }
  for (const kid of kids) if (kid !== null && kid !== undefined) e.append(kid);  // strings become text nodes
  return e;
}

// ---------------------------------------------------------------------------------------------- filters
const F = {subject: "", model: "", family: "", dtype: "", outcome: ""};
function fill(select, names) {
  names.forEach((n, i) => select.append(el("option", {value: String(i)}, n)));
}
fill($("f-subject"), D.subjects);
fill($("f-family"), D.families);
fill($("f-dtype"), D.dtypes);
const present = O.filter(o => items.some(it => it.o === OI[o]));
$("f-outcome").append(el("option", {value: "bad"}, "failed or error"));
present.forEach(o => $("f-outcome").append(el("option", {value: o}, o)));
D.models.forEach(n => $("kv-model-list").append(el("option", {value: n})));

function modelMatcher(text) {
  const terms = text.split(",").map(t => t.trim().toLowerCase()).filter(Boolean);
  if (!terms.length) return null;
  const exact = new Set(D.models.map(m => m.toLowerCase()));
  const ok = D.models.map(m => {
    const name = m.toLowerCase();
    return terms.some(t => exact.has(t) ? name === t : name.includes(t));
  });
  return i => ok[i];
}
function selected() {
  const s = F.subject === "" ? -1 : +F.subject, f = F.family === "" ? -1 : +F.family;
  const d = F.dtype === "" ? -1 : +F.dtype, mm = modelMatcher(F.model);
  const o = F.outcome;
  return items.filter(it => (s < 0 || it.s === s) && (f < 0 || it.f === f) && (d < 0 || it.d === d)
    && (!mm || mm(it.m)) && (o === "" || (o === "bad" ? BAD.has(it.o) : it.o === OI[o])));
}

// ---------------------------------------------------------------------------------------------- cells
function counts(list) {
  const c = O.map(() => 0);
  for (const it of list) c[it.o]++;
  return c;
}
function cellText(c) {  // the terminal matrix's cell (report._cell)
  const ran = c[OI.passed] + c[OI.failed] + c[OI.error] + c[OI.xfailed] + c[OI.xpassed] + c[OI.internal];
  const bad = c[OI.failed] + c[OI.error];
  if (ran === 0) return c[OI.skipped] ? "skip " + c[OI.skipped] : "n/a";
  let t = (c[OI.passed] + c[OI.xpassed]) + "/" + ran;
  if (c[OI.xfailed]) t += " x" + c[OI.xfailed];
  if (bad) t += " F" + bad;
  if (c[OI.internal]) t += " K" + c[OI.internal];  // kvconform's own errors (report._cell)
  return t;
}
function cellClass(c) {
  if (c[OI.failed] + c[OI.error] + c[OI.internal]) return "c-fail";
  if (c[OI.xpassed]) return "c-xpass";
  if (c[OI.xfailed]) return "c-xfail";
  if (c[OI.passed]) return "c-pass";
  return "c-skip";
}
function cellTitle(c) {
  return O.map((o, i) => c[i] ? c[i] + " " + o : "").filter(Boolean).join(", ");
}

// ---------------------------------------------------------------------------------------------- grids
function grid(table, spec, list) {
  // spec: {rows: names, cols: names, row: item -> row index, col: item -> col index, rowKey, colKey, corner}
  const cells = new Map(), rowsUsed = new Set(), colsUsed = new Set();
  for (const it of list) {
    const r = spec.row(it), c = spec.col(it), key = r + "," + c;
    if (!cells.has(key)) cells.set(key, []);
    cells.get(key).push(it);
    rowsUsed.add(r); colsUsed.add(c);
  }
  const cols = spec.cols.map((n, i) => i).filter(i => colsUsed.has(i));
  const rows = spec.rows.map((n, i) => i).filter(i => rowsUsed.has(i));
  table.replaceChildren();
  const head = el("tr", {}, el("th", {class: "corner"}, spec.corner));
  for (const c of cols) {
    const th = el("th", {class: "col", title: spec.cols[c], "data-col": spec.cols[c]}, el("span", {}, spec.cols[c]));
    th.addEventListener("click", () => openPanel(spec.colLabel(spec.cols[c]), list.filter(it => spec.col(it) === c)));
    head.append(th);
  }
  table.append(el("thead", {}, head));
  const body = el("tbody");
  for (const r of rows) {
    const rowName = spec.rows[r];
    const th = el("th", {title: rowName, "data-row": rowName}, rowName);
    th.addEventListener("click", () => openPanel(spec.rowLabel(rowName), list.filter(it => spec.row(it) === r)));
    const tr = el("tr", {}, th);
    for (const c of cols) {
      const these = cells.get(r + "," + c);
      if (!these) {
        tr.append(el("td", {class: "cell c-none", "data-row": rowName, "data-col": spec.cols[c]}));
        continue;
      }
      const cnt = counts(these);
      const td = el("td", {class: "cell " + cellClass(cnt), "data-row": rowName, "data-col": spec.cols[c],
                           title: rowName + " × " + spec.cols[c] + ": " + cellTitle(cnt)}, cellText(cnt));
      td.addEventListener("click", () => {
        document.querySelectorAll("td.cell.sel").forEach(x => x.classList.remove("sel"));
        td.classList.add("sel");
        openPanel(rowName + " × " + spec.cols[c], these);
      });
      tr.append(td);
    }
    body.append(tr);
  }
  table.append(body);
}

// ---------------------------------------------------------------------------------------------- items
function itemTitle(it) {
  return it.sec >= 0 ? it.id + " (" + (it.sec < 1 ? Math.round(it.sec * 1000) + " ms" : it.sec.toFixed(2) + " s")
                       + ")" : it.id;
}
function itemView(it, open) {
  const o = O[it.o], text = it.msg >= 0 ? D.texts[it.msg] : "";
  const label = [D.subjects[it.s], D.models[it.m], D.checks[it.c], D.cases[it.k], D.dtypes[it.d]].join(" · ");
  const badge = el("span", {class: "badge " + cellClass(counts([it]))}, o);
  const fault = it.fault >= 0 ? el("span", {class: "muted"}, "  [known fault " + D.faults[it.fault] + "]") : null;
  const box = el("div", {class: "item o-" + o, "data-id": it.id, "data-outcome": o});
  if (!text) {
    box.append(el("div", {class: "line", title: itemTitle(it)}, badge, label, fault));
    return box;
  }
  // a failure's summary line also says what was measured (its message's second line), so a list of failures reads
  // at a glance; the whole message is one click away
  const lines = BAD.has(it.o) ? text.split("\n").map(l => l.trim()).filter(Boolean) : [];
  const hint = lines.length > 1 ? el("span", {class: "muted"}, "  " + lines[1].slice(0, 160)) : null;
  const det = el("details", {open: !!open}, el("summary", {title: itemTitle(it)}, badge, label, fault, hint));
  // the reproduce command comes from the record's failure field (left out of the message text, shown once below)
  const repro = it.rep >= 0 ? D.reproduces[it.rep] : null;
  det.append(el("pre", {class: "msg"}, text));
  if (repro) {
    const code = el("code", {}, repro);
    const copy = el("button", {type: "button", title: "copy the reproduce line"}, "copy");
    copy.addEventListener("click", () => {
      const done = () => { copy.textContent = "copied"; setTimeout(() => { copy.textContent = "copy"; }, 1200); };
      if (navigator.clipboard && navigator.clipboard.writeText) {
        navigator.clipboard.writeText(repro).then(done, () => selectText(code));
      } else {
        selectText(code);
      }
    });
    det.append(el("div", {class: "repro"}, el("span", {class: "muted"}, "reproduce:"), code, copy));
  }
  det.append(el("div", {class: "muted"}, "item id: " + it.id));
  box.append(det);
  return box;
}
function selectText(node) {
  const range = document.createRange();
  range.selectNodeContents(node);
  const sel = window.getSelection();
  sel.removeAllRanges(); sel.addRange(range);
}
function sortItems(list) {
  const rank = o => RANK.indexOf(o);
  return list.slice().sort((a, b) => rank(a.o) - rank(b.o) || a.s - b.s || a.m - b.m || a.c - b.c || a.k - b.k);
}
function listInto(node, list, limit, openBad) {
  node.replaceChildren();
  const sorted = sortItems(list);
  let shown = 0;
  function more() {
    const end = Math.min(sorted.length, shown + limit);
    for (; shown < end; shown++) node.append(itemView(sorted[shown], openBad && BAD.has(sorted[shown].o)));
    const old = node.querySelector("button.more");
    if (old) old.remove();
    if (shown < sorted.length) {
      const b = el("button", {type: "button", class: "more"}, "show " + Math.min(limit, sorted.length - shown)
                   + " more of " + (sorted.length - shown));
      b.addEventListener("click", more);
      node.append(b);
    }
  }
  more();
}
function openPanel(title, list) {
  const c = counts(list);
  $("kv-panel-title").textContent = title + " — " + list.length + " item(s): " + cellTitle(c);
  listInto($("kv-panel-body"), list, 400, true);
  $("kv-panel").hidden = false;
}
$("kv-panel-close").addEventListener("click", () => { $("kv-panel").hidden = true; });
document.addEventListener("keydown", e => { if (e.key === "Escape") $("kv-panel").hidden = true; });

// ---------------------------------------------------------------------------------------------- page
function totals(list) {
  const c = counts(list), node = $("kv-totals");
  node.replaceChildren(el("span", {id: "kv-count", "data-count": String(list.length)},
                          list.length + " of " + items.length + " items: "));
  O.forEach((o, i) => {
    if (!c[i]) return;
    const b = el("button", {type: "button", class: cellClass(counts([{o: i}])), "data-outcome": o,
                            "data-count": String(c[i]), title: "show only " + o}, c[i] + " " + o);
    b.addEventListener("click", () => { $("f-outcome").value = o; F.outcome = o; draw(); });
    node.append(b);
  });
}
function draw() {
  const list = selected();
  totals(list);
  grid($("g-families"), {rows: D.subjects, cols: D.families, row: it => it.s, col: it => it.f,
                         corner: "subject \\ family", rowLabel: n => "subject " + n, colLabel: n => "family " + n},
       list);
  grid($("g-models"), {rows: D.models, cols: D.subjects, row: it => it.m, col: it => it.s,
                       corner: "model \\ subject", rowLabel: n => "model " + n, colLabel: n => "subject " + n}, list);
  const bad = list.filter(it => BAD.has(it.o));
  $("kv-failures-title").textContent = bad.length ? "failures (" + bad.length + ")" : "failures: none";
  listInto($("kv-failures"), bad, 200, false);
}
for (const [key, id, ev] of [["subject", "f-subject", "change"], ["family", "f-family", "change"],
                             ["dtype", "f-dtype", "change"], ["outcome", "f-outcome", "change"],
                             ["model", "f-model", "input"]]) {
  $(id).addEventListener(ev, () => { F[key] = $(id).value; draw(); });
}
$("f-reset").addEventListener("click", () => {
  for (const [key, id] of [["subject", "f-subject"], ["family", "f-family"], ["dtype", "f-dtype"],
                           ["outcome", "f-outcome"], ["model", "f-model"]]) { $(id).value = ""; F[key] = ""; }
  draw();
});
draw();
document.body.setAttribute("data-ready", "1");
})();
"""
