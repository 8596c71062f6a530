#!/usr/bin/env python3
"""Generate the example blocks of README.md and docs/ (matrices, default-run counts) from a real run, kept fresh.

    python ci/readme_examples.py REPORT.json [--wall SECONDS] [--write | --check]

REPORT.json is the ``--kvconform-json`` report of a default ``pytest --kvconform`` run in an empty folder. The
blocks between ``<!-- readme_examples:NAME -->`` and ``<!-- /readme_examples:NAME -->`` in README.md and the pages of
docs/ (``files()``; one block may sit in several files) are rendered from it with kvconform's own matrix code
(``kvconform.report.matrix``): ``matrix`` (the two tables, cut to a few rows and columns) and ``counts`` (the sentence
giving the run's items, outcomes and wall time — ``--wall`` from ``ci/bench_loop.sh``). ``--write`` rewrites those
files; ``--check`` exits 1 when one differs; neither: print the blocks. ``tests/project/test_readme.py`` checks the
committed blocks against the current code and plan, and that every copy of a block is the same.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def files() -> list[Path]:
    """README.md and the pages of docs/: every file that may hold generated blocks."""
    return [README, *sorted((ROOT / "docs").glob("*.md"))]
SUBJECT_ROWS = ("ReferenceCache", "DynamicCache", "StaticCache", "QuantizedCache_hqq4")
MODEL_ROWS = ("llama", "mistral", "jamba")
MODEL_COLS = 4
FIRST_FAMILIES, LAST_FAMILIES = 5, 2


def _lines(title, header, rows) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *[[n, *c] for n, c in rows])]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [title, fmt.format(*header).rstrip(), *(fmt.format(n, *c).rstrip() for n, c in rows)]


def render(results: list, wall: float | None = None) -> dict[str, str]:
    """``{block name: text}`` rendered from the JSON report's ``results``."""
    sys.path.insert(0, str(ROOT))
    from kvconform.report import _families, matrix

    by_id = {r["nodeid"]: r for r in results}
    fams = _families(by_id)
    cut = fams[:FIRST_FAMILIES] + ["..."] + fams[-LAST_FAMILIES:] if len(fams) > FIRST_FAMILIES + LAST_FAMILIES \
        else fams
    shown = [f for f in cut if f != "..."]
    rows = {name: dict(zip(shown, cells)) for name, cells, _ in matrix(by_id, "subject", shown, "family")}
    subject_rows = [(s, [rows[s].get(f, "...") if f != "..." else "..." for f in cut]) for s in SUBJECT_ROWS
                    if s in rows]
    subjects = [s for s in dict.fromkeys(r["subject"] for r in results)]
    order = [s for s in ("ReferenceCache", "DynamicCache", "StaticCache", "QuantizedCache_quanto4") if s in subjects]
    mrows = {name: cells for name, cells, _ in matrix(by_id, "model", order[:MODEL_COLS], "subject")}
    model_rows = [(m, mrows[m]) for m in MODEL_ROWS if m in mrows]
    table = _lines("subjects × check families (passed/ran, xN = known faults xfailed, FN = failed):",
                   ["subject", *cut], subject_rows) + ["..."] + [""] + \
        _lines("models × subjects:", ["model", *order[:MODEL_COLS], "..."], [(m, [*c, ""]) for m, c in model_rows]) \
        + ["..."]
    counts = collections.Counter(r["outcome"] for r in results)
    ran = sum(counts[o] for o in ("passed", "xpassed", "failed", "xfailed", "error"))
    sentence = (f"{len(results):,} items: {counts['passed']:,} pass, {counts['xfailed']:,} known upstream faults "
                f"xfail, {counts['failed'] + counts['error']:,} fail, {counts['skipped']:,} skip with their reasons"
                f" ({ran:,} ran)")
    if wall is not None:
        sentence = f"about {round(wall / 5) * 5:.0f} s wall on 2 CPU cores for " + sentence
    return {"matrix": "```\n" + "\n".join(table) + "\n```", "counts": sentence}


def blocks(text: str) -> dict[str, str]:
    """``{name: content}`` of the README's generated blocks."""
    return {m.group(1): m.group(2).strip("\n") for m in
            re.finditer(r"<!-- readme_examples:(\w+) -->\n?(.*?)\n?<!-- /readme_examples:\1 -->", text, re.S)}


def replace(text: str, rendered: dict[str, str]) -> str:
    for name, content in rendered.items():
        text = re.sub(rf"(<!-- readme_examples:{name} -->\n?)(.*?)(\n?<!-- /readme_examples:{name} -->)",
                      lambda m: m.group(1) + content + m.group(3), text, flags=re.S)
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report")
    parser.add_argument("--wall", type=float, default=None, help="median wall seconds of the default run")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true")
    mode.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    rendered = render(json.loads(Path(args.report).read_text())["results"], args.wall)
    if not (args.write or args.check):
        for name, content in rendered.items():
            print(f"--- {name}\n{content}")
        return 0
    stale = []
    for path in files():
        text = path.read_text()
        new = replace(text, rendered)
        if new != text:
            stale.append(path.relative_to(ROOT))
            if args.write:
                path.write_text(new)
    if args.check and stale:
        print(f"the generated blocks of {', '.join(map(str, stale))} differ from the report; run with --write",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
